"""Helpers for Dpex's own tests (and users' tests of their pipelines):
a LocalCluster with short heartbeats, datasets that workers can import,
and process-tree inspection for leak checks."""
from dpex.testing.cluster import (descendants, free_port, oracle_context, pids_alive, status_tables, test_cluster,
                                  wait_until)

__all__ = ["descendants", "free_port", "oracle_context", "pids_alive", "status_tables", "test_cluster",
           "wait_until"]
