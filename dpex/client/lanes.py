"""Lanes: the epochs of one loader that run at once, each on a job of its own.

torch gives every ``iter()`` an iterator of its own: ``zip(loader, loader)``,
or a peek with ``next(iter(loader))`` inside the training loop, leaves the
other epoch alone. A Dpex job has one epoch per consumer at a time (a new
plan replaces the old), so an ``iter()`` made while an earlier epoch of the
loader is still being read runs on another lane: a job of the same
definition, without a name, with streams of its own. Lane 0 is the loader's
own job (named, or shared by the ranks of a DDP run); a resumed epoch
(``load_state_dict``) runs there, and an epoch it replaces there raises a
clear error at its next batch instead of ending early in silence.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

from dpex.client.streams import StreamPool
from dpex.errors import DpexError


class Lane:
    """A job this loader runs epochs on, its streams and its epoch in progress."""

    def __init__(self, job_id: int, job_key: bytes, streams: StreamPool,
                 release: Callable[[], None] | None = None) -> None:
        self.job_id, self.job_key, self.streams, self.release = job_id, job_key, streams, release
        self._epoch: weakref.ref | None = None

    @property
    def epoch(self) -> Any:
        """Its epoch's iterator, while someone holds it."""
        return self._epoch() if self._epoch is not None else None

    def start(self, iterator: Any) -> None:
        self._epoch = weakref.ref(iterator)

    @property
    def busy(self) -> bool:
        """An epoch is being read here: iterated, not finished nor closed."""
        epoch = self.epoch
        return epoch is not None and not epoch.closed

    def close_epoch(self, why: str | None = None) -> None:
        """Ends the epoch in progress (``why``: it raises that at its next batch)."""
        epoch = self.epoch
        if epoch is not None:
            epoch.close(why) if why is not None else epoch.close()

    def close(self) -> None:
        self.close_epoch()
        self.streams.close()
        if self.release is not None:
            try:
                self.release()
            except DpexError:
                pass


class Lanes:
    """Lane 0 (the loader's job) and the extra lanes it opened, reused when free."""

    def __init__(self, first: Lane) -> None:
        self.first = first
        self._extra: list[Lane] = []
        self._stale: list[Lane] = []  # of an old definition: closed once their epochs end

    def pick(self, open_lane: Callable[[], Lane], first_only: bool = False) -> Lane:
        """A free lane: lane 0 if it is free (or ``first_only``: a resumed
        epoch, whose caller ends the one there), else a free extra lane, else
        a new one from ``open_lane()``."""
        self._sweep()
        if first_only or not self.first.busy:
            return self.first
        for lane in self._extra:
            if not lane.busy:
                return lane
        lane = open_lane()
        self._extra.append(lane)
        return lane

    def renew(self, first: Lane) -> None:
        """The loader's definition changed: ``first`` is lane 0 now, on the
        new job; the old lanes go once their epochs end (now, if free), as
        torch's workers of an earlier ``iter()`` keep the dataset they had."""
        self._stale += [self.first, *self._extra]
        self.first, self._extra = first, []
        self._sweep()

    def _sweep(self) -> None:
        stale, self._stale = self._stale, []
        for lane in stale:
            (self._stale.append(lane) if lane.busy else lane.close())

    def all(self) -> list[Lane]:
        return [self.first, *self._extra, *self._stale]

    def close(self) -> None:
        for lane in self.all():
            lane.close()
