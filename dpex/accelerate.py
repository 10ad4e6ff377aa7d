"""Hugging Face Accelerate with Dpex making the batches.

``accelerator.prepare(loader)`` builds a new ``torch.utils.data.DataLoader``
from the loader's dataset inside its ``DataLoaderShard``, so torch's workers
would make every batch in the trainer. Prepare a ``DpexDataLoader`` with
:func:`prepare_data_loader` instead (the model and optimizer still go through
``accelerator.prepare``)::

    loader = dpex.accelerate.prepare_data_loader(accelerator, loader)

It is ``accelerator.prepare_data_loader`` (Accelerate's public method: its
per-process sharding, device placement, ``end_of_dataloader`` tracking for
gradient accumulation), whose ``base_dataloader`` (the loader the shard
iterates) is then a ``DpexDataLoader`` of the same arguments, planned by the
batch sampler Accelerate made for this process.
"""
from __future__ import annotations

from typing import Any

from dpex.client.compat import DpexDataLoader
from dpex.errors import DpexConfigError

# The arguments Accelerate decides for each process (its batch sampler carries them).
_SAMPLING = ("sampler", "batch_sampler", "batch_size", "shuffle", "drop_last", "dataset")


def prepare_data_loader(accelerator: Any, loader: DpexDataLoader, device_placement: bool | None = None) -> Any:
    """``accelerator.prepare_data_loader(loader)``, with Dpex making the
    batches of the shard it returns."""
    if not isinstance(loader, DpexDataLoader):
        raise DpexConfigError(f"dpex.accelerate.prepare_data_loader takes a DpexDataLoader "
                              f"(distribute_mode=True), got {type(loader).__name__}")
    loader.__dict__["_prepared_by_dpex"] = True  # no warning that Accelerate rebuilds it: this replaces its rebuild
    shard = accelerator.prepare_data_loader(loader, device_placement=device_placement)
    base = getattr(shard, "base_dataloader", None)
    if base is None or base is loader or isinstance(base, DpexDataLoader):
        return shard  # already ours (prepared before), or a shard that iterates the loader itself
    if getattr(base, "batch_sampler", None) is None:
        raise DpexConfigError("Accelerate prepared this loader without a batch sampler (dispatch_batches, or an "
                              "IterableDataset): not supported by dpex.accelerate yet")
    args = {k: v for k, v in loader._init_args.items() if k not in _SAMPLING}
    shard.base_dataloader = DpexDataLoader(base.dataset, batch_sampler=base.batch_sampler, **args)
    loader.close()  # its own epochs never run: the shard's loader makes them
    return shard
