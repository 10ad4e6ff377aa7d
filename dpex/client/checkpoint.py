"""A loader's state dict: where its epochs stand, in a few numbers.

``RemoteDataLoader.state_dict()`` returns plain Python values (torch.save
them with the model): the number of ``iter()`` calls so far, the epoch in
progress as it was sent to the dispatcher (its base seed and sampler
description, or its index batches for a sampler Dpex cannot describe), the
batches of it the training loop was given (seq ranges), and the state of the
loader's own generator and of a sampler that has a ``state_dict``. A new
loader given it by ``load_state_dict`` submits that epoch again with those
batches marked done, so it yields the rest, then plans the next epochs as the
interrupted loader would have.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpex.errors import DpexConfigError
from dpex.proto import dispatcher_pb2 as dpb

FORMAT = "dpex.RemoteDataLoader"
VERSION = 1


class Progress:
    """The batches (seqs) of an epoch handed to the training loop: every seq
    below ``low``, and those above it in ``ahead`` (when batches come unordered)."""

    def __init__(self, done: list[tuple[int, int]] = ()) -> None:
        self.ended = False  # the loop saw the epoch's end (StopIteration)
        self.low = 0
        self.ahead: set[int] = set()
        for start, end in done:  # ascending, as ranges() gives them
            if start <= self.low:
                self.low = max(self.low, end)
            else:
                self.ahead.update(range(start, end))

    def add(self, seq: int) -> None:
        if seq == self.low:
            self.low += 1
            self._settle()
        elif seq > self.low:
            self.ahead.add(seq)

    def _settle(self) -> None:
        while self.low in self.ahead:
            self.ahead.discard(self.low)
            self.low += 1

    @property
    def count(self) -> int:
        return self.low + len(self.ahead)

    def seqs(self) -> set[int]:
        return set(range(self.low)) | self.ahead

    def ranges(self) -> list[tuple[int, int]]:
        out = [(0, self.low)] if self.low else []
        for seq in sorted(self.ahead):
            if out and out[-1][1] == seq:
                out[-1] = (out[-1][0], seq + 1)
            else:
                out.append((seq, seq + 1))
        return out


@dataclass
class EpochState:
    """One epoch as the dispatcher was sent it, and how far the loop got."""
    epoch: int
    base_seed: int
    num_batches: int
    sampler: dpb.SamplerSpec | None = None
    batches: list[dpb.IndexBatch] | None = None  # a sampler Dpex cannot describe
    progress: Progress = field(default_factory=Progress)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "base_seed": self.base_seed, "num_batches": self.num_batches,
                "sampler": self.sampler.SerializeToString() if self.sampler is not None else None,
                "batches": [list(b.indices) for b in self.batches] if self.batches is not None else None,
                "done": [list(r) for r in self.progress.ranges()]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EpochState":
        return cls(d["epoch"], d["base_seed"], d["num_batches"],
                   sampler=dpb.SamplerSpec.FromString(d["sampler"]) if d["sampler"] is not None else None,
                   batches=([dpb.IndexBatch(indices=b) for b in d["batches"]]
                            if d["batches"] is not None else None),
                   progress=Progress([tuple(r) for r in d["done"]]))


def check(sd: Any, num_consumers: int, consumer_index: int) -> None:
    """Refuses a state dict this loader cannot continue, saying why."""
    if not isinstance(sd, dict) or sd.get("format") != FORMAT:
        raise DpexConfigError("load_state_dict: not a RemoteDataLoader state dict "
                              f"(expected a dict with format={FORMAT!r})")
    if sd.get("version") != VERSION:
        raise DpexConfigError(f"load_state_dict: state dict version {sd.get('version')!r}; this Dpex "
                              f"reads version {VERSION}")
    if (sd["num_consumers"], sd["consumer_index"]) != (num_consumers, consumer_index):
        raise DpexConfigError(
            f"load_state_dict: the state was saved by consumer {sd['consumer_index']} of "
            f"{sd['num_consumers']}, this loader is consumer {consumer_index} of {num_consumers}; "
            "resuming with another number of consumers is not supported yet")
