"""How many workers the trainers need now: the scaling policy, pure (no
clock, no I/O; the caller passes the time and the signals).

Inputs are what the trainers report with their syncs (the share of their
time spent waiting for batches, and the workers their measured rates call
for) and what the workers report with their heartbeats (how busy their
processes are, how many batches they sent). Acting on the number is the
deployment's part: dpex.launch.ray starts and drains worker actors, a
Kubernetes ScaledObject or HPA scales the worker Deployment, and any other
tool can read it from `dpex status` or the metric.

- **Up** while trainers wait (more than ``up_wait`` of their time): to what
  their rates call for, at least one more; the next step up only once the
  last one has had ``settle_s`` to show, and only if it raised the
  throughput (else more workers would not help: the trainers wait on
  something else, e.g. one slow sample).
- **Down** when no trainer waits (under ``down_wait``): to as many workers
  as the busy processes would keep below ``down_busy`` (the minimum when
  they idle: a trainer that pauses, for an evaluation), or to the minimum
  when no trainer reads at all; never within ``cooldown_s`` of the last
  change. The gap between the thresholds is the hysteresis: a steady load
  changes nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ScalingConfig:
    """The policy's bounds and thresholds; the one source of their defaults."""
    min_workers: int = 1
    max_workers: int = 4
    up_wait: float = 0.10      # trainers waiting more than this share of their time: scale up
    down_wait: float = 0.02    # ... less than this, and the workers would be busy enough with one fewer: down
    down_busy: float = 0.70    # the busy fraction the remaining workers may reach after a scale-down
    settle_s: float = 10.0     # time a step up has to show its effect before the next
    cooldown_s: float = 60.0   # no step down within this of the last change
    min_gain: float = 0.05     # a step up that raised the throughput by less did not help

    def __post_init__(self) -> None:
        from dpex.errors import DpexConfigError
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise DpexConfigError(f"need 0 <= min_workers <= max_workers and max_workers >= 1, got "
                                  f"{self.min_workers}..{self.max_workers}")
        if not 0 <= self.down_wait < self.up_wait <= 1:
            raise DpexConfigError("need 0 <= down_wait < up_wait <= 1 (the gap is the hysteresis)")


@dataclass(frozen=True)
class Signals:
    """What the trainers and workers said, as of ``now`` (seconds, any origin)."""
    now: float
    workers: int                 # alive now
    trainers: int = 0            # consumers that synced recently (0: nobody reads)
    wait: float = 0.0            # the largest share of time a trainer spent waiting for batches
    workers_needed: int = 0      # what the trainers' measured rates call for (0: not measured)
    busy: float = 0.0            # the workers' processes' mean busy fraction
    throughput: float = 0.0      # batches per second the workers sent, all together


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str


class Policy:
    """Keeps what the last decisions were; :meth:`decide` for each new look."""

    def __init__(self, config: ScalingConfig) -> None:
        self.config = config
        self.target: int | None = None
        self.reason = "no decision yet"
        self._changed_at = float("-inf")
        self._before_up: float | None = None  # the throughput before the last step up (None: not stepping up)

    def decide(self, s: Signals) -> Decision:
        c = self.config
        current = s.workers if self.target is None else self.target
        current = min(max(current, c.min_workers), c.max_workers)
        since = s.now - self._changed_at
        target, reason = current, f"{s.workers} serving, {current} wanted; trainers wait {s.wait:.0%}"
        if s.wait <= c.up_wait:
            self._before_up = None  # nobody waits: a later wait is a new demand, worth a step up
        if s.trainers == 0:
            if current > c.min_workers and since >= c.cooldown_s:
                target, reason = c.min_workers, f"no trainer reads; {current} -> {c.min_workers}"
        elif s.wait > c.up_wait and current < c.max_workers:
            helped = self._before_up is None or s.throughput >= self._before_up * (1 + c.min_gain)
            if since < c.settle_s and self._before_up is not None:
                reason = f"trainers wait {s.wait:.0%}; the last step up is still settling"
            elif s.workers < current:
                reason = f"trainers wait {s.wait:.0%}; waiting for {current - s.workers} worker(s) to start"
            elif not helped:
                reason = (f"trainers wait {s.wait:.0%}, but the last added worker did not raise the "
                          f"throughput ({self._before_up:.1f} -> {s.throughput:.1f} batches/s); staying at {current}")
            else:
                target = min(c.max_workers, max(current + 1, s.workers_needed))
                reason = f"trainers wait {s.wait:.0%} of the time; {current} -> {target}"
        elif s.wait < c.down_wait and current > c.min_workers and since >= c.cooldown_s:
            # As many as their busy processes would keep below down_busy (a paused trainer's: the fewest).
            enough = max(c.min_workers, math.ceil(s.busy * s.workers / c.down_busy - 1e-9))
            if s.workers and enough < current:
                target = enough
                reason = (f"trainers wait {s.wait:.0%} and the workers are {s.busy:.0%} busy: "
                          f"{current - enough} can go; {current} -> {target}")
        if target != current:
            self._before_up = s.throughput if target > current else None
            self._changed_at = s.now
        self.target, self.reason = target, reason
        return Decision(target, reason)
