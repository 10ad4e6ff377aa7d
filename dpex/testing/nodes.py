"""Helpers for tests whose nodes are separate hosts (namespaces, containers).

    python -m dpex.testing.nodes data DIR NODE N        # this node's own copy of the data
    python -m dpex.testing.nodes train ADDRESS N EPOCHS DELAY_S

``train`` prints ``batch EPOCH I`` per batch, then ``RESULT <json>``: for each
epoch, each batch's sample ids and the node whose file each sample came from.
"""
from __future__ import annotations

import json
import os
import sys


def write_node_data(directory: str, node: str, samples: int) -> None:
    """Sample i is the file ``i.txt`` holding ``NODE:i`` (see datasets.NodeFiles)."""
    os.makedirs(directory, exist_ok=True)
    for i in range(samples):
        with open(os.path.join(directory, f"{i}.txt"), "w") as f:
            f.write(f"{node}:{i}")


def train(address: str, samples: int, epochs: int, delay_s: float) -> None:
    import dpex
    spec = dpex.DatasetSpec("dpex.testing.datasets:NodeFiles", n=samples, delay_s=delay_s)
    result = []
    with dpex.RemoteDataLoader(address, spec, batch_size=4, timeout=120, connect_timeout=60) as loader:
        for epoch in range(epochs):
            batches = []
            for i, batch in enumerate(loader):
                batches.append({"i": batch["i"].tolist(), "node": batch["node"]})
                print(f"batch {epoch} {i}", flush=True)
            result.append(batches)
    print("RESULT " + json.dumps(result), flush=True)


def check(result: list, samples: int, workers: set[str]) -> None:
    """Every batch id exactly once and in order, each sample read by a worker."""
    expected = [list(range(i, min(i + 4, samples))) for i in range(0, samples, 4)]
    for epoch in result:
        assert [b["i"] for b in epoch] == expected, "a batch was lost, duplicated or out of order"
        nodes = {n for b in epoch for n in b["node"]}
        assert nodes and nodes <= workers, f"samples read by {nodes - workers or 'nobody'}"


if __name__ == "__main__":
    if sys.argv[1] == "data":
        write_node_data(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1] == "train":
        train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    else:
        sys.exit(__doc__)
