"""Dpex on a Ray cluster: the dispatcher and its ``dpex-worker`` daemons as
Ray actors (``pip install 'dpex[ray]'``; public as :mod:`dpex.ray`).

A head actor (named, detached, on Ray's head node) runs ``dpex-dispatcher``
and keeps the worker actors, in one of two ways:

- **One per node** (the default): a worker actor on every alive node, pinned
  to it (hard node affinity), taking the node's CPUs as Ray resources and
  running ``dpex-worker`` with as many processes, so each worker reads that
  node's own data. Workers start on nodes that join; nodes that leave are
  forgotten.
- **As many as the trainers need** (``RayConfig(min_workers=, max_workers=)``):
  the dispatcher's scaling policy (dpex.dispatcher.scaling) says how many
  workers the trainers need; the head actor starts worker actors of
  ``worker_cpus`` CPUs each wherever Ray places them (one that cannot be
  placed stays pending, and Ray's autoscaler adds a node for it), and lets
  one go by draining it: SIGTERM, the worker deregisters and the dispatcher
  gives its splits to the others, so nothing is lost or repeated.

A worker whose daemon died is replaced. Actors are found again by name:
loaders and trainers reuse them until :func:`stop`. The actors only run the
CLIs with flags.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dpex.auth import TOKEN_ENV
from dpex.errors import DpexConfigError, DpexConnectionError, DpexError
from dpex.daemon import Daemon, await_ready, spawn, stop_process
from dpex.procutil import PARENT_ENV, temp_dir
from dpex.rpc import answers_tcp

log = logging.getLogger("dpex.ray")

NAMESPACE = "dpex"
HEAD_NAME = "dpex-head"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's marker resource of its head node


@dataclass(frozen=True)
class RayConfig:
    """How Dpex runs on a Ray cluster.

    Attributes:
        dispatcher_port: the dispatcher's port on the head node; 0 picks a free one.
        work_dir: the dispatcher's journal directory on the head node; None: state in memory only.
        worker_cpus: Ray CPUs each worker takes, and its processes; None: all of its node's CPUs.
        data_paths: paths a node must have for a worker to start there (a node without them is logged
            and tried again every ``retry_s``).
        dispatcher_flags: more command-line flags for the dispatcher.
        worker_flags: more command-line flags for each worker.
        reconcile_interval_s: how often nodes that joined or left are looked for.
        retry_s: a node whose worker failed to start is tried again after this.
        start_timeout_s: a daemon that does not serve within this fails.
        auth_token: the cluster's token; None: ``$DPEX_AUTH_TOKEN``, else a random one that loaders get
            from the head actor.
        min_workers: the scaling policy's lower bound; None (with ``max_workers``): one worker per node.
        max_workers: the scaling policy's upper bound.
        scale_cooldown_s: no worker is let go within this of the last change.

    Raises:
        DpexConfigError: bounds or durations that cannot be.
    """
    dispatcher_port: int = 0              # 0 picks a free port
    work_dir: str | None = None
    worker_cpus: float | None = None
    data_paths: tuple[str, ...] = ()
    dispatcher_flags: tuple[str, ...] = ()
    worker_flags: tuple[str, ...] = ()
    reconcile_interval_s: float = 2.0     # how often nodes that joined or left are looked for
    retry_s: float = 30.0                 # a node whose worker failed to start is tried again after this
    start_timeout_s: float = 120.0        # a daemon that does not serve within this fails
    auth_token: str | None = field(default=None, repr=False)
    min_workers: int | None = None        # None: one worker per node; else the scaling policy's bounds
    max_workers: int | None = None
    scale_cooldown_s: float = 60.0        # no worker let go within this of the last change

    def __post_init__(self) -> None:
        if self.worker_cpus is not None and self.worker_cpus <= 0:
            raise DpexConfigError("worker_cpus must be > 0 or None (all of each node's CPUs)")
        if (self.min_workers is None) != (self.max_workers is None):
            raise DpexConfigError("give min_workers and max_workers together (or neither: one worker per node)")
        if self.scaled and not (0 <= self.min_workers <= self.max_workers and self.max_workers >= 1):
            raise DpexConfigError(f"need 0 <= min_workers <= max_workers and max_workers >= 1, got "
                                  f"{self.min_workers}..{self.max_workers}")
        if self.reconcile_interval_s <= 0 or self.retry_s <= 0 or self.start_timeout_s <= 0:
            raise DpexConfigError("reconcile_interval_s, retry_s and start_timeout_s must be > 0")

    @property
    def scaled(self) -> bool:
        """Workers as the scaling policy wants them, not one per node."""
        return self.min_workers is not None


@dataclass(frozen=True)
class Endpoint:
    """What a loader needs: the dispatcher's address and the cluster's token."""
    address: str
    auth_token: str | None = field(repr=False)
    workers: dict[str, str]               # node id -> worker address


class _Process:
    """One dpex CLI run by an actor. It is started from a thread that lives as
    long as it does: the daemon's parent-death signal follows that thread, so
    it stops when the actor dies, also when Ray kills it."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], timeout_s: float) -> None:
        self.dir = temp_dir("ray")
        self.stopping = threading.Event()
        ready, log_path = os.path.join(self.dir, f"{name}.ready"), os.path.join(self.dir, f"{name}.log")
        spawned: list[Any] = []
        started = threading.Event()

        def run() -> None:
            try:
                spawned.append(spawn(args, ready, log_path, {**os.environ, **env, PARENT_ENV: str(os.getpid())},
                                     start_new_session=True))  # out of reach of Ray killing its worker's group
            finally:
                started.set()
            code = spawned[0].wait()
            if not self.stopping.is_set():  # the daemon died: so does the actor, and Ray sees it
                tail = Daemon(name, spawned[0], "", log_path).log_tail()
                sys.stderr.write(f"dpex: {name} exited with code {code}:\n{tail}\n")
                sys.stderr.flush()
                os._exit(1)

        self.stopping.set()  # a failed start is reported by await_ready, not by exiting
        threading.Thread(target=run, name=f"dpex-{name}").start()
        started.wait()
        if not spawned:
            raise DpexError(f"could not start {name}")
        self.daemon = await_ready(name, spawned[0], ready, log_path, timeout_s)
        self.stopping.clear()
        if spawned[0].poll() is not None:  # it died while we looked away: a failed start all the same
            raise DpexError(f"{name} exited with code {spawned[0].returncode} just after starting:\n"
                            f"{self.daemon.log_tail()}")

    def stop(self) -> None:
        self.stopping.set()
        stop_process(self.daemon.process, timeout_s=30)
        shutil.rmtree(self.dir, ignore_errors=True)


