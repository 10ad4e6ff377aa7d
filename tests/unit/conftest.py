"""Fixtures of the unit tests."""
from tests.unit.batches import pool  # noqa: F401 (a fixture)
from tests.unit.dispatching import make_core  # noqa: F401 (a fixture)
