"""The original project's spelling: ``from Dpex import dataloader``.

Only an alias of :mod:`dpex`; new code should ``import dpex``.
"""
from dpex import dataloader

__all__ = ["dataloader"]