def _token_env(token: str | None) -> dict[str, str]:
    return {TOKEN_ENV: token} if token else {}


@ray.remote(num_cpus=0, max_restarts=0)
class WorkerActor:
    """``dpex-worker`` on this actor's node, bound to the node's address."""

    def __init__(self, dispatcher: str, processes: int, config: RayConfig, token: str | None) -> None:
        host = ray.util.get_node_ip_address()
        args = ["dpex.cmd.worker", "--dispatcher", dispatcher, "--host", host, "--port", "0",
                "--processes", str(processes), *[a for p in config.data_paths for a in ("--data-path", p)],
                *config.worker_flags]
        self._process = _Process("worker", args, _token_env(token), config.start_timeout_s)

    def address(self) -> str:
        return self._process.daemon.address

    def stop(self) -> None:
        self._process.stop()


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=8)
class HeadActor:
    """``dpex-dispatcher`` on Ray's head node, and the worker actors."""

    def __init__(self, config: RayConfig, token: str | None) -> None:
        self._config, self._token = config, token
        host = ray.util.get_node_ip_address()
        args = ["dpex.cmd.dispatcher", "--host", host, "--port", str(config.dispatcher_port),
                *(["--work-dir", config.work_dir] if config.work_dir else []),
                *(["--min-workers", str(config.min_workers), "--max-workers", str(config.max_workers),
                   "--scale-cooldown", str(config.scale_cooldown_s)] if config.scaled else []),
                *config.dispatcher_flags]
        self._dispatcher = _Process("dispatcher", args, _token_env(token), config.start_timeout_s)
        self._lock = threading.Lock()
        self._workers: dict[str, tuple[Any, Any]] = {}  # node id -> (actor, its address() ref)
        self._ready: dict[str, str] = {}                # node id -> worker address
        self._failed: dict[str, tuple[float, str]] = {}  # node id -> (when, why)
        self._passes = 0  # reconcile() passes done: each tries every alive node
        self._started = 0  # worker actors started by the scaling policy's numbers (their names)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dpex-reconcile")
        self._thread.start()

    def endpoint(self, wait_s: float = 0.0) -> Endpoint:
        """The dispatcher and the workers serving; waits up to ``wait_s`` for
        a worker on every alive node that can have one (not when no node can)."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                pending = set(self._workers) - set(self._ready)
                ready = dict(self._ready)
                refused = bool(self._failed) and self._passes > 0  # every node was tried, and none has one
            if (not pending and (ready or refused)) or time.monotonic() >= deadline or self._stop.is_set():
                return Endpoint(self._dispatcher.daemon.address, self._token, ready)
            time.sleep(0.1)

    def failures(self) -> dict[str, str]:
        """Nodes where a worker could not start, and why."""
        with self._lock:
            return {node: why for node, (_, why) in self._failed.items()}

    def reconcile(self) -> None:
        """One pass: a worker for every alive node without one, none for nodes
        that left; or (scaled) as many workers as the dispatcher wants."""
        if self._config.scaled:
            self._scale()
            self._collect()
            with self._lock:
                self._passes += 1
            return
        alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        with self._lock:
            known = dict(self._workers)
        for node_id in set(known) - set(alive):
            log.info("node %s left: its worker is gone with it", node_id[:12])
            self._forget(node_id)
        for node_id, node in alive.items():
            if node_id in known or self._stop.is_set():
                continue
            failed = self._failed.get(node_id)
            if failed is not None and time.monotonic() - failed[0] < self._config.retry_s:
                continue
            cpus = self._config.worker_cpus or node.get("Resources", {}).get("CPU", 0)
            if cpus <= 0:
                self._fail(node_id, "it has no CPUs for Ray")
                continue
            actor = WorkerActor.options(
                name=f"dpex-worker-{node_id}", namespace=NAMESPACE, lifetime="detached", num_cpus=cpus,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self._dispatcher.daemon.address, max(1, int(cpus)), self._config, self._token)
            with self._lock:
                self._workers[node_id] = (actor, actor.address.remote())
        self._collect()
        with self._lock:
            self._passes += 1

    def wanted(self) -> int:
        """The number of workers the dispatcher's scaling policy wants now
        (its minimum until the policy has looked, or while it cannot be asked)."""
        from dpex.proto import dispatcher_pb2 as dpb
        from dpex.proto import dispatcher_pb2_grpc as dgrpc
        from dpex.rpc import call, channel
        config = self._config
        try:
            ch = channel(self._dispatcher.daemon.address, self._token, None)
            try:
                status = call(dgrpc.DispatcherStub(ch).GetStatus, dpb.GetStatusRequest(), target="dispatcher",
                              timeout_s=5)
            finally:
                ch.close()
        except DpexError as e:
            log.warning("cannot ask the dispatcher how many workers it wants (%s)", e)
            return config.min_workers
        return min(max(status.workers_wanted or config.min_workers, config.min_workers), config.max_workers)

    def _scale(self) -> None:
        """Starts worker actors up to the number wanted, wherever Ray places
        them; past it, lets one go: one still starting, else the newest, drained."""
        wanted = self.wanted()
        with self._lock:
            count, pending = len(self._workers), [k for k in self._workers if k not in self._ready]
            failed = [when for when, _ in self._failed.values()]
        if count < wanted:
            if failed and time.monotonic() - max(failed) < self._config.retry_s:
                return  # a worker could not start a moment ago: not another at once
            cpus = self._config.worker_cpus or 1.0
            for _ in range(wanted - count):
                self._started += 1
                key = f"scaled-{self._started}"
                actor = WorkerActor.options(name=f"dpex-worker-{key}", namespace=NAMESPACE, lifetime="detached",
                                            num_cpus=cpus).remote(self._dispatcher.daemon.address,
                                                                  max(1, int(cpus)), self._config, self._token)
                with self._lock:
                    self._workers[key] = (actor, actor.address.remote())
            log.info("workers wanted: %d; starting %d", wanted, wanted - count)
        elif count > wanted:
            with self._lock:
                key = pending[-1] if pending else list(self._workers)[-1]
                actor, _ = self._workers[key]
                draining = key in self._ready
            log.info("workers wanted: %d; %s %s", wanted, "draining" if draining else "cancelling", key)
            if draining:  # SIGTERM: it deregisters (its splits go to the others), answers what is in flight, exits
                try:
                    ray.get(actor.stop.remote(), timeout=60)
                except Exception as e:  # noqa: BLE001 -- gone already: nothing to drain
                    log.warning("worker %s did not stop cleanly: %s", key, _reason(e))
            self._forget(key)

    def _collect(self) -> None:
        """Takes in the addresses of workers that started; replaces the dead."""
        with self._lock:
            refs = {ref: node for node, (_, ref) in self._workers.items()}
        if not refs:
            return
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in done:
            node_id = refs[ref]
            try:
                address = ray.get(ref)
            except Exception as e:  # noqa: BLE001 -- the actor's error, reported for its node
                self._fail(node_id, _reason(e))
                continue
            with self._lock:
                if node_id in self._workers and node_id not in self._ready:
                    self._ready[node_id] = address
                    self._failed.pop(node_id, None)
                    log.info("worker on node %s serves at %s", node_id[:12], address)
        with self._lock:
            serving = [(node, actor) for node, (actor, _) in self._workers.items() if node in self._ready]
        pings = {actor.address.remote(): node for node, actor in serving}
        done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=10) if pings else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 -- its daemon died: start another
                log.warning("worker on node %s died (%s); starting another", pings[ref][:12], _reason(e))
                self._forget(pings[ref])

    def _fail(self, node_id: str, why: str) -> None:
        log.error("no Dpex worker on node %s: %s (tried again in %gs)", node_id[:12], why, self._config.retry_s)
        self._forget(node_id)
        with self._lock:
            self._failed[node_id] = (time.monotonic(), why)

    def _forget(self, node_id: str) -> None:
        with self._lock:
            actor, _ = self._workers.pop(node_id, (None, None))
            self._ready.pop(node_id, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 -- a Ray hiccup must not end the reconciling
                log.exception("reconciling Dpex workers with Ray's nodes failed; trying again")
            self._stop.wait(self._config.reconcile_interval_s)

    def stop(self) -> None:
        """Stops every worker (each drains: its splits go to others), then the dispatcher."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            actors = [actor for actor, _ in self._workers.values()]
            self._workers.clear()
            self._ready.clear()
        for ref in [a.stop.remote() for a in actors]:
            try:
                ray.get(ref, timeout=60)
            except Exception:  # noqa: BLE001 -- gone already
                pass
        for actor in actors:
            ray.kill(actor, no_restart=True)
        self._dispatcher.stop()


