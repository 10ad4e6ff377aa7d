"""Epoch plans: torch samplers described (samplers), explicit batches chunked (spec)."""
