import pytest

from dpex.testing import test_cluster


@pytest.fixture(scope="session")
def cluster():
    """Two real worker daemons (one process each) and a dispatcher, on loopback."""
    with test_cluster(num_workers=2, processes=1) as c:
        yield c
