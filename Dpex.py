"""The original project's spelling: ``from Dpex import dataloader``.

Only an alias of :mod:`dpex`; new code should ``import dpex``. A module of
its own, not a ``Dpex/`` directory: beside ``dpex/`` on a case-insensitive
file system (macOS, Windows) the two would be one directory.
"""
from dpex import dataloader

__all__ = ["dataloader"]
