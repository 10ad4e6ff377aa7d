"""DatasetSpec: how a worker builds a dataset from its own local files."""
from __future__ import annotations

import importlib
from typing import Any, Callable

from dpex.errors import DpexConfigError, DpexNotFoundError


class Constant:
    """A picklable callable returning a dataset instance shipped by value.
    Here, not with the client's code: a worker's process that unpickles it
    then imports no gRPC (a quarter of a second in each stream's process)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self) -> Any:
        return self.dataset


class DatasetSpec:
    """A dataset built on the worker: ``target(*args, **kwargs)``.

    Args:
        target: an import string ``"package.module:attr"`` (resolved on the worker, so the trainer needs
            neither the code nor the data) or a callable, shipped to the workers by value.
        *args: passed to ``target`` on the worker; paths are paths on the worker.
        **kwargs: passed to ``target`` on the worker.

    Raises:
        DpexConfigError: a target that is neither ``"package.module:attr"`` nor a callable.
    """

    __slots__ = ("target", "args", "kwargs")

    def __init__(self, target: str | Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        if isinstance(target, str):
            module, sep, attr = target.partition(":")
            if not sep or not module or not attr:
                raise DpexConfigError(
                    f"DatasetSpec target {target!r} must look like 'package.module:attr'")
        elif not callable(target):
            raise DpexConfigError(
                f"DatasetSpec target must be an import string or a callable, not {type(target).__name__}")
        self.target = target
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        name = self.target if isinstance(self.target, str) else getattr(
            self.target, "__qualname__", repr(self.target))
        parts = [repr(name)] + [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"DatasetSpec({', '.join(parts)})"

    def __getstate__(self) -> tuple:
        return (self.target, self.args, self.kwargs)

    def __setstate__(self, state: tuple) -> None:
        self.target, self.args, self.kwargs = state

    def build(self) -> Any:
        """Resolves the target and calls it; runs on the worker."""
        return resolve(self.target)(*self.args, **self.kwargs)


def resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    """Turns ``"package.module:attr"`` into the object it names."""
    if callable(target):
        return target
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise DpexNotFoundError(f"unknown dataset target {target!r}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise DpexNotFoundError(
                f"unknown dataset target {target!r}: {module_name} has no attribute {attr!r}") from None
    return obj


def describe_dataset(dataset: Any) -> tuple[int, str]:
    """(len(dataset), or -1 without one; the dataset's own ``fingerprint``
    attribute or method, or ""): what every worker's copy must agree on."""
    try:
        length = len(dataset)
    except TypeError:  # none, or a wrapper's of a dataset without one
        length = -1
    fingerprint = getattr(dataset, "fingerprint", "")
    fingerprint = fingerprint() if callable(fingerprint) else fingerprint
    return length, str(fingerprint or "")
