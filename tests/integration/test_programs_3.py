"""Shard 3 of the differential tester's random programs in the suite (see
test_differential.py, which runs the programs it found and the child steps)."""
import pytest

from tests.integration.test_differential import programs


# Its own limit: a shard is a minute alone, a few on a busy 2-core machine; the suite's 300 s fired at random
# (an alarm inside a finalizer is swallowed, one in hypothesis's example is shrunk as flaky).
@pytest.mark.timeout(900)
def test_random_programs_behave_as_torchs(cluster):
    programs(cluster.address, shard=3)
