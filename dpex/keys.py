"""Whose calls act on what. A job's key is handed to the loaders that make or
join the job (GetOrCreateJob) and a worker's key to that worker
(RegisterWorker); a call on a job's epochs, definition or batches carries
the job's key, a worker's heartbeat and deregistration the worker's. Both
are HMACs of the dispatcher's secret, which it keeps in its work dir (keys
survive its restart) and gives to the workers it registers, so that they
check the keys trainers fetch with by themselves. The cluster token says
who may call at all; these keys, which job or worker a call may touch.

A refused call is logged with its peer (once a minute per reason) and
counted by reason for the metrics."""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
from collections import Counter

from dpex.errors import DpexAuthError
from dpex.log import Seldom

log = logging.getLogger("dpex.keys")

SECRET_FILE = "keys.secret"


def load_secret(work_dir: str | None) -> bytes:
    """The dispatcher's secret: its work dir's (made there once), else a new one."""
    if not work_dir:
        return secrets.token_bytes(32)
    path = os.path.join(work_dir, SECRET_FILE)
    try:
        with open(path, "rb") as f:
            secret = f.read()
        if len(secret) == 32:
            return secret
    except FileNotFoundError:
        pass
    secret = secrets.token_bytes(32)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return secret


def _mac(secret: bytes, what: bytes) -> bytes:
    return hmac.new(secret, what, hashlib.sha256).digest()[:16]


def job_key(secret: bytes, job_id: int) -> bytes:
    return _mac(secret, b"job:%d" % job_id)


def worker_key(secret: bytes, worker_id: str) -> bytes:
    return _mac(secret, b"worker:" + worker_id.encode())


def is_job_key(secret: bytes, job_id: int, given: bytes) -> bool:
    """Whether ``given`` is job ``job_id``'s key (in constant time): the dispatcher's check and the workers'."""
    return hmac.compare_digest(given, job_key(secret, job_id))


class Refusals:
    """Refused calls: counted by reason, logged with the peer."""

    def __init__(self, logger: logging.Logger) -> None:
        self._log = logger
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self._seldom = Seldom()

    def refuse(self, reason: str, peer: str, message: str) -> DpexAuthError:
        """Counts and logs a refusal; the error to raise."""
        with self._lock:
            self.counts[reason] += 1
            count = self.counts[reason]
        if self._seldom.due(reason):
            self._log.warning("refused a call from %s (%s, %d so far): %s", peer, reason, count, message)
        return DpexAuthError(message)


class JobKeys:
    """Checks the keys of calls on jobs and workers (``secret``: the dispatcher's)."""

    def __init__(self, secret: bytes, refusals: Refusals) -> None:
        self.secret = secret
        self.refusals = refusals

    def check_job(self, job_id: int, given: bytes, peer: str, call: str) -> None:
        if not is_job_key(self.secret, job_id, given):
            raise self.refusals.refuse(
                "job key", peer, f"{call} names job {job_id} without its key: only the loaders that made or "
                "joined a job act on its epochs, definition and batches")

    def check_worker(self, worker_id: str, given: bytes, peer: str, call: str) -> None:
        if not hmac.compare_digest(given, worker_key(self.secret, worker_id)):
            raise self.refusals.refuse(
                "worker key", peer, f"{call} names worker {worker_id} without its key: only that worker "
                "heartbeats and deregisters as itself")
