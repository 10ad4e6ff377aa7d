"""dpex.ray.RayConfig refuses what cannot be, at construction (no Ray needed)."""
import pytest

from dpex.errors import DpexConfigError
from dpex.launch.ray import RayConfig


@pytest.mark.parametrize("kwargs,words", [
    ({"worker_cpus": 0}, "worker_cpus"),
    ({"min_workers": 1}, "together"),
    ({"min_workers": 3, "max_workers": 2}, "min_workers <= max_workers"),
    ({"reconcile_interval_s": 0}, "reconcile_interval_s"),  # was unreachable code after a return
    ({"retry_s": -1}, "retry_s"),
    ({"start_timeout_s": 0}, "start_timeout_s"),
])
def test_a_config_that_cannot_be_is_refused_saying_which(kwargs, words):
    with pytest.raises(DpexConfigError, match=words):
        RayConfig(**kwargs)


def test_the_defaults_run_one_worker_a_node():
    assert not RayConfig().scaled and RayConfig(min_workers=0, max_workers=2).scaled
