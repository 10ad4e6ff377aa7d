"""``from dpex.dataloader import DpexDataLoader``, as in the original project."""
from dpex.client.compat import DpexDataLoader

__all__ = ["DpexDataLoader"]
