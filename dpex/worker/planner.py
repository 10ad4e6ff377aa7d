"""A split's index batches, and its samples' places, computed from the
epoch's sampler description off the scheduler's lock (dpex.plan.samplers).

Drawing a shuffled epoch's permutation is O(len(dataset)) (a minute at
10^9 samples), and one job's draw must not hold up another's: a thread per
order, not per split. A draw runs on even when its epoch was left; a split
released before its turn is skipped (``wanted``), and with it the draw when
none of its order is wanted any more. A description that needs no
permutation is cheap per index, but is computed here too: the first one
imports torch, which must not happen on the heartbeat's thread.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Generic, TypeVar

from dpex.plan import samplers
from dpex.proto import dispatcher_pb2 as dpb

T = TypeVar("T")  # what the caller plans: it carries its split
Planned = Callable[[T, "list[list[int]] | None", "list[list[int]] | None", "BaseException | None"], None]


class Planner(Generic[T]):
    def __init__(self, split_of: Callable[[T], dpb.Split], wanted: Callable[[T], bool],
                 planned: Planned, threads: int = 8) -> None:
        """``planned(item, batches, places, error)`` is called from a planner
        thread once an item's split is computed (or could not be); an item
        no longer ``wanted`` when its turn comes is skipped."""
        self._split_of, self._wanted, self._planned = split_of, wanted, planned
        self._lock = threading.Lock()
        self._drawing: dict[bytes, list[T]] = {}  # an order's items not yet planned
        self._threads = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dpex-planner")

    def plan(self, item: T) -> None:
        """Computes the item's split in the background; a split that carries
        its index batches is planned at once."""
        split = self._split_of(item)
        if not split.HasField("sampler"):
            self._planned(item, [list(b.indices) for b in split.batches], [list(b.places) for b in split.batches],
                          None)
            return
        spec = split.sampler
        # One thread per order (the others stay free for other jobs); a description that draws
        # none, per consumer's epoch: its splits are planned as they came, so the first are made
        # first, each batch by the process torch's index queues would give it (batch i by process
        # i mod n: the pool cycles a consumer's epoch through its processes in the order it submits).
        key = samplers.order_key(spec) if samplers.draws_order(spec) else \
            b"epoch %d %d %d" % (split.job_id, split.consumer_index, split.epoch)
        with self._lock:
            waiting = self._drawing.get(key)
            if waiting is not None:
                waiting.append(item)
                return
            self._drawing[key] = [item]
        self._threads.submit(self._plan_order, key)

    def _plan_order(self, key: bytes) -> None:
        """Plans the items of one order (or epoch) as they came; the first draws it."""
        while True:
            with self._lock:
                items = self._drawing[key]
                if not items:
                    del self._drawing[key]
                    return
                self._drawing[key] = []
            for item in items:
                self._plan(item)

    def _plan(self, item: T) -> None:
        if not self._wanted(item):
            return
        split = self._split_of(item)
        try:
            batches = samplers.batches(split.sampler, split.first_seq, split.num_batches)
            places = samplers.places(split.sampler, split.first_seq, split.num_batches)
        except Exception as e:  # noqa: BLE001 - the split's error, reported to its consumer
            self._planned(item, None, None, e)
            return
        self._planned(item, batches, places, None)

    def close(self) -> None:
        """Stops planning; a long draw running ends by itself."""
        self._threads.shutdown(wait=False, cancel_futures=True)
