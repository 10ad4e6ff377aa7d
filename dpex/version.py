"""What this Dpex is: the package's release, the wire protocol's number, and
the torch release whose samplers it runs, read without importing torch (the
daemons start without it). A dispatcher refuses a worker of another
protocol; a worker of another torch gets no split of a sampler the trainer
described with its own (dpex.dispatcher.assignment)."""
from __future__ import annotations

import functools
import importlib.metadata
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpex.proto import dispatcher_pb2 as dpb

PROTOCOL = 2  # bumped when a message's meaning changes: daemons of two protocols do not mix


@functools.cache
def package() -> str:
    """The dpex release ("0.1.0")."""
    try:
        return importlib.metadata.version("dpex")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "0+unknown"


@functools.cache
def torch() -> str:
    """The torch release installed ("2.13.0"; no build tag: dpex.plan.samplers.torch_version's form), or ""."""
    try:
        return importlib.metadata.version("torch").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return ""


def versions() -> dpb.Versions:
    from dpex.proto import dispatcher_pb2 as dpb
    return dpb.Versions(dpex=package(), protocol=PROTOCOL, torch=torch(), python=platform.python_version())


def describe(v: dpb.Versions | None = None) -> str:
    """``dpex 0.1.0 (protocol 1, torch 2.13.0, Python 3.11.7)``: this process's, or ``v``."""
    v = v or versions()
    return f"dpex {v.dpex} (protocol {v.protocol}, torch {v.torch or 'none'}, Python {v.python})"
