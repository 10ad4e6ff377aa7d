"""Coordinated reads (issue 59): variable-length "text" (lengths heavy-tailed, as real
corpora), 4 ranks under torchrun (gloo, CPU), a small transformer whose step cost grows
with the padded length, fed by Dpex two ways with the same batch size: DistributedSampler
(each rank's batch padded to its longest; a DDP step waits for the slowest rank) and
``dpex.BucketBatchSampler`` (each step's batches across the ranks from one length bucket).
With ``--iterable``, the same text as an IterableDataset each rank reads its shard of
(``TokenStream``), fed two ways: as it streams, and bucketed on the fly in the streams
(``RemoteDataLoader(lengths=fn)``, dpex.BucketedIterable). Alternating rounds, one cluster.

    .venv/bin/python benchmarks/coordinated.py [--rounds 2] [--samples 2048] [--ranks 4] [--iterable]

Prints per round and as medians: seconds per step, padded tokens per step (the longest
rank's batch, as the step waits for it) and the share of padding; every sample once per
epoch is checked.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dpex.testing import test_cluster  # noqa: E402

RANK = r'''
import json, os, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler
import dpex
from dpex.testing.datasets import TokenStream, Tokens, heavy_tailed_lengths, pad_tokens

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mode, samples, batch, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
lengths = heavy_tailed_lengths(samples)
dataset = Tokens(lengths)
if mode == "coordinated":
    kw = dict(batch_sampler=dpex.BucketBatchSampler(lengths, batch, num_replicas=world, rank=rank, seed=1))
elif mode == "stream":
    dataset, kw = TokenStream(lengths), dict(batch_size=batch)
elif mode == "bucketed":
    dataset, kw = TokenStream(lengths), dict(batch_size=batch, lengths=lambda s: len(s["tokens"]), seed=1)
else:
    kw = dict(batch_size=batch, sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, seed=1))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 1)

    def forward(self, tokens):
        h = self.encoder(self.embed(tokens), src_key_padding_mask=tokens == 0)
        return self.head(h[:, 0]).mean()


model = nn.parallel.DistributedDataParallel(Model())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = dpex.RemoteDataLoader(os.environ["DPEX_DISPATCHER"], dataset, collate_fn=pad_tokens, timeout=120, **kw)
seen, steps, padded, real = [], [], [], []
for b in loader:
    begun = time.perf_counter()
    loss = model(b["tokens"])
    opt.zero_grad()
    loss.backward()
    opt.step()
    steps.append(time.perf_counter() - begun)
    seen += b["i"].tolist()
    padded.append(b["tokens"].numel())
    real.append(int((b["tokens"] != 0).sum()))
loader.close()
with open(f"{out}.{rank}", "w") as f:
    json.dump(dict(seen=seen, steps=steps, padded=padded, real=real), f)
dist.destroy_process_group()
'''


def run(address: str, mode: str, samples: int, batch: int, ranks: int, tmp: str) -> dict:
    script = os.path.join(tmp, "rank.py")
    with open(script, "w") as f:
        f.write(RANK)
    out = os.path.join(tmp, mode)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", f"--nproc_per_node={ranks}", "--log-dir",
                           os.path.join(tmp, "elastic"), script, mode, str(samples), str(batch), out],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "DPEX_DISPATCHER": address, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    per_rank = [json.load(open(f"{out}.{r}")) for r in range(ranks)]
    seen = sorted(i for r in per_rank for i in r["seen"])
    assert set(seen) == set(range(samples)), "every sample once per epoch (padding repeats a few)"
    if mode in ("stream", "bucketed"):
        assert seen == list(range(samples)), "every sample exactly once"
    n = len(per_rank[0]["steps"])
    step_s = [max(r["steps"][k] for r in per_rank) for k in range(n)][2:]  # a step lasts as its slowest rank
    longest = [max(r["padded"][k] for r in per_rank) for k in range(n)]
    padded = sum(sum(r["padded"]) for r in per_rank)
    real = sum(sum(r["real"]) for r in per_rank)
    return dict(step_s=statistics.median(step_s), epoch_s=sum(step_s), longest=statistics.mean(longest),
                padding=1 - real / padded, steps=n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iterable", action="store_true", help="an IterableDataset, bucketed on the fly")
    args = parser.parse_args()
    modes = ("stream", "bucketed") if args.iterable else ("distributed", "coordinated")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    print(f"{args.samples} samples of heavy-tailed lengths, batches of {args.batch}, {args.ranks} ranks (gloo)")
    print(f"{'round':>5}  {'plan':<12} {'steps':>5}  {'s/step':>7}  {'epoch s':>7}  {'longest tokens':>14}  {'padding':>7}")
    with test_cluster(num_workers=2) as c, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                got = run(c.address, mode, args.samples, args.batch, args.ranks, tmp)
                results[mode].append(got)
                print(f"{r:>5}  {mode:<12} {got['steps']:>5}  {got['step_s']:>7.4f}  {got['epoch_s']:>7.2f}  "
                      f"{got['longest']:>14.0f}  {100 * got['padding']:>6.1f}%")
    med = {m: {k: statistics.median(x[k] for x in rs) for k in ("step_s", "epoch_s", "longest", "padding")}
           for m, rs in results.items()}
    d, c_ = med[modes[0]], med[modes[1]]
    print(f"medians: {'DistributedSampler' if modes[0] == 'distributed' else 'as it streams'} {d['step_s']:.4f} "
          f"s/step, {100 * d['padding']:.1f}% padding; {modes[1]} "
          f"{c_['step_s']:.4f} s/step, {100 * c_['padding']:.1f}% padding: steps {d['step_s'] / c_['step_s']:.2f}x "
          f"faster, the epoch {d['epoch_s'] / c_['epoch_s']:.2f}x, padded tokens per step "
          f"{d['longest'] / c_['longest']:.2f}x fewer")


if __name__ == "__main__":
    main()