def _reason(e: BaseException) -> str:
    """The first line of an actor's error that says something."""
    text = str(getattr(e, "cause", None) or e)
    lines = [line for line in text.splitlines() if "Error" in line or "error" in line]
    return (lines[-1] if lines else text.splitlines()[-1] if text else type(e).__name__).strip()


def _connect(address: str | None) -> bool:
    """Connects this process to Ray unless it is; True if it did."""
    if ray.is_initialized():
        return False
    if address not in (None, "auto") and not answers_tcp(address.removeprefix("ray://"), 5.0):  # ray.init would retry for minutes
        raise DpexConnectionError(
            f"nothing answers at the Ray address {address}: start the cluster there (ray start --head), "
            "check the address (ray://HOST:10001 for Ray Client, HOST:6379 for the head), or use a Dpex "
            "dispatcher (head_address='dpex://HOST:PORT')")
    for attempt in (1, 2):
        try:
            ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False,
                     logging_level=logging.WARNING)
            return True
        except (ConnectionError, RuntimeError, ValueError) as e:
            # A failed init can leave Ray half set up in this process (the next
            # init then trips over it): undo it. Once more: a Ray Client server
            # for this connection can fail to start on a loaded head.
            ray.shutdown()
            if attempt == 2 or isinstance(e, ValueError):
                raise DpexConnectionError(
                    f"cannot reach the Ray cluster at {address or 'auto'}: {e}; start it (ray start --head) or "
                    "give its address (ray://HOST:10001 or HOST:6379), or use a Dpex dispatcher "
                    "(head_address='dpex://HOST:PORT')") from None
            log.warning("could not connect to the Ray cluster at %s (%s); trying once more",
                        address or "auto", _reason(e))
    raise AssertionError("unreachable: the second attempt returns or raises")


