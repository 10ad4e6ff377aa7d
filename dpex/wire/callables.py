"""User code on the wire: datasets, collate and init functions, pickled with
cloudpickle so that what a script defines travels by value.

cloudpickle from 3.1.3 on names the file of every function it pickles by value
"<dynamic-code>", so a worker's traceback of an exception in a user's script
would lose its file and lines. ``dumps`` keeps each code object's own file
name: the code travels as cloudpickle writes it, with its name put back when
it is loaded."""
from __future__ import annotations

import io
import pickle
import types
from typing import Any, Callable

import cloudpickle

__all__ = ["dumps", "loads"]

loads = pickle.loads


def dumps(obj: Any, persistent_id: Callable[[Any], Any] | None = None) -> bytes:
    """``cloudpickle.dumps(obj)``, keeping the file names of the code in it;
    ``persistent_id`` as pickle's (what it names is left out of the pickle)."""
    out = io.BytesIO()
    _Pickler(out, persistent_id).dump(obj)
    return out.getvalue()


class _Pickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, persistent_id: Callable[[Any], Any] | None = None) -> None:
        if persistent_id is not None:  # before pickle's __init__, which looks it up
            self.persistent_id = persistent_id
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._copies: dict[int, types.CodeType] = {}  # kept alive while pickling, so their ids stay theirs

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType) and id(obj) not in self._copies:
            # A copy goes through cloudpickle's own reducer; the original (memoised as itself) is
            # that copy with its file name back. Passing the original would memoise it twice.
            copy = obj.replace()
            self._copies[id(copy)] = copy
            return _with_filename, (copy, obj.co_filename)
        return super().reducer_override(obj)


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    return code if code.co_filename == filename else code.replace(co_filename=filename)
