"""dpex.dispatcher.claims: one loader per consumer of a job."""
import pytest

from dpex.dispatcher.claims import Claims
from dpex.errors import DpexConflictError

KEY = (7, 0)


def test_a_busy_consumer_is_refused_to_another_loader_and_kept_by_its_own():
    claims = Claims(clock=lambda: 0.0)
    claims.take(KEY, 1, "ipv4:10.0.0.1:5", "job", busy=False)
    claims.take(KEY, 1, "ipv4:10.0.0.1:5", "job", busy=True)  # its own again: fine
    with pytest.raises(DpexConflictError, match=r"consumer 0 of job 'job' is in use by another loader "
                                                r"\(ipv4:10\.0\.0\.1:5, since "):
        claims.take(KEY, 2, "ipv4:10.0.0.2:6", "job", busy=True)
    assert claims.holds(KEY, 1) and not claims.holds(KEY, 2)
    claims.release(KEY, 2)  # not its to release
    assert claims.holds(KEY, 1) and not claims.holds(KEY, 2)


def test_an_idle_consumer_or_a_resume_changes_hands_and_a_release_frees_it():
    claims = Claims()
    claims.take(KEY, 1, "a", "", busy=False)
    claims.take(KEY, 2, "b", "", busy=False)  # the holder is between epochs (or silent): taken
    assert claims.holds(KEY, 2) and not claims.holds(KEY, 1)
    claims.take(KEY, 3, "c", "", busy=True, takeover=True)  # a resumed epoch
    assert claims.holds(KEY, 3)
    claims.release(KEY, 3)
    assert claims.holds(KEY, 1) and claims.holds(KEY, 2)  # nobody holds it
    claims.take(KEY, 4, "d", "", busy=True)
    claims.forget_job(7)
    assert claims.holds(KEY, 5)


def test_a_call_without_an_id_is_no_bypass():
    # client_id=0 was let through: a forged SyncConsumer or ReleaseConsumer stalled or cancelled a
    # trainer's epoch (issue 61). It is an id as any other: refused while another loader holds the consumer.
    claims = Claims()
    claims.take(KEY, 1, "a", "", busy=True)
    with pytest.raises(DpexConflictError, match="in use by another loader"):
        claims.take(KEY, 0, "b", "", busy=True)
    assert not claims.holds(KEY, 0) and claims.holds(KEY, 1)
    claims.release(KEY, 0)  # not its to release
    assert claims.holds(KEY, 1) and not claims.holds(KEY, 0)


def test_a_holder_whose_connection_ended_frees_the_consumer_at_once():
    claims = Claims()
    claims.take(KEY, 1, "a", "job", busy=False)
    assert not claims.gone(KEY, 2)  # not its claim
    assert claims.gone(KEY, 1)
    claims.take(KEY, 2, "b", "job", busy=True)  # free at once, busy or not
    assert claims.holds(KEY, 2) and not claims.holds(KEY, 1)
