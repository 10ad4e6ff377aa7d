"""Where a trainer's time goes, as a verdict a user can act on, and what k
workers would give: the one home of the arithmetic that ``loader.stats()``,
the autoscaler's need (dpex.dispatcher.scaling takes the need the trainers
report, computed here) and ``dpex status`` share, so that advice, prediction
and scaling never disagree.

The verdict is one word of a fixed vocabulary (:data:`VERDICTS`) with its
reason in words, the first that holds of:

- ``none``: the trainer hardly waits (at most 10 % of the time): its own step
  is the limit, more workers buy nothing;
- ``straggler``: one worker makes its batches much slower than its peers (2x
  their median, not counting the time its processes waited for a core), and
  the trainer, which takes batches in order, waits for it;
- ``network``: reading frames off the workers' data sockets takes half the
  time between batches or more;
- ``trainer``: decoding and pinning on the trainer take half the time it
  waits or more;
- ``storage``: the dataset's own code waits (its wall time, less the time it
  waited for a core, twice its CPU time or more): more processes per worker
  (``--processes``) help without more cores;
- ``workers``: the workers' processes are busy: add workers; the reason gives
  the shares of a batch's time in the dataset's code, collation and Dpex.
"""
from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

VERDICTS = ("none", "workers", "storage", "network", "trainer", "straggler")

INPUT_BOUND_WAIT_FRACTION = 0.1  # waiting more than this share of the time: data is the bottleneck
MAX_SCALE_STEP = 4               # the need is at most this many times the live workers: a step, then measure
STRAGGLER_RATIO = 2.0            # a worker this many times slower than its peers' median holds them back
STORAGE_RATIO = 2.0              # the dataset's wall time this many times its CPU time: it waits
SHARE = 0.5                      # a trainer-side stage this share of the time it bounds is the limit


@dataclass(frozen=True)
class Figures:
    """What a trainer measured: ``batches`` taken in ``elapsed_s`` (inside
    epochs), ``wait_s`` of it blocked in ``next()``; ``stages``: mean seconds
    per batch by stage (the batch process's, as ``LoaderStats.stages`` names
    them, and the trainer's ``receive``, ``decode``, ``pin``); ``per_worker``:
    the mean seconds a batch took in its batch process, less the time it waited
    for a core, by worker address."""
    batches: int
    elapsed_s: float
    wait_s: float
    workers_alive: int
    stages: Mapping[str, float] = field(default_factory=dict)
    per_worker: Mapping[str, float] = field(default_factory=dict)
    processes: float = 0.0  # the workers' batch processes each, on average (0: not known)

    @property
    def wait_fraction(self) -> float:
        return self.wait_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def input_bound(self) -> bool:
        return self.wait_fraction > INPUT_BOUND_WAIT_FRACTION

    @property
    def rate(self) -> float:
        """Batches per second the trainer took."""
        return self.batches / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def computing_s(self) -> float:
        """The trainer's own time per batch, between batches (its step)."""
        return (self.elapsed_s - self.wait_s) / self.batches if self.batches else 0.0


def reported(wait_fraction: float, batches_per_s: float, workers_alive: int, processes: float = 0.0,
             window_s: float = 10.0) -> Figures:
    """Figures equal, for :func:`predict` and :func:`need`, to a window a trainer
    reported (its wait share, rate, live workers and their processes: a dpex.v1.Verdict)."""
    return Figures(round(batches_per_s * window_s), window_s, wait_fraction * window_s, workers_alive,
                   processes=processes)


def need(f: Figures, capped: bool = True) -> int:
    """Workers of the measured speed that keep the trainer from waiting (the
    live ones if it hardly waits): the fewest for which :func:`predict` reaches
    the trainer's own limit; ``capped``: at most MAX_SCALE_STEP times the live ones."""
    alive = f.workers_alive
    computing = f.elapsed_s - f.wait_s
    if not f.input_bound:
        return alive
    step = MAX_SCALE_STEP * max(1, alive)
    if computing <= 0:  # a trainer that does nothing between batches would wait for any number
        return step if capped else sys.maxsize
    wanted = math.ceil(alive * f.elapsed_s / computing - 1e-9)
    return min(wanted, step) if capped else wanted


def predict(f: Figures, workers: int | None = None, processes: int | None = None) -> float:
    """The batches/s the trainer would take with ``workers`` workers like the
    live ones (default: as many as now), each with ``processes`` batch
    processes (default: as now): their supply scales with their number, and
    with their processes where those wait on storage (a ``storage`` verdict:
    on the same cores; CPU-bound processes gain nothing past the cores), up to
    what the trainer's own step allows. A trainer that hardly waits shows no
    more of its workers' speed than its own: more give the same; fewer, at
    least their share of today's rate."""
    if f.batches == 0 or f.workers_alive == 0:
        return 0.0
    supply = f.rate * (f.workers_alive if workers is None else workers) / f.workers_alive
    if processes is not None:
        if not f.processes:
            raise ValueError("the workers' processes are not known (an IterableDataset's streams, or older workers)")
        supply *= processes / f.processes
    if not f.input_bound:
        return min(f.rate, supply)
    computing = f.computing_s
    return min(supply, 1 / computing) if computing > 0 else supply


