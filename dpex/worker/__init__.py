"""The worker daemon: builds datasets locally and serves finished batches."""
