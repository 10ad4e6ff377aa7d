"""A worker's memory is bounded by its configuration, not by how long it runs."""
import dpex
from dpex.testing import descendants, test_cluster


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_batch_processes_do_not_grow_epoch_after_epoch():
    # Each epoch re-seeds the batch process (torch's workers are new processes
    # every epoch); the RNG states it keeps once let each epoch's batch pin a
    # hole in the heap: the process grew by a batch (9.6 MB here) per epoch.
    with test_cluster(num_workers=1, processes=1) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Cached", n=256)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=64, timeout=60) as dl:  # 9.6 MB batches
            for _ in range(3):
                assert len(list(dl)) == 4
            child = max(descendants(c.workers[0].process.pid), key=_rss_mb)  # not multiprocessing's tracker
            before = _rss_mb(child)
            for _ in range(10):
                assert len(list(dl)) == 4
            assert _rss_mb(child) - before < 16, "a batch process grew with the number of epochs"


def test_batch_processes_reuse_freed_heap_instead_of_faulting_it_in_again():
    # Batch processes map buffers of 1 MB or more whole (above); with glibc's
    # trim threshold then fixed at 128 KB, every image-sized buffer freed at the
    # heap's top was given back and faulted in again by the next sample: a
    # third of a batch process's CPU on a JPEG pipeline (benchmarks/worker_rate.py).
    with test_cluster(num_workers=1, processes=1) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:HeapChurn", n=64)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=8, timeout=60) as dl:
            faults = [b["faults"].tolist() for b in dl]
    assert len(faults) == 8
    later = sorted(f for batch in faults[2:] for f in batch)  # after the heap has grown once
    # 8 x 512 KB faulted in again is ~800 a sample; a sample may meet a heap moved by something else once.
    assert later[len(later) * 9 // 10] < 64 and later[-1] < 256, f"page faults per sample: {later}"


def _mapped_from(pid: int, directory: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [line.split(None, 5)[-1].strip() for line in f if directory in line]
    except OSError:  # gone meanwhile
        return []


def test_an_idle_worker_gives_its_hand_off_memory_back():
    # After a burst of batches a worker kept its spare hand-off files, and its
    # batch processes their mappings, for as long as it stayed idle: 200-400 MB
    # of /dev/shm for minutes (issue 55). Spares nobody takes go after
    # dpex.shm.SPARE_IDLE_S, and the processes let go of their removed files.
    import os
    from dpex import shm
    from dpex.testing import wait_until
    with test_cluster(num_workers=1, processes=2) as c:
        worker = c.workers[0].process.pid
        directory = os.path.join(shm.SHM, f"dpex-{worker}")
        spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=32, dim=100_000)  # 1.6 MB batches
        with dpex.RemoteDataLoader(c.address, spec, batch_size=4, timeout=60) as dl:
            for _ in range(2):
                assert len(list(dl)) == 8
            assert any(f.startswith(shm.SPARE) for f in os.listdir(directory))  # kept while it may be busy
            wait_until(lambda: not os.listdir(directory) and not any(
                _mapped_from(pid, directory) for pid in descendants(worker)), 4 * shm.SPARE_IDLE_S,
                "the idle worker's spare files and their mappings to go")
            assert len(list(dl)) == 8  # and the next epoch makes new ones
