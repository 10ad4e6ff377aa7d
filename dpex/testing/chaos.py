"""A seeded chaos run: a DDP job of trainer processes on a LocalCluster while
faults are injected at random points of its progress, and every sample it
trained on compared bitwise with an uninterrupted run of the same seed.

The job is what a user runs under torchrun: ranks in lockstep (a barrier
stands for each step's all-reduce), each saving its loader's ``state_dict()``
at every step, a step counted as done once every rank's checkpoint of it is
on disk. The faults (EVENTS): a worker killed (SIGKILL), killed and started
again on its address, frozen (SIGSTOP) for less or for longer than the
heartbeat timeout and thawed, one of its batch processes killed mid-batch (the
OOM killer), the dispatcher killed (-9) or stopped (SIGTERM, as Kubernetes
does) and started again from its journal, a worker joining, and every rank
killed and the job started again from its last checkpoints, with 2 or 3
ranks (torchrun 3 → 2 → 3: an elastic reshard when the number changes), and,
where the journal lies on a small file system of its own, that disk filled
for a while (``full_disk``).

What the run trained on is what the checkpoints hold: a step redone after a
kill counts once. Each epoch's samples are checked against the uninterrupted
run's: ``lost`` (never trained on), ``duplicated`` (trained on more than once,
beyond the padding an elastic reshard adds, as DistributedSampler pads) and
``unequal`` (no copy bitwise equal to the uninterrupted run's tensor).
``stall``: the longest time with no step done; ``recovery``: per kind of
fault, the longest time from the fault to the next step done.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import tempfile
import time
import traceback
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from dpex.auth import TOKEN_ENV
from dpex.procutil import temp_dir
from dpex.testing.cluster import HEARTBEAT_TIMEOUT_S, descendants, test_cluster
from dpex.testing.mounts import fill

EVENTS = ("kill_worker", "restart_worker", "freeze_worker", "stop_worker", "kill_batch_process",
          "kill_dispatcher", "term_dispatcher", "add_worker", "kill_trainers")
STALL_LIMIT_S = 120.0        # a run with no step done for this long is stopped and reported as hung
STEP_BARRIER_S = 300.0       # a rank waits this long for its peers at a step (they may be stopped)
_KILLED_WORDS = "is killed by signal: Killed"  # torch's, for a worker process killed mid-batch


@dataclass
class ChaosReport:
    """One run's (or, summed with ``+``, several runs') tally."""
    runs: int = 0
    events: Counter = field(default_factory=Counter)
    samples: int = 0           # samples of the uninterrupted run checked
    lost: int = 0
    duplicated: int = 0
    unequal: int = 0
    padding: int = 0           # repeats an elastic reshard's padding allows
    raised: int = 0            # restarts after a rank raised torch's words for a batch process killed
    stall_s: float = 0.0
    recovery_s: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.unequal or self.failures) and self.samples > 0

    def __add__(self, other: ChaosReport) -> ChaosReport:
        recovery = dict(self.recovery_s)
        for kind, s in other.recovery_s.items():
            recovery[kind] = max(s, recovery.get(kind, 0.0))
        return ChaosReport(self.runs + other.runs, self.events + other.events, self.samples + other.samples,
                           self.lost + other.lost, self.duplicated + other.duplicated, self.unequal + other.unequal,
                           self.padding + other.padding, self.raised + other.raised,
                           max(self.stall_s, other.stall_s), recovery,
                           self.failures + other.failures, self.seconds + other.seconds)

    def __str__(self) -> str:
        events = ", ".join(f"{k} {v}" for k, v in sorted(self.events.items()))
        return (f"runs {self.runs}, samples checked {self.samples}, lost {self.lost}, duplicated {self.duplicated}, "
                f"unequal {self.unequal} (padding {self.padding}); restarts after a rank raised {self.raised}; "
                f"longest stall {self.stall_s:.1f}s; "
                f"events: {events}; failures {len(self.failures)}; {self.seconds:.1f}s")


@dataclass(frozen=True)
class Job:
    """The trainers' job: ``epochs`` of ``samples`` augmented samples (each read
    in ``delay_s``), ``batch_size`` a rank's batch, shuffled with ``seed``."""
    seed: int
    epochs: int = 3
    samples: int = 96
    batch_size: int = 4
    delay_s: float = 0.003


