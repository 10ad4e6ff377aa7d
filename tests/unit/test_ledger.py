"""Where each batch of an epoch stands, and what the fetcher asks for next."""
from dpex.client.checkpoint import Progress
from dpex.client.ledger import Ledger

A, B = "10.0.0.1:1", "10.0.0.2:1"


def everyone(who=A):
    return lambda seq: who


def test_asks_fill_the_window_in_groups_and_never_ask_twice():
    ledger = Ledger(20, 0, Progress())
    assert ledger.asks(8, 2, True, everyone()) == {A: list(range(8))}
    assert ledger.asks(8, 2, True, everyone()) == {}  # all asked, none received
    ledger.receive(0, "b0")
    assert ledger.asks(8, 2, True, everyone()) == {}  # received but not given: still in the window
    assert ledger.pop_ready(True) == "b0"
    ledger.given(0, True)
    assert ledger.asks(8, 2, True, everyone()) == {}  # one free: less than a group
    ledger.receive(1, "b1")
    ledger.pop_ready(True), ledger.given(1, True)
    assert ledger.asks(8, 2, True, everyone()) == {A: [8, 9]}


def test_the_next_batch_in_order_is_asked_for_even_with_a_full_window():
    ledger = Ledger(10, 0, Progress())
    ledger.asks(4, 1, True, everyone())
    assert ledger.reroute(lambda seq, address: seq == 0) == [(0, A)]  # its stream failed
    for seq in (1, 2, 3):
        ledger.receive(seq, seq)
    assert ledger.pop_ready(True) is None  # waits for 0
    assert ledger.asks(4, 1, True, everyone(B)) == {B: [0]}  # window full of 1..3, 0 still asked
    assert ledger.requested == {0: B}


def test_no_owner_means_not_asked_yet_and_order_is_kept():
    ledger = Ledger(6, 0, Progress())
    assert ledger.asks(6, 1, True, lambda seq: A if seq < 3 else None) == {A: [0, 1, 2]}
    assert ledger.asks(6, 1, True, everyone(B)) == {B: [3, 4, 5]}
    for seq in (5, 3, 4, 1, 0, 2):
        ledger.receive(seq, seq)
    order = []
    while (item := ledger.pop_ready(True)) is not None:
        ledger.given(item, True)
        order.append(item)
    assert order == [0, 1, 2, 3, 4, 5] and ledger.finished


def test_unordered_gives_what_came_first():
    ledger = Ledger(3, 0, Progress())
    ledger.asks(3, 1, False, everyone())
    ledger.receive(2, "two")
    assert ledger.pop_ready(False) == "two"


def test_duplicates_and_foreign_seqs_are_not_new():
    ledger = Ledger(3, 0, Progress())
    ledger.asks(3, 1, True, everyone())
    assert ledger.is_new(1)
    ledger.receive(1, "x")
    assert not ledger.is_new(1) and not ledger.is_new(3)


def test_the_low_mark_follows_received_batches_without_gaps():
    ledger = Ledger(5, 0, Progress())
    ledger.asks(5, 1, True, everyone())
    ledger.receive(1, 1)
    assert ledger.low == 0
    ledger.receive(0, 0)
    assert ledger.low == 2
    assert ledger.missing() == [2, 3, 4]


def test_asking_again_only_what_was_asked_of_that_worker():
    ledger = Ledger(4, 0, Progress())
    ledger.asks(4, 1, True, lambda seq: A if seq % 2 else B)
    assert ledger.ask_again(1, B) is False  # 1 was asked of A
    assert ledger.retry == set()
    assert ledger.ask_again(1, A) is True
    assert ledger.retry == {1} and 1 not in ledger.requested
    assert ledger.reroute(lambda seq, address: address == B) == [(0, B), (2, B)]
    assert ledger.asks(4, 1, True, everyone(A)) == {A: [0, 1, 2]}