def verdict(f: Figures) -> tuple[str, str]:
    """The verdict (a word of VERDICTS) and its reason in words."""
    waited = f"the trainer waited {100 * f.wait_fraction:.0f}% of the time"
    if not f.input_bound:
        return "none", f"{waited}: its own step is the limit; more workers buy nothing"
    stages = f.stages
    if len(f.per_worker) >= 2:
        slowest = max(f.per_worker, key=f.per_worker.__getitem__)
        peers = statistics.median(v for a, v in f.per_worker.items() if a != slowest)
        if peers > 0 and f.per_worker[slowest] >= STRAGGLER_RATIO * peers:
            return "straggler", (f"{waited}; worker {slowest} takes {_ms(f.per_worker[slowest])} a batch, its "
                                 f"peers {_ms(peers)}: the batches it owes hold the others back (its data or host "
                                 "is slower)")
    interval = f.elapsed_s / f.batches if f.batches else 0.0
    receive = stages.get("receive", 0.0) / max(1, f.workers_alive)  # the workers' sockets are read at once
    if interval > 0 and receive >= SHARE * interval:
        return "network", (f"{waited}; reading a batch off the network takes {_ms(stages['receive'])} "
                           f"({_ms(receive)} with {f.workers_alive} workers' sockets at once) of the "
                           f"{_ms(interval)} between batches: the link is the limit, not the workers")
    trainer = stages.get("decode", 0.0) + stages.get("pin", 0.0)
    waited_per_batch = f.wait_s / f.batches if f.batches else 0.0
    if waited_per_batch > 0 and trainer >= SHARE * waited_per_batch:
        return "trainer", (f"{waited}; decoding and pinning take {_ms(trainer)} of the {_ms(waited_per_batch)} "
                           "it waits a batch: the trainer's receiving side is the limit")
    dataset, cpu, dataset_for_a_core = (stages.get(k, 0.0) for k in ("dataset", "dataset_cpu", "dataset_cpu_wait"))
    for_a_core = dataset_for_a_core + stages.get("collate_cpu_wait", 0.0)
    made = {"the dataset's code": dataset, "collate_fn": stages.get("collate", 0.0), "Dpex": stages.get("dpex", 0.0)}
    total = sum(made.values())
    if dataset > 0 and dataset - dataset_for_a_core >= STORAGE_RATIO * cpu and dataset >= max(made.values()):
        return "storage", (f"{waited}; the dataset's code waits: {_ms(dataset)} a batch, {_ms(cpu)} of it on a "
                           "CPU (storage or the network): more processes per worker (--processes) help without "
                           "more cores")
    shares = ", ".join(f"{name} {100 * t / total:.0f}%" for name, t in made.items()) if total > 0 else "not timed"
    crowded = (f"; {_ms(for_a_core)} of a batch waited for a core: the workers' hosts have fewer cores than "
               "busy processes" if total > 0 and for_a_core >= 0.25 * total else "")
    wanted, step = need(f, capped=False), need(f)
    more = f"about {wanted} keep up" if wanted == step else f"try {step} ({MAX_SCALE_STEP}x) and measure again"
    return "workers", (f"{waited}: the workers' processes are the limit; add workers ({more}). "
                       f"A batch's time: {shares}{crowded}")


class Reported(NamedTuple):
    """A consumer's verdict as its trainer reported it (a dpex.v1.Verdict's fields)."""
    consumer: int
    wait_fraction: float
    bottleneck: str
    reason: str


def of_job(consumers: list[Reported]) -> tuple[Reported, str, str]:
    """A job's verdict from its consumers' (one at least): that of the consumer
    that waited most, with its word and reason; ``straggler`` when it is input-bound
    and its peers (DDP ranks, say) hardly wait: they wait for it in their collectives."""
    top = max(consumers, key=lambda c: (c.wait_fraction, -c.consumer))
    peers = [c for c in consumers if c is not top]
    if peers and top.wait_fraction > INPUT_BOUND_WAIT_FRACTION \
            and all(c.wait_fraction <= INPUT_BOUND_WAIT_FRACTION for c in peers):
        most = max(c.wait_fraction for c in peers)
        return top, "straggler", (f"consumer {top.consumer} waited {100 * top.wait_fraction:.0f}% of the time for "
                                  f"data, its {len(peers)} peers at most {100 * most:.0f}%: it holds them back. Its "
                                  f"own verdict: {top.bottleneck}: {top.reason}")
    return top, top.bottleneck, top.reason


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"
