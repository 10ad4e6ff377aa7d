"""Imported first by the fork server that starts a worker's batch processes
(dpex.worker.pool.batch_process_context): the fork server dies with its
worker daemon, even one killed with SIGKILL, and so do the batch processes
it forked (each dies with its parent, see dpex.procutil.die_with_parent)."""
from dpex.procutil import die_with_parent

die_with_parent()
