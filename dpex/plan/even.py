"""Every consumer of a job the same number of batches in an epoch (``even_batches``).

A DDP step is an all-reduce over every rank: a rank whose epoch ends first leaves
the others waiting in it for ever. torch's DistributedSampler pads map-style data;
an IterableDataset's streams, or a user's batch_sampler, yield what they yield.
The dispatcher sees every consumer of a job, each telling how many batches of the
epoch it has at least (``ready``) and, once known, how many it has (``total``):

- ``"shortest"``: every consumer stops at the fewest any has; the rest of each
  is dropped (counted). Batch ``k`` is given only once every consumer has one.
- ``"longest"`` (``True``, as Accelerate's ``even_batches``): a consumer whose own
  batches ran out gives its first batch again (marked) while any other still has
  a batch ``k``; the epoch ends once every consumer's count is known.

The default (``None``) is torch's: counts as they come, and a warning
(:func:`uneven`) naming them, so that a hang has its cause on screen.

Pure arithmetic, one home for both sides: the trainer's fetcher decides with the
counts its syncs bring, the dispatcher answers a waiting consumer's sync once its
counts decide (dpex.dispatcher.polls).
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

SHORTEST, LONGEST = "shortest", "longest"
GO, END = "go", "end"


class Count(NamedTuple):
    """A consumer's batches of the epoch: at least ``ready``; ``total`` once known."""
    ready: int
    total: int | None = None


def rule_of(even_batches: bool | str | None) -> str | None:
    """The rule ``even_batches`` names (True: ``"longest"``, as Accelerate's); None: torch's."""
    if even_batches is None or even_batches is False:
        return None
    if even_batches is True:
        return LONGEST
    if even_batches in (SHORTEST, LONGEST):
        return str(even_batches)
    raise ValueError(f"even_batches must be True, False, 'shortest' or 'longest', got {even_batches!r}")


def decide(rule: str, step: int, counts: Mapping[int, Count], num_consumers: int) -> str | None:
    """Batch number ``step`` of a consumer, by ``rule``: GO (give it: the consumer's own, or
    under "longest" once its own ran out, a repeat), END (the epoch ends before it), or None
    (not decided by these counts yet: wait for more). ``counts`` by consumer index."""
    present = len(counts) == num_consumers
    if rule == SHORTEST:
        if present and min(c.ready for c in counts.values()) > step:
            return GO
        totals = [c.total for c in counts.values() if c.total is not None]
        if totals:
            fewest = min(totals)
            if present and step >= fewest and all(c.ready >= fewest or c.total is not None for c in counts.values()):
                return END  # no consumer can have fewer than the fewest known
        return None
    if any(c.ready > step for c in counts.values()):
        return GO
    if present and all(c.total is not None for c in counts.values()):
        return END  # every count known and none has batch `step`
    return None


def waited_on(step: int, counts: Mapping[int, Count], num_consumers: int) -> list[int]:
    """The consumers whose word may decide ``step``: those not final that told fewer."""
    return [c for c in range(num_consumers)
            if c not in counts or (counts[c].total is None and counts[c].ready <= step)]


def uneven(epoch: int, counts: Mapping[int, Count], num_consumers: int) -> str | None:
    """Why this epoch's consumers cannot all get the same number of batches, once the
    counts show it (a consumer's known total below another's count); None: not (yet)."""
    totals = {c: n.total for c, n in counts.items() if n.total is not None}
    if not totals:
        return None
    short = min(totals, key=lambda c: totals[c])
    longer = {c: n.total if n.total is not None else n.ready for c, n in counts.items()}
    more = {c: n for c, n in longer.items() if n > totals[short]}
    if not more:
        return None
    others = ", ".join(f"consumer {c}: {'' if counts[c].total is not None else 'at least '}{n}"
                       for c, n in sorted(more.items()))
    return (f"the consumers of this job get different numbers of batches in epoch {epoch} "
            f"(consumer {short}: {totals[short]}; {others}): a DDP step's all-reduce past the fewest "
            "waits for ever; even_batches='shortest' or 'longest' (True) gives every rank the same number")
