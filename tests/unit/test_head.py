"""head_address="auto": $DPEX_DISPATCHER, else a Ray cluster, else embedded."""
import socket

import pytest

from dpex.errors import DpexConfigError
from dpex.launch import head


@pytest.fixture
def ray_dir(tmp_path, monkeypatch):
    for name in ("DPEX_DISPATCHER", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray"


def test_the_order_of_auto(ray_dir, monkeypatch):
    assert head.choose("auto").kind == "embedded"
    with socket.socket() as gcs:  # a Ray node's address file, and something answering there
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        (ray_dir / "ray_current_cluster").write_text("127.0.0.1:%d" % gcs.getsockname()[1])
        assert head.choose("auto") == head.Head("ray", "127.0.0.1:%d" % gcs.getsockname()[1],
                                                "the Ray node running on this machine")
        with monkeypatch.context() as m:
            m.setattr(head, "ray_installed", lambda: False)  # Ray not installed here: said, and embedded
            assert head.choose(None).kind == "embedded"
    assert head.choose("auto").kind == "embedded"  # a stopped node left its file behind
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert head.choose("auto") == head.Head("ray", "10.0.0.1:6379", "$RAY_ADDRESS")
    monkeypatch.setenv("DPEX_DISPATCHER", "dispatcher:7070")  # Dpex's own variable comes first
    assert head.choose("auto") == head.Head("dispatcher", "dispatcher:7070", "$DPEX_DISPATCHER")


def test_explicit_forms(ray_dir, monkeypatch):
    assert head.choose("dpex://dispatcher:7070") == head.Head("dispatcher", "dispatcher:7070", "given")
    assert head.choose("ray://head:10001").kind == "ray"
    assert head.choose("127.0.0.1:1").kind == "dispatcher"  # nothing answers: a dispatcher not up yet
    for bad in ("http://x:1", "no-port", 7070):
        with pytest.raises(DpexConfigError):
            head.choose(bad)
    monkeypatch.setattr(head, "ray_installed", lambda: False)
    with pytest.raises(DpexConfigError, match=r"pip install 'dpex\[ray\]'"):
        head.choose("ray://head:10001")
