"""Fixtures of the unit tests."""
from tests.unit.dispatching import make_core  # noqa: F401 (a fixture)
