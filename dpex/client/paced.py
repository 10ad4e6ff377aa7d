"""An epoch's iterator that asks for index batches at torch's pace.

torch's DataLoader asks its sampler for index batches lazily: without
workers, one at each ``next()`` (the first at the first ``next()``, not at
``iter()``); with ``num_workers`` > 0, ``prefetch_factor * num_workers`` at
``iter()`` and one more per batch it returns. A sampler draws from the
user's generator when it is asked (RandomSampler a permutation when its
first index is needed, and one more when it runs out), so where a loop
stops (a peek, a ``break``, ``zip(loader, loader)``) decides the
generator's state. :class:`PacedEpoch` keeps that pace: it draws the
epoch's plan and starts it when torch would first ask, and lets the
epoch's draws (dpex.client.sampling.EpochDraw) follow each ask.
"""
from __future__ import annotations

from typing import Any, Callable


class PacedEpoch:
    """Batches of the iterator ``start()`` makes (once the plan is due), with
    ``draw.ask(n)`` called as torch's iterator would ask for its n-th index
    batch. ``prefetch``: index batches asked at ``iter()`` (0: none, the
    first at the first ``next()``); ``asked``: those asked before (a resumed
    epoch's batches already given). ``owner`` (the loader) is held: as
    torch's iterator, an epoch keeps its loader alive while it is read."""

    def __init__(self, start: Callable[[], Any], draw: Any, length: int, prefetch: int, asked: int = 0,
                 owner: Any = None) -> None:
        self._owner = owner
        self._start, self._draw, self._length = start, draw, length
        self._prefetch, self._asked = prefetch, asked
        self._epoch: Any = None
        self._closed = False
        if prefetch:
            self._begin()

    def _begin(self) -> None:
        self._epoch = self._start()
        self._ask(self._asked + self._prefetch)

    def _ask(self, n: int) -> None:
        self._asked = n
        self._draw.ask(n)

    def __iter__(self) -> "PacedEpoch":
        return self

    def __len__(self) -> int:
        return self._length

    def __next__(self) -> Any:
        if self._epoch is None:
            if self._closed:
                raise StopIteration
            self._begin()
        if not self._prefetch:
            self._ask(self._asked + 1)
        try:
            batch = next(self._epoch)
        except StopIteration:  # torch's last ask (above, or among the prefetched) ran the sampler out
            raise
        except Exception:  # torch asks for the next index batch before it re-raises a worker's error
            if self._prefetch:
                self._ask(self._asked + 1)
            raise
        if self._prefetch:
            self._ask(self._asked + 1)
        return batch

    @property
    def started(self) -> bool:
        return self._epoch is not None

    @property
    def finished(self) -> bool:
        return self._epoch is not None and self._epoch.finished

    @property
    def closed(self) -> bool:
        return self._closed if self._epoch is None else self._epoch.closed

    def close(self, why: str | None = None) -> None:
        self._closed = True
        if self._epoch is not None:
            self._epoch.close() if why is None else self._epoch.close(why)
