"""Structured, levelled log lines for the daemons.

A line is ``time LEVEL logger message key=value ...`` (or one JSON object
with ``--log-format json``). The fields come from ``extra=fields(...)`` at
the call site plus the daemon's own context (``worker_id`` once a worker has
registered), so every line about a worker or a job carries its id.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Any, Hashable

_context: dict[str, Any] = {}


def fields(**kv: Any) -> dict[str, Any]:
    """``log.info("msg", extra=fields(job_id=7))``."""
    return {"dpex_fields": kv}


def set_context(**kv: Any) -> None:
    """Fields added to every line of this process (e.g. the worker's id)."""
    _context.update(kv)


class Seldom:
    """When a message said again and again (a refusal, say) is due in the log:
    at most once per ``every_s`` for each of its kinds."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._said: dict[Hashable, float] = {}

    def due(self, kind: Hashable = None) -> bool:
        """Whether to log a message of ``kind`` now (then it is counted as said)."""
        now = time.monotonic()
        with self._lock:
            if now - self._said.get(kind, -math.inf) < self.every_s:
                return False
            self._said[kind] = now
            return True


def _fields_of(record: logging.LogRecord) -> dict[str, Any]:
    return {**_context, **getattr(record, "dpex_fields", {})}


def _quote(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c in text for c in ' ="') else text


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={_quote(v)}" for k, v in _fields_of(record).items())
        if not extra:
            return line
        head, _, tail = line.partition("\n")  # fields stay on the message's line, before a traceback
        return f"{head} {extra}" + (f"\n{tail}" if tail else "")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                 + f".{int(record.msecs):03d}Z",
                 "level": record.levelname.lower(), "logger": record.name, "pid": record.process,
                 "msg": record.getMessage(), **_fields_of(record)}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def fatal_json(message: str, logger: str = "dpex") -> str:
    """A fatal start-up error as one JSON line of ``--log-format json`` (level critical)."""
    record = logging.LogRecord(logger, logging.CRITICAL, __file__, 0, message, None, None)
    return JsonFormatter().format(record)


def setup(level: str, fmt: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
