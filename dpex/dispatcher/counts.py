"""What each consumer of a job told of its epoch's batches (dpex.plan.even),
for ``even_batches`` and the warning of uneven epochs. Soft state beside the
journal: every sync tells it again, so a restarted dispatcher has it back
within a sync. Guarded by the dispatcher's lock."""
from __future__ import annotations

from dpex.plan.even import Count

EPOCHS_KEPT = 4  # a job's latest epochs: a consumer may be a few behind another


class EpochCounts:
    def __init__(self) -> None:
        self._counts: dict[int, dict[int, dict[int, Count]]] = {}  # job -> epoch -> consumer -> count
        # (job, consumer) -> [tell again once past this many, whether it was told so]
        self._asked: dict[tuple[int, int], list] = {}
        self.gated: dict[int, dict[int, int]] = {}  # job -> consumer -> its syncs waiting for a decision

    def tell(self, job_id: int, epoch: int, consumer: int, count: Count) -> bool:
        """A consumer's count; True when it changed what was known."""
        epochs = self._counts.setdefault(job_id, {})
        if epoch not in epochs and len(epochs) >= EPOCHS_KEPT:
            if epoch < min(epochs):
                return False  # older than any kept: of no one's concern
            del epochs[min(epochs)]
        known = epochs.setdefault(epoch, {})
        if known.get(consumer) == count:
            return False
        known[consumer] = count
        asked = self._asked.get((job_id, consumer))
        if asked is not None and (count.ready > asked[0] or count.total is not None):
            del self._asked[(job_id, consumer)]
        return True

    def of(self, job_id: int, epoch: int) -> dict[int, Count]:
        return dict(self._counts.get(job_id, {}).get(epoch, {}))

    def ask(self, job_id: int, consumer: int, past: int) -> bool:
        """Another consumer waits on this one having more than ``past`` batches:
        it is to tell again soon. True when that is news."""
        key = (job_id, consumer)
        if key in self._asked and self._asked[key][0] >= past:
            return False
        self._asked[key] = [past, False]
        return True

    def asked(self, job_id: int, consumer: int) -> tuple[int, bool] | None:
        """How many batches the consumer is to tell once it has more than, and whether it was told."""
        asked = self._asked.get((job_id, consumer))
        return None if asked is None else (asked[0], asked[1])

    def told(self, job_id: int, consumer: int) -> None:
        """The consumer's sync was answered with what it is asked."""
        if (job_id, consumer) in self._asked:
            self._asked[(job_id, consumer)][1] = True

    def gate(self, job_id: int, consumer: int, waiting: bool) -> None:
        """A sync of ``consumer`` waits for its counts to decide (``waiting``), or no longer."""
        gated = self.gated.setdefault(job_id, {})
        gated[consumer] = gated.get(consumer, 0) + (1 if waiting else -1)
        if not gated[consumer]:
            del gated[consumer]
            if not gated:
                del self.gated[job_id]

    def forget_job(self, job_id: int) -> None:
        self._counts.pop(job_id, None)
        self.gated.pop(job_id, None)
        for key in [k for k in self._asked if k[0] == job_id]:
            del self._asked[key]
