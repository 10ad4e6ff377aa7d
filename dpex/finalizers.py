"""Finalizers and exit hooks that run only in the process that made them.

A forked child (torch's DataLoader workers, a user's ``os.fork()``) holds copies
of its parent's loaders, sessions, epochs and clusters, and its garbage
collector may collect them: closing a parent's gRPC channel there waits for
gRPC threads that were not forked (the child hangs for ever), and stopping a
parent's cluster there would stop the parent's. They are the parent's to end."""
from __future__ import annotations

import atexit
import os
import weakref
from typing import Any, Callable


def finalize(obj: Any, fn: Callable[..., Any], *args: Any, at_exit: bool = True) -> weakref.finalize:
    """``weakref.finalize(obj, fn, *args)``, a no-op in any other process.

    Args:
        obj: the object whose collection runs ``fn``.
        fn: called with ``args`` (its result is the finalizer's, as weakref's).
        at_exit: run at interpreter exit if still alive (weakref's ``atexit``).
    Returns:
        The finalizer: call it, ``detach()`` it or read ``alive`` as weakref's."""
    finalizer = weakref.finalize(obj, _in_maker, os.getpid(), fn, *args)
    finalizer.atexit = at_exit
    return finalizer


def register_at_exit(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``atexit.register(fn)``, run only in the process that registered it (a
    forked child that exits normally runs its parent's exit hooks). Returns ``fn``."""
    atexit.register(_in_maker, os.getpid(), fn)
    return fn


def _in_maker(pid: int, fn: Callable[..., Any], *args: Any) -> Any:
    if os.getpid() == pid:
        return fn(*args)
    return None
