"""User code on the wire: datasets, collate and init functions, pickled with
cloudpickle so that what a script defines travels by value.

cloudpickle from 3.1.3 on names the file of every function it pickles by value
"<dynamic-code>", so a worker's traceback of an exception in a user's script
would lose its file and lines. ``dumps`` keeps each code object's own file
name: the code travels as cloudpickle writes it, with its name put back when
it is loaded."""
from __future__ import annotations

import io
import os
import pickle
import sys
import types
from typing import Any, Callable

import cloudpickle

__all__ = ["digest", "dumps", "loads"]

loads = pickle.loads


def dumps(obj: Any, persistent_id: Callable[[Any], Any] | None = None) -> bytes:
    """``cloudpickle.dumps(obj)``, keeping the file names of the code in it;
    ``persistent_id`` as pickle's (what it names is left out of the pickle).
    The script's code travels by value (see :func:`ship_script_by_value`)."""
    ship_script_by_value()
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


def digest(obj: Any) -> bytes:
    """What ``obj`` is, not how this process pickles it: equal for equal
    content in any process. A pickle differs per process where a tensor's
    storage is named by its key, a class pickled by value carries
    cloudpickle's per-process tracker id, and a set's order follows the hash
    seed; here a tensor is its dtype, shape, strides and bytes' sha256, a
    class has no tracker id and a set is sorted."""
    import hashlib
    out = io.BytesIO()
    _ContentPickler(out).dump(obj)
    return hashlib.sha256(b"dpex-content-1" + out.getvalue()).digest()[:16]


def _tensor_id(obj: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    import hashlib
    data = obj.detach().cpu().contiguous()
    raw = data.reshape(-1).view(torch.uint8)
    return ("tensor", str(obj.dtype), tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(),
            hashlib.sha256(raw.numpy().tobytes()).hexdigest())


class _ContentPickler(_Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, _tensor_id)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (set, frozenset)):
            return type(obj), (sorted(obj, key=repr),)
        reduced = super().reducer_override(obj)
        tracker = cloudpickle.cloudpickle._DYNAMIC_CLASS_TRACKER_BY_CLASS.get(obj) if isinstance(obj, type) else None
        if tracker is not None and isinstance(reduced, tuple) and len(reduced) > 1:
            reduced = (reduced[0], tuple("" if a == tracker else a for a in reduced[1]), *reduced[2:])
        return reduced


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    return code if code.co_filename == filename else code.replace(co_filename=filename)


_INSTALLED = ("site-packages", "dist-packages")
_decided: dict[str, set[tuple[str, int]]] = {}  # script directory -> modules ship_script_by_value decided on


def _script_dir() -> str | None:
    """The directory of the script this process runs (``python train.py``, or
    the script a spawned child re-ran as ``__mp_main__``); None for ``-m``,
    an interactive session or a notebook."""
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or getattr(main, "__spec__", None) is not None:
        return None
    return os.path.dirname(os.path.abspath(path))


def ship_script_by_value() -> None:
    """Marks the user's script code for pickling by value, as cloudpickle
    does for ``__main__``: ``__mp_main__`` (the script in a child of
    ``mp.spawn`` or a spawn-started process) and the modules imported from
    the script's own directory (``from imgtrain import Data`` beside
    ``train.py``), which the workers cannot import. Installed packages, and
    dpex, travel by reference."""
    main = sys.modules.get("__mp_main__")
    if isinstance(main, types.ModuleType) and main.__name__ not in cloudpickle.list_registry_pickle_by_value():
        cloudpickle.register_pickle_by_value(main)
    where = _script_dir()
    if where is None:
        return
    looked = _decided.setdefault(where, set())  # each loader's iter() pickles anew: each module is decided once
    registered = cloudpickle.list_registry_pickle_by_value()
    for name, module in list(sys.modules.items()):
        if (name, id(module)) in looked:
            continue
        looked.add((name, id(module)))
        path = getattr(module, "__file__", None)
        if (not path or name in registered or name.partition(".")[0] in ("dpex", "__main__", "__mp_main__")
                or "." in name and name.partition(".")[0] in registered):
            continue
        path = os.path.abspath(path)
        if path.startswith(where + os.sep) and not any(part in _INSTALLED for part in path.split(os.sep)):
            cloudpickle.register_pickle_by_value(module)