# ---- a rank ---------------------------------------------------------------------------

def _rank(address: str, job: Job, rank: int, world: int, run_id: str, ckpt_dir: str, states: list,
          barrier: Any, steps: Any, step_s: float, error_path: str) -> None:
    """A trainer rank (a process of its own): torchrun's environment, a loader,
    lockstep steps, a checkpoint of the loader and of what it trained on at
    every step."""
    log = os.open(os.path.join(ckpt_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)  # Dpex's warnings (a dispatcher away, a stream asked again) in the rank's log
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), TORCHELASTIC_RUN_ID=run_id)
        import torch

        import dpex
        # As a DDP script seeds its ranks alike; each epoch's base seed is drawn from torch's global RNG (with
        # a DistributedSampler, as torch's DataLoader does), so a resume restores it with the loader's state.
        torch.manual_seed(job.seed)
        if states:
            torch.set_rng_state(states[rank if rank < len(states) else 0]["rng"])
        spec = dpex.DatasetSpec("dpex.testing.datasets:Augmented", n=job.samples, delay_s=job.delay_s)
        loader = dpex.RemoteDataLoader(address, spec, batch_size=job.batch_size, shuffle=True, seed=job.seed,
                                       timeout=120)
        if states:  # every saved rank's: its own with as many ranks, a reshard with another number
            loader.load_state_dict([s["loader"] for s in states])
        first = states[0]["loader"] if states else None
        start = first["epochs_started"] - (first["epoch"] is not None) if first else 0
        trained: list[tuple[int, int, bytes]] = []  # (epoch, sample, its tensor's bytes), this generation's
        step = 0
        for epoch in range(start, job.epochs):
            loader.set_epoch(epoch)
            for batch in loader:
                trained.extend((epoch, int(i), x.numpy().tobytes()) for i, x in zip(batch["i"], batch["x"]))
                time.sleep(step_s)  # the step's forward and backward
                barrier.wait(STEP_BARRIER_S)  # its all-reduce
                step += 1
                path = os.path.join(ckpt_dir, f"rank{rank}.{step}.pt")
                state = {"loader": loader.state_dict(), "rng": torch.get_rng_state()}
                torch.save({"state": state, "trained": trained}, path + ".tmp")
                os.replace(path + ".tmp", path)
                barrier.wait(STEP_BARRIER_S)  # every rank's checkpoint of this step is on disk
                if step > 1:
                    os.unlink(os.path.join(ckpt_dir, f"rank{rank}.{step - 1}.pt"))
                if rank == 0:  # the one writer (no lock: a rank killed holding it would stop the run's reader)
                    steps.value += 1
        loader.close()
    except BaseException:
        with open(error_path, "w") as f:
            f.write(traceback.format_exc())
        raise


def _rank_on(netns: str, token: str, *args: Any) -> None:
    """A rank on the trainers' host: in its network namespace, with the cluster's token."""
    import ctypes
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET, before any thread
        raise OSError(ctypes.get_errno(), f"cannot enter network namespace {netns}")
    os.close(fd)
    os.environ[TOKEN_ENV] = token
    _rank(*args)


