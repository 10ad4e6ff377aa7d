"""User code on the wire keeps its file names, whatever cloudpickle does with them."""
import traceback

import pytest

from dpex.wire import callables

SCRIPT = '''
class Dataset:
    def __init__(self, scale):
        self.scale = scale

    def __getitem__(self, i):
        return [self.scale / j for j in (i, i - 1)]  # a comprehension: code inside code


def collate(batch):
    return sorted(batch, key=lambda x: -x)
'''


def script(tmp_path):
    """What a user's script defines: functions and a class of `__main__`, so pickled by value."""
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    namespace = {"__name__": "__main__"}
    exec(compile(SCRIPT, str(path), "exec"), namespace)
    return str(path), namespace


def files(code):
    yield code.co_filename
    for const in code.co_consts:
        if hasattr(const, "co_filename"):
            yield from files(const)


def test_functions_and_classes_keep_their_file_names(tmp_path):
    path, ns = script(tmp_path)
    collate = callables.loads(callables.dumps(ns["collate"]))
    assert collate is not ns["collate"]  # by value, not by reference
    assert set(files(collate.__code__)) == {path}
    assert collate([1, 3, 2]) == [3, 2, 1]
    dataset = callables.loads(callables.dumps(ns["Dataset"](6)))
    assert set(files(type(dataset).__getitem__.__code__)) == {path}
    assert dataset[2] == [3.0, 6.0]


def test_a_remote_traceback_shows_the_users_file_and_line(tmp_path):
    path, ns = script(tmp_path)
    dataset = callables.loads(callables.dumps(ns["Dataset"](1)))
    with pytest.raises(ZeroDivisionError) as raised:
        dataset[1]
    text = "".join(traceback.format_exception(raised.value))
    assert f'File "{path}", line 7, in __getitem__' in text
    assert "return [self.scale / j for j in (i, i - 1)]" in text


def test_one_code_object_twice_is_one_object_after_loading(tmp_path):
    _, ns = script(tmp_path)
    f = ns["collate"]
    g, h = callables.loads(callables.dumps([f, f]))
    assert g is h
    same_code = callables.loads(callables.dumps([f.__code__, f.__code__]))
    assert same_code[0] is same_code[1]
