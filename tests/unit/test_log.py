"""dpex.log: a message said again and again is logged seldom, per kind."""
from dpex.log import Seldom


def test_a_repeated_message_is_due_once_per_interval_and_kind():
    seldom = Seldom(every_s=3600)
    assert seldom.due("auth") and not seldom.due("auth")  # said: not again within the hour
    assert seldom.due("limit") and seldom.due()  # another kind is due on its own
    assert not seldom.due()
    always = Seldom(every_s=0)
    assert always.due() and always.due()
