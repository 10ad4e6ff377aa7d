"""Epoch plans: torch samplers described (samplers), explicit batches chunked (spec),
IterableDataset stream seqs (seq)."""