def test_a_resumed_epoch_never_asks_for_what_the_checkpoint_gave():
    ledger = Ledger(6, 0, Progress(done=[(0, 2), (4, 5)]))
    assert ledger.asks(6, 1, True, everyone()) == {A: [2, 3, 5]}
    assert ledger.yielded == 3 and ledger.low == 2
    for seq in (2, 3, 5):
        ledger.receive(seq, seq)
    order = []
    while (item := ledger.pop_ready(True)) is not None:
        ledger.given(item, True)
        order.append(item)
    assert order == [2, 3, 5] and ledger.finished


def test_streams_of_unknown_length_end_and_their_later_seqs_are_dropped():
    ledger = Ledger(0, 2, Progress(num_streams=2))  # seq j*2+k: batch j of stream k
    assert ledger.total() is None and ledger.limit() is None
    assert ledger.asks(6, 1, True, everyone()) == {A: list(range(6))}
    ledger.end_stream(1, 1)  # stream 1 had one batch: seqs 3 and 5 never come
    assert sorted(ledger.requested) == [0, 1, 2, 4] and not ledger.exists(5)
    ledger.end_stream(0, 3)
    assert ledger.total() == 4 and ledger.limit() == 5
    for seq in (4, 0, 2, 1):
        ledger.receive(seq, seq)
    order = []
    while (item := ledger.pop_ready(True)) is not None:
        ledger.given(item, True)
        order.append(item)
    assert order == [0, 1, 2, 4] and ledger.finished


def test_skipped_batches_are_never_asked_for_never_given_and_count_as_given():
    ledger = Ledger(6, 0, Progress())
    assert ledger.asks(2, 1, True, lambda seq: "w") == {"w": [0, 1]}
    ledger.receive(1, "one")
    assert ledger.skip(1) == "one" and ledger.skip(2) is None  # received: dropped; not asked yet: never
    ledger.receive(0, "zero")
    assert ledger.pop_ready(True) == "zero"
    ledger.given(0, True)
    assert ledger.asks(8, 1, True, lambda seq: "w") == {"w": [3, 4, 5]}
    assert not ledger.is_new(2) and not ledger.finished
    for seq, item in ((3, "three"), (4, "four"), (5, "five")):
        ledger.receive(seq, item)
        assert ledger.pop_ready(True) == item
        ledger.given(seq, True)
    assert ledger.finished


def test_a_batch_received_unasked_is_passed_over_though_nobody_owns_it_now():
    """The resume race's fourth cause (issue 58): the iterator this one replaced asked for 4..7 of a
    worker; its answers came to this one (the same epoch's keys), whose split of 4..7 was then done,
    with no owner to name. The cursor stopped at 7 (no route) and 8.. were never asked for."""
    ledger = Ledger(12, 0, Progress())
    owned = lambda seq: None if 4 <= seq < 8 else A  # noqa: E731 - the dispatcher names no owner of a split done
    assert ledger.asks(12, 1, True, owned) == {A: [0, 1, 2, 3]}
    for seq in range(8):  # 4..7 unasked, answering the left iterator's requests
        ledger.receive(seq, seq)
    ledger.retry.add(5)  # and one asked again meanwhile (its first answer "not assigned")
    assert ledger.asks(12, 1, True, owned) == {A: [8, 9, 10, 11]}
    assert ledger.retry == set()


def test_a_batch_given_before_the_checkpoint_is_fetched_again_once_when_asked_to():
    """even_batches="longest", resumed: the epoch's first batch (given) is asked for again, not given."""
    ledger = Ledger(6, 0, Progress(done=[(0, 3)]))
    ledger.again = 0
    assert ledger.asks(6, 1, True, everyone()) == {A: [0, 3, 4, 5]}
    assert ledger.asks(6, 1, True, everyone()) == {}
    assert ledger.ask_again(0, A)  # "not assigned": asked again, of whoever owns it then
    assert ledger.asks(6, 1, True, everyone(B)) == {B: [0]}
    assert ledger.yielded == 3 and ledger.pop_ready(True) is None
