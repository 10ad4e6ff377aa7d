"""pin_memory as torch's DataLoader does it: pinned ahead of the consumer in
a thread of its own, never on the training thread; without an accelerator,
torch's warning and no pinning."""
import threading

import pytest
import torch

import dpex

SPEC = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=64)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the machine without an accelerator")
def test_without_an_accelerator_pin_memory_warns_and_does_not_pin(cluster):
    with pytest.warns(UserWarning, match="no accelerator is found"), \
            dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=8, pin_memory=True, timeout=60) as dl:
        batches = list(dl)
    assert [y for b in batches for y in b["y"].tolist()] == list(range(64))
    assert not any(b["x"].is_pinned() for b in batches)
    assert not [t for t in threading.enumerate() if t.name == "dpex-pin-memory"]


@gpu
@pytest.mark.parametrize("device", ["", "cuda:0"])
def test_batches_arrive_pinned_from_the_pinning_thread(cluster, device, monkeypatch):
    from torch.utils.data._utils import pin_memory as torch_pin
    pinned_on = []
    real = torch_pin.pin_memory

    def spy(data, device=None):
        pinned_on.append(threading.current_thread().name)
        return real(data, device)
    monkeypatch.setattr(torch_pin, "pin_memory", spy)
    with dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=8, pin_memory=True, pin_memory_device=device,
                               timeout=60) as dl:
        batches = list(dl)
        assert all(b["x"].is_pinned() and b["y"].is_pinned() for b in batches)
        assert [y for b in batches for y in b["y"].tolist()] == list(range(64))
    assert pinned_on and set(pinned_on) == {"dpex-pin-memory"}  # never the training thread


@gpu
def test_a_pinned_epoch_left_midway_stops_its_thread(cluster):
    with dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=8, pin_memory=True, timeout=60) as dl:
        for i, _ in enumerate(dl):
            if i == 1:
                break
        from dpex.testing import wait_until
        wait_until(lambda: not [t for t in threading.enumerate() if t.name == "dpex-pin-memory"], 10,
                   "the pinning thread to stop")
        assert [y for b in dl for y in b["y"].tolist()] == list(range(64))  # a new epoch, complete


@gpu
def test_frames_from_another_host_are_received_into_pinned_memory_and_safe_to_copy_from(cluster):
    """shared_memory=False (the network path): a frame is read from the data
    socket straight into a pinned block, its tensors are views of it (no copy
    by the pinning thread), and a non_blocking copy from a batch the loop has
    already dropped still reads the right bytes (the block is not reused
    until the copy is done)."""
    from torch.utils.data import DataLoader

    from dpex.testing.datasets import Squares
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=256, dim=4096)  # 128 KB frames: on the socket
    expected = [b["x"] for b in DataLoader(Squares(256, 4096), batch_size=8)]
    copies = []
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=8, pin_memory=True, shared_memory=False,
                               timeout=60) as dl:
        torch.cuda._sleep(2_000_000_000)  # the copies below queue behind about a second of GPU time
        for b in dl:
            assert b["x"].is_pinned() and b["y"].is_pinned()
            assert b["x"].untyped_storage().data_ptr() == b["y"].untyped_storage().data_ptr()  # the frame's block
            copies.append(b["x"].to("cuda", non_blocking=True))
    torch.cuda.synchronize()
    assert len(copies) == len(expected) and all(c.cpu().equal(e) for c, e in zip(copies, expected))
