"""dpex.auth.Tokens: the tokens a daemon accepts and sends, from a file read again on change."""
import pytest

from dpex.auth import Tokens, load_token
from dpex.errors import DpexConfigError


def bearer(token: str) -> bytes:
    return f"Bearer {token}".encode()


def test_a_fixed_token_or_none():
    tokens = Tokens("abc")
    assert tokens and tokens.current() == "abc" and tokens.accepts(bearer("abc")) and not tokens.accepts(b"abc")
    assert not Tokens(None) and Tokens(None).current() is None and not Tokens(None).reload()


def test_a_file_lists_the_sent_token_first_and_every_one_is_accepted(tmp_path):
    path = tmp_path / "token"
    path.write_text("new\n\nold\n")
    tokens = Tokens(token_file=str(path), check_every_s=0)
    assert tokens.current() == "new" and tokens.accepts(bearer("old")) and tokens.accepts(bearer("new"))
    assert not tokens.accepts(bearer("other")) and not tokens.accepts(bearer("new\nold"))
    assert load_token(str(path)) == "new"  # a trainer's or `dpex status`'s: the first


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_tokens(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_text("one\n")
    tokens = Tokens(token_file=str(path), check_every_s=0)
    path.write_text("two\none\n")
    assert tokens.current() == "two"  # seen on the next use: no signal needed
    path.write_text("")  # a rotation half done: the cluster is not shut out
    assert tokens.current() == "two" and tokens.accepts(bearer("one"))
    assert "is empty; the tokens read before stay" in caplog.text
    path.unlink()
    assert not tokens.reload() and tokens.current() == "two"
    path.write_text("three\n")
    assert tokens.reload() and tokens.current() == "three" and not tokens.accepts(bearer("two"))
    assert not tokens.reload()  # unchanged


def test_a_file_looked_at_no_more_than_once_a_check_interval(tmp_path):
    path = tmp_path / "token"
    path.write_text("one\n")
    tokens = Tokens(token_file=str(path), check_every_s=3600)
    path.write_text("two\n")
    assert tokens.current() == "one"  # not looked at yet: a stat per call would be waste
    assert tokens.reload() and tokens.current() == "two"  # SIGHUP's way: at once


def test_a_daemon_started_with_an_empty_or_missing_file_is_refused(tmp_path):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(DpexConfigError, match="is empty"):
        Tokens(token_file=str(tmp_path / "empty"))
    with pytest.raises(DpexConfigError, match="cannot read the auth token file"):
        Tokens(token_file=str(tmp_path / "missing"))
