"""A trainer for the multi-node tests: prints a line per batch, then a result."""
import json
import sys

import dpex

address, samples, epochs, delay_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
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
