"""Trainer side: RemoteDataLoader and the DataLoader-compatible wrapper."""
