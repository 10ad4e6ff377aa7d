"""One consumer's side of ``even_batches`` in one epoch (the rules: dpex.plan.even).

The fetcher asks :meth:`EvenGate.decide` before it gives batch number ``step``
(under "shortest" every one; under "longest" once its own batches ran out), with
the counts the dispatcher last told and its own, fresh; undecided, it syncs with a
gate (answered once the counts decide) and asks again. Under "longest" a consumer
whose own batches ran out gives its epoch's first batch again: kept here.
Without a rule (torch's behaviour) it warns once per epoch when the counts
differ, so that a DDP hang has its cause on screen."""
from __future__ import annotations

import logging
import warnings
from typing import Any, Iterable

from dpex.plan import even
from dpex.plan.even import Count

log = logging.getLogger("dpex.client")


class EvenGate:
    def __init__(self, rule: str | None, num_consumers: int, consumer_index: int, epoch: int) -> None:
        self.rule, self.num_consumers, self.me, self.epoch = rule, num_consumers, consumer_index, epoch
        self.counts: dict[int, Count] = {}  # the others', as the dispatcher last told them
        self.first: Any = None              # the epoch's first batch given ("longest": what is repeated)
        self.has_first = False
        self._warned = False

    def told(self, counts: Iterable[Any], own: Count) -> None:
        """A sync's counts (dpex.v1.ConsumerCount); warns if they show an uneven epoch (no rule)."""
        self.counts = {c.consumer_index: Count(c.ready, c.total if c.HasField("total") else None)
                       for c in counts if c.consumer_index != self.me}
        self.check(own)

    def decide(self, step: int, own: Count) -> str | None:
        assert self.rule is not None
        return even.decide(self.rule, step, {**self.counts, self.me: own}, self.num_consumers)

    def waited_on(self, step: int, own: Count) -> list[int]:
        return [c for c in even.waited_on(step, {**self.counts, self.me: own}, self.num_consumers) if c != self.me]

    def given(self, batch: Any) -> None:
        """A batch of its own went to the loop: the first is kept to repeat ("longest")."""
        if self.rule == even.LONGEST and not self.has_first:
            self.first, self.has_first = batch, True

    def check(self, own: Count) -> None:
        """Without a rule: a warning, once, when the counts show the consumers' epochs differ."""
        if self.rule is not None or self._warned:
            return
        why = even.uneven(self.epoch, {**self.counts, self.me: own}, self.num_consumers)
        if why is not None:
            self._warned = True
            log.warning("%s", why)
            warnings.warn(why, stacklevel=4)