class _Generation:
    """The ranks of one start of the job (torchrun's restart), from ``states``."""

    def __init__(self, ctx: Any, cluster: Any, job: Job, world: int, states: list, saved_by: int, root: str,
                 steps: Any, step_s: float) -> None:
        self.world, self.states, self.saved_by = world, states, saved_by
        self.dir = tempfile.mkdtemp(prefix="gen-", dir=root)
        self.barrier = barrier = ctx.Barrier(world)  # held: the ranks rebuild it from its name
        run_id = uuid.uuid4().hex
        host = getattr(cluster, "trainer_host", None)  # (network namespace, token): a host of its own
        self.procs = [ctx.Process(target=_rank if host is None else _rank_on, daemon=True,
                                  args=(*(host or ()), cluster.address, job, r, world, run_id, self.dir, states,
                                        barrier, steps, step_s, os.path.join(self.dir, f"error{r}")))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def running(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def failed(self) -> bool:
        """A rank ended with an error (not killed by the run)."""
        return any(p.exitcode not in (None, 0, -signal.SIGKILL) for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join()

    def errors(self) -> list[str]:
        out = []
        for r, p in enumerate(self.procs):
            path = os.path.join(self.dir, f"error{r}")
            if os.path.exists(path):
                out.append(f"rank {r} of {self.world}: {open(path).read()}")
            elif p.exitcode not in (0, None, -signal.SIGKILL):
                out.append(f"rank {r} of {self.world} exited with {p.exitcode}")
        return out

    def committed(self) -> tuple[list, int, list]:
        """The states every rank saved at its last common step (else the ones
        this generation started from), the number of ranks that saved them,
        and what the ranks trained on up to that step."""
        import torch
        saved: dict[int, set[int]] = {}
        for name in os.listdir(self.dir):
            if name.startswith("rank") and name.endswith(".pt"):
                rank, step = map(int, name[4:-3].split("."))
                saved.setdefault(step, set()).add(rank)
        common = [s for s, ranks in saved.items() if len(ranks) == self.world]
        if not common:
            return self.states, self.saved_by, []
        ckpts = [torch.load(os.path.join(self.dir, f"rank{r}.{max(common)}.pt"), weights_only=False)
                 for r in range(self.world)]
        return [c["state"] for c in ckpts], self.world, [t for c in ckpts for t in c["trained"]]


# ---- a run ----------------------------------------------------------------------------

def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "dpex", "dpex.testing.datasets"])
    return ctx


def _train(cluster: Any, job: Job, ranks: int, root: str, rng: random.Random | None, events: int,
           report: ChaosReport, step_s: float = 0.0, journal_dir: str | None = None) -> list[tuple[int, int, bytes]]:
    """Runs the job to its end, its steps taking ``step_s`` (besides waiting
    for data), with ``events`` faults at random steps (none without ``rng``);
    returns what it trained on."""
    ctx = _context()
    steps = ctx.Value("q", 0, lock=False)  # steps done, counted by rank 0
    total = job.epochs * job.samples // (ranks * job.batch_size)
    kinds = random.Random(rng.getrandbits(64)) if rng else None  # the faults' kinds: from the seed alone
    last_at = max(2, total - 6)  # faults land while the job trains: the driver waits for some (a worker started)
    at = sorted(rng.sample(range(1, last_at), min(events, last_at - 1))) if rng else []
    gen = _Generation(ctx, cluster, job, ranks, [], ranks, root, steps, step_s)
    trained: list = []
    undo: list[_Undo] = []  # faults that end later: a frozen worker thawed, a full disk given room
    pending: list[tuple[str, float]] = []  # faults waiting for the next step done: (kind, when)
    done, last = 0, time.monotonic()
    batch_process_killed = False  # in this generation: a rank may raise torch's words for it

    def restart(gen: _Generation) -> _Generation:
        """torchrun's restart: every rank killed, the job started again from
        their last common checkpoint, with 2 or 3 ranks."""
        nonlocal trained
        gen.kill()
        states, saved_by, got = gen.committed()
        trained += got
        world = rng.choice((2, 3)) if rng else gen.world
        if states and world != saved_by:  # an elastic reshard of the epoch's rest
            report.padding += _padding(trained, job, world)
        return _Generation(ctx, cluster, job, world, states, saved_by, root, steps, step_s)
    try:
        while gen.running() or undo:
            now = time.monotonic()
            for u in [u for u in undo if u.when <= now]:
                u.action()
                undo.remove(u)
            if steps.value > done:
                done = steps.value
                for kind, when in pending:
                    report.recovery_s[kind] = max(report.recovery_s.get(kind, 0.0), now - when)
                pending.clear()
                report.stall_s = max(report.stall_s, now - last)
                last = now
            if now - last > STALL_LIMIT_S:
                report.failures.append(f"no step done for {STALL_LIMIT_S:.0f}s after step {done} "
                                       f"(events so far: {dict(report.events)})")
                break
            if gen.failed():  # a rank raised: torchrun stops the others and starts the job again
                gen.kill()
                errors = gen.errors()
                if not (batch_process_killed and errors and all(_KILLED_WORDS in e for e in errors)):
                    report.failures.extend(errors)
                    break
                report.raised += 1
                gen, batch_process_killed = restart(gen), False
                continue
            if at and done >= at[0] and gen.running():
                at.pop(0)
                kind = _fault(rng, kinds, cluster, undo, journal_dir)
                if kind == "kill_trainers":
                    report.failures.extend(gen.errors())
                    gen, batch_process_killed = restart(gen), False
                batch_process_killed |= kind == "kill_batch_process"
                report.events[kind] += 1
                pending.append((kind, time.monotonic()))
            time.sleep(0.02)  # a poll of the step counter, not a synchronisation
        report.stall_s = max(report.stall_s, time.monotonic() - last)
    finally:
        for u in undo:
            u.action()
        gen.kill()
    report.failures.extend(gen.errors())
    trained += gen.committed()[2]
    return trained


def _room(undo: list) -> None:
    """Gives a full journal disk room now, before a worker is started and waited for: it must
    register (journaled), and the loop that would end the full disk waits for it (found by seed 4016:
    the new worker gave up after its 30 s connect timeout and the run failed)."""
    for u in [u for u in undo if u.disk]:
        u.action()
        undo.remove(u)


@dataclass
class _Undo:
    """How a fault ends: ``action`` at ``when`` (monotonic); ``daemon``: the one it holds stopped."""
    when: float
    action: Callable[[], None]
    daemon: Any = None
    disk: bool = False  # it gives the journal's disk room again


def _fault(rng: random.Random, kinds: random.Random, cluster: Any, undo: list[_Undo],
           journal_dir: str | None) -> str:
    """Injects a fault of a kind drawn from EVENTS (and ``full_disk`` where the
    journal lies on a small file system of its own) with ``kinds``; returns its
    kind (a worker joins first where it would stop the last serving one)."""
    held = {u.daemon.process.pid for u in undo if u.daemon is not None}  # stopped or cut off
    serving = [k for k, w in enumerate(cluster.workers) if w.process.poll() is None and w.process.pid not in held]
    kind = kinds.choice(EVENTS + (("full_disk",) if journal_dir else ()) + (("cut_worker",) if _on_hosts(cluster)
                                                                             else ()))
    if kind in ("kill_worker", "freeze_worker", "stop_worker", "cut_worker") and len(serving) < 2:
        _room(undo)
        cluster.add_workers(1)  # one worker keeps serving
        serving.append(len(cluster.workers) - 1)
    if kind == "kill_worker":
        cluster.kill_worker(rng.choice(serving))
    elif kind == "restart_worker":
        cluster.restart_worker(rng.choice(serving))
    elif kind in ("freeze_worker", "stop_worker"):
        daemon = cluster.workers[rng.choice(serving)]
        daemon.process.send_signal(signal.SIGSTOP)
        hold = rng.uniform(0.2, 1.0) if kind == "freeze_worker" else rng.uniform(1.5, 3.0) * HEARTBEAT_TIMEOUT_S
        undo.append(_Undo(time.monotonic() + hold, lambda: daemon.process.send_signal(signal.SIGCONT), daemon))
    elif kind == "cut_worker":  # its host's link down at the hub, up again after up to 2.5 heartbeat timeouts
        daemon = cluster.workers[rng.choice(serving)]
        cluster.hosts.cut(daemon.node)
        undo.append(_Undo(time.monotonic() + rng.uniform(0.5, 2.5) * HEARTBEAT_TIMEOUT_S,
                          lambda: cluster.hosts.heal(daemon.node), daemon))
    elif kind == "full_disk":  # the journal's writes fail until the filler goes
        filler = fill(journal_dir)
        undo.append(_Undo(time.monotonic() + rng.uniform(0.5, 3.0), lambda: os.unlink(filler), disk=True))
    elif kind == "kill_batch_process":
        children = descendants(cluster.workers[rng.choice(serving)].process.pid)
        if children:
            try:
                os.kill(rng.choice(children), signal.SIGKILL)
            except ProcessLookupError:
                pass
    elif kind == "kill_dispatcher":
        cluster.restart_dispatcher(signal.SIGKILL)
    elif kind == "term_dispatcher":
        cluster.restart_dispatcher(signal.SIGTERM)
    elif kind == "add_worker":
        _room(undo)
        cluster.add_workers(1)
    return kind


def _on_hosts(cluster: Any) -> bool:
    return isinstance(cluster, _Hosts)


class _HostDaemon:
    """A daemon of a NetnsCluster node, as a LocalCluster's Daemon is seen here."""

    def __init__(self, hosts: Any, node: str) -> None:
        self.hosts, self.node = hosts, node

    @property
    def process(self) -> Any:
        return self.hosts.procs[self.node]


class _Hosts:
    """A NetnsCluster as the run's cluster: the dispatcher, each worker and the
    trainers on hosts of their own (network namespaces), whose links are cut."""

    def __init__(self, hosts: Any) -> None:
        self.hosts, self.address = hosts, hosts.address
        self.trainer_host = (hosts.ns("trainer"), hosts.token)

    @property
    def workers(self) -> list[_HostDaemon]:
        return [_HostDaemon(self.hosts, n) for n in self.hosts.nodes if n.startswith("worker")]

    def kill_worker(self, k: int) -> None:
        self.hosts.kill(self.workers[k].node)

    def restart_worker(self, k: int) -> None:
        node = self.workers[k].node
        self.hosts.kill(node)
        self.hosts.start_worker(node)

    def restart_dispatcher(self, sig: int) -> None:
        self.hosts.restart_dispatcher(sig)

    def add_workers(self, n: int) -> None:
        for _ in range(n):
            self.hosts.add_worker()


def _check(trained: list, reference: list, report: ChaosReport) -> None:
    """Counts lost, duplicated and unequal samples per epoch against the
    uninterrupted run (whose every sample was trained on once)."""
    want = {(e, i): x for e, i, x in reference}
    got: dict[tuple[int, int], list[bytes]] = {}
    for e, i, x in trained:
        got.setdefault((e, i), []).append(x)
    report.samples += len(want)
    report.lost += sum(1 for key in want if key not in got)
    repeats = sum(len(xs) - 1 for xs in got.values())
    report.duplicated += max(0, repeats - report.padding)
    report.unequal += sum(1 for key, xs in got.items() if want.get(key) not in xs)


def _padding(trained: list, job: Job, world: int) -> int:
    """The repeats DistributedSampler's padding adds when the rest of the
    epoch in progress is resharded over ``world`` ranks."""
    epoch = max((e for e, _, _ in trained), default=0)
    rest = job.samples - len({i for e, i, _ in trained if e == epoch})
    return (world - rest % world) % world


def run_chaos(seed: int = 0, events: int = 6, ranks: int = 3, workers: int = 3, job: Job | None = None,
              step_s: float = 0.4, journal_dir: str | None = None, hosts: bool = False) -> ChaosReport:
    """One run: the uninterrupted job, then the same job (a new run of it,
    its steps taking ``step_s``, long enough for the faults to land while it
    trains) with ``events`` faults; the second checked against the first.
    ``journal_dir``: a small file system of its own (a tmpfs, see
    dpex.testing.mounts) for the dispatcher's journal, which ``full_disk``
    faults fill. ``hosts``: every daemon and the trainers on hosts of their own
    (network namespaces, dpex.testing.netns; root only), and ``cut_worker``
    faults cutting a worker's host off the network and healing it."""
    job = job or Job(seed)
    report = ChaosReport(runs=1)
    start = time.monotonic()
    root = temp_dir("chaos")  # named by this pid: not another run's leftover, removed by a later one if killed
    work_dir = tempfile.mkdtemp(prefix="journal-", dir=journal_dir or root)
    with _removed(root), _removed(work_dir), _cluster(workers, work_dir, job, hosts) as cluster:
        uninterrupted = ChaosReport()
        reference = _train(cluster, job, ranks, root, None, 0, uninterrupted)
        report.failures += [f"the uninterrupted run: {f}" for f in uninterrupted.failures]
        if sorted((e, i) for e, i, _ in reference) != [(e, i) for e in range(job.epochs) for i in range(job.samples)]:
            report.failures.append("the uninterrupted run did not train on every sample once an epoch")
        trained = _train(cluster, job, ranks, root, random.Random(seed), events, report, step_s, journal_dir)
        _check(trained, reference, report)
    report.seconds = time.monotonic() - start
    return report



@contextmanager
def _cluster(workers: int, work_dir: str, job: Job, hosts: bool) -> Iterator[Any]:
    if not hosts:
        with test_cluster(num_workers=workers, work_dir=work_dir) as cluster:
            yield cluster
        return
    from dpex.testing.netns import NetnsCluster
    with NetnsCluster(workers=workers, samples=job.samples) as netns_cluster:  # its journal in its own dir
        yield _Hosts(netns_cluster)


@contextmanager
def _removed(path: str) -> Iterator[None]:
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)