def start(address: str | None = "auto", config: RayConfig | None = None, wait_s: float = 120.0) -> Endpoint:
    """Gets or starts Dpex on a Ray cluster and waits for a worker on every node.

    A second call, from any process, finds the same actors (``config`` applies when they start).

    Args:
        address: the Ray cluster (``"auto"``: the one this process is connected to, or this machine's).
        config: how Dpex runs there; None: ``RayConfig()``.
        wait_s: how long to wait for the workers.
    Returns:
        Where loaders connect: the dispatcher's address, the token and the workers.
    Raises:
        DpexError: Dpex could not start there, or no node could run a worker (nothing is left started)."""
    config = config or RayConfig()
    connected = _connect(address)
    try:
        token = config.auth_token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
        head = HeadActor.options(
            name=HEAD_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            resources={HEAD_NODE_RESOURCE: 0.001},
        ).remote(replace(config, auth_token=None), token)
        try:
            endpoint = ray.get(head.endpoint.remote(wait_s))
        except Exception as e:  # noqa: BLE001 -- the head actor could not start its dispatcher
            raise DpexError(f"Dpex could not start on the Ray cluster: {_reason(e)}") from None
        failures = ray.get(head.failures.remote())
        for node, why in failures.items():
            log.warning("Ray node %s has no Dpex worker: %s", node[:12], why)
        if not endpoint.workers:  # nothing left half-started
            ray.get(head.stop.remote(), timeout=120)
            ray.kill(head, no_restart=True)
            raise DpexError("Dpex started on the Ray cluster, but no node could run a worker: "
                            + ("; ".join(failures.values()) or f"none served within {wait_s:g}s"))
        return endpoint
    finally:
        if connected:
            ray.shutdown()


@contextlib.contextmanager
def _existing_head(address: str | None) -> Iterator[Any]:
    """The head actor on the Ray cluster at ``address`` (None if Dpex does not run there)."""
    connected = _connect(address)
    try:
        try:
            head = ray.get_actor(HEAD_NAME, namespace=NAMESPACE)
        except ValueError:  # no actor of that name
            head = None
        yield head
    finally:
        if connected:
            ray.shutdown()


def status(address: str | None = "auto") -> Endpoint | None:
    """Where Dpex serves on a Ray cluster.

    Args:
        address: the Ray cluster (``"auto"``: this process's or this machine's).
    Returns:
        The endpoint, or None if Dpex does not run there."""
    with _existing_head(address) as head:
        return None if head is None else ray.get(head.endpoint.remote(0.0))


def stop(address: str | None = "auto") -> bool:
    """Stops Dpex's actors and daemons on a Ray cluster (workers drain first).

    Args:
        address: the Ray cluster (``"auto"``: this process's or this machine's).
    Returns:
        False if Dpex did not run there."""
    with _existing_head(address) as head:
        if head is None:
            return False
        try:
            ray.get(head.stop.remote(), timeout=120)
        finally:
            ray.kill(head, no_restart=True)
        return True
