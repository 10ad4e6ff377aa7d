"""dpex.plan.even: the rules that give every consumer of a job the same number of batches,
decided from what each told (at least ``ready``; ``total`` once known)."""
from dpex.plan.even import END, GO, LONGEST, SHORTEST, Count, decide, rule_of, uneven, waited_on

import pytest


def test_the_words_name_the_rules_as_accelerate_does():
    assert rule_of(True) == LONGEST and rule_of("shortest") == SHORTEST and rule_of(False) is None
    with pytest.raises(ValueError, match="even_batches must be"):
        rule_of("some")


def test_shortest_gives_a_batch_only_once_every_consumer_has_one_and_ends_at_the_fewest():
    counts = {0: Count(3), 1: Count(5)}
    assert decide(SHORTEST, 2, counts, 2) == GO
    assert decide(SHORTEST, 3, counts, 2) is None and waited_on(3, counts, 2) == [0]
    assert decide(SHORTEST, 0, {0: Count(5)}, 2) is None  # consumer 1 has not told: it may have none
    assert waited_on(0, {0: Count(5)}, 2) == [1]
    ended = {0: Count(3, 3), 1: Count(5)}
    assert decide(SHORTEST, 3, ended, 2) == END and decide(SHORTEST, 2, ended, 2) == GO
    # a consumer that told fewer than the fewest total may still end below it: not decided
    assert decide(SHORTEST, 3, {0: Count(3, 3), 1: Count(2)}, 2) is None
    assert decide(SHORTEST, 2, {0: Count(3, 3), 1: Count(2, 2)}, 2) == END


def test_longest_goes_on_while_any_consumer_has_the_batch_and_ends_once_all_are_known():
    assert decide(LONGEST, 4, {0: Count(4, 4), 1: Count(6)}, 2) == GO  # a repeat for consumer 0
    assert decide(LONGEST, 6, {0: Count(4, 4), 1: Count(6)}, 2) is None  # does 1 have a seventh?
    assert decide(LONGEST, 6, {0: Count(4, 4), 1: Count(6, 6)}, 2) == END
    assert decide(LONGEST, 4, {0: Count(4, 4)}, 2) is None  # consumer 1 unheard


def test_an_uneven_epoch_is_named_once_a_known_total_is_below_another_count():
    assert uneven(0, {0: Count(3), 1: Count(5)}, 2) is None  # nothing known for sure yet
    assert uneven(0, {0: Count(5, 5), 1: Count(5, 5)}, 2) is None
    why = uneven(2, {0: Count(3, 3), 1: Count(5), 2: Count(9, 9)}, 3)
    assert why.startswith("the consumers of this job get different numbers of batches in epoch 2 (consumer 0: 3; "
                          "consumer 1: at least 5, consumer 2: 9)")
    assert "even_batches" in why
