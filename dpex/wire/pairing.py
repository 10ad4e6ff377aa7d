"""How a trainer's Fetch stream and a worker agree how frames travel, in the
stream's metadata: a trainer on the worker's host (the same ``dpex.shm.host_id``)
maps /dev/shm files; one on another host may ask for its frames on the
worker's data port (dpex.worker.dataport), where it connects and first sends
the key the worker answered with. The client and the worker share these."""
from __future__ import annotations

HOST_METADATA = "dpex-host"       # the trainer's host id: the same as the worker's, it may map files
REQUEST_METADATA = "dpex-data"    # "1": the trainer asks for its frames on the data port
PORT_METADATA = "dpex-data-port"  # the worker's answer: the data port to connect to...
KEY_METADATA = "dpex-data-key"    # ...and the key (hex) to send there first
KEY_BYTES = 16                    # a data port key's length
