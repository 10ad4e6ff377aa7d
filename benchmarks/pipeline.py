"""The CPU-heavy image pipeline the benchmarks share: PNG decode, random
resized crop, horizontal flip, normalise, to a float tensor."""
from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def make_images(root: str, count: int, size: int, seed: int = 0, noise: float = 8.0, ext: str = "png") -> str:
    """Writes ``count`` smooth RGB images (PNG, or JPEG for ``ext="jpg"``) of
    ``size``² with pixel noise of standard deviation ``noise``, once."""
    marker = os.path.join(root, f".complete-{count}-{size}-{noise:g}" + ("" if ext == "png" else f"-{ext}"))
    if os.path.exists(marker):
        return root
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    for i in range(count):
        a, b, c = rng.uniform(1, 8, 3)
        base = np.stack([np.sin(a * xx + b * yy), np.cos(b * xx * yy * c), np.sin(c * yy)], -1)
        image = (base * 100 + 128 + rng.normal(0, noise, base.shape)).clip(0, 255).astype(np.uint8)
        Image.fromarray(image).save(os.path.join(root, f"{i:06d}.{ext}"), **({"quality": 90} if ext == "jpg" else {}))
    open(marker, "w").close()
    return root


def bare_rate(make_dataset, batch: int, batches: int, core: int | None = None) -> float:
    """Images per CPU second of ``make_dataset()`` and default_collate alone,
    in this process (a fresh one: run it in a spawned pool), on ``core`` if given."""
    import random
    import time

    from torch.utils.data import default_collate
    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    ds = make_dataset()
    default_collate([ds[i] for i in range(batch)])  # warm
    cpu = time.process_time()
    for _ in range(batches):
        default_collate([ds[random.randrange(len(ds))] for _ in range(batch)])
    return batches * batch / (time.process_time() - cpu)


_POOL_DATASET = None


def _pool_start(make_dataset) -> None:
    global _POOL_DATASET
    torch.set_num_threads(1)
    _POOL_DATASET = make_dataset()


def _pool_batch(indices: list[int]) -> int:
    from torch.utils.data import default_collate
    default_collate([_POOL_DATASET[i] for i in indices])
    return len(indices)


class PoolLoader:
    """The pipeline as a loader with nothing to send: ``processes`` kept
    processes make an epoch's batches (each to the first one free), and the
    caller gets each batch's length only. An epoch starts when the caller
    asks and ends with its slowest batch, as any loader's: what a loader can
    reach on these cores (the bare rate has no epoch's start or end)."""

    def __init__(self, make_dataset, length: int, batch_size: int, processes: int) -> None:
        import multiprocessing as mp
        self.length, self.batch_size = length, batch_size
        self._pool = mp.get_context("spawn").Pool(processes, _pool_start, (make_dataset,))

    def __iter__(self):
        order = torch.randperm(self.length).tolist()
        batches = [order[i:i + self.batch_size] for i in range(0, self.length, self.batch_size)]
        for n in self._pool.imap_unordered(_pool_batch, batches):
            yield range(n), None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._pool._pool]

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()


class ImageFolder(Dataset):
    def __init__(self, root: str, out_size: int = 112) -> None:
        self.files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".png"))
        self.out = out_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
            w, h = im.size
            rng = np.random.default_rng()
            scale = rng.uniform(0.35, 1.0)
            cw, ch = int(w * np.sqrt(scale)), int(h * np.sqrt(scale))
            left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            im = im.resize((self.out, self.out), Image.BILINEAR, box=(left, top, left + cw, top + ch))
            if rng.random() < 0.5:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
        x = (np.asarray(im, dtype=np.float32) / 255.0 - MEAN) / STD
        return torch.from_numpy(x.transpose(2, 0, 1).copy()), i % 10


class IOBound(Dataset):
    """Each sample waits ``wait_s`` (a read from remote storage) and is a
    small uint8 image; the CPU work is negligible."""

    def __init__(self, n: int, wait_s: float = 0.005, size: int = 32) -> None:
        self.n, self.wait_s, self.size = n, wait_s, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import time
        time.sleep(self.wait_s)
        return torch.full((3, self.size, self.size), i % 251, dtype=torch.uint8), i % 10


class LargeBatches(Dataset):
    """A trivial transform of big images: sample i is a fixed 3x224x224 image
    (uint8 or float32) with one value changed, so data moves but no CPU work."""

    def __init__(self, n: int, dtype: str = "uint8", size: int = 224) -> None:
        self.n = n
        self.image = torch.zeros((3, size, size), dtype=getattr(torch, dtype))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.image


class DecodedImages(Dataset):
    """uint8 3x224x224 crops of real decoded images (the first ``count`` PNGs
    under ``root``, decoded once): what compression sees in an image job."""

    def __init__(self, root: str, n: int, count: int = 64, size: int = 224) -> None:
        files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".png"))[:count]
        self.images = [np.asarray(Image.open(f).convert("RGB")) for f in files]
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        image = self.images[i % len(self.images)]
        top, left = (i * 7) % (image.shape[0] - self.size + 1), (i * 13) % (image.shape[1] - self.size + 1)
        crop = image[top:top + self.size, left:left + self.size]
        return torch.from_numpy(np.ascontiguousarray(crop.transpose(2, 0, 1)))


def make_jpegs(root: str, count: int, size: int, seed: int = 0) -> str:
    """Photo-like RGB JPEGs (quality 90) of ``size``², once: what an image job reads."""
    return make_images(root, count, size, seed, noise=6.0, ext="jpg")


class JpegFolder(Dataset):
    """What an ImageNet training job's workers do: JPEG decode, random
    resized crop to ``out_size``, random horizontal flip; a uint8 CHW tensor
    (normalised on the trainer's device, as fast pipelines do). ``keyed``:
    the crop and flip are drawn from numpy's global generator, which Dpex
    keys by the sample's place (the same sample, the same crop, wherever it
    is made); else from fresh entropy, as torchvision's transforms do.
    ``center``: a validation set's resize and center crop, nothing drawn."""

    def __init__(self, root: str, out_size: int = 224, keyed: bool = False, center: bool = False) -> None:
        self.files = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".jpg"))
        self.out, self.keyed, self.center = out_size, keyed, center

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.center:
            return self._validation(i)
        with Image.open(self.files[i]) as im:
            im.draft("RGB", (self.out, self.out))  # decode at a reduced scale where the crop allows
            im = im.convert("RGB")
            w, h = im.size
            rng = np.random.default_rng(np.random.randint(2**31) if self.keyed else None)
            scale, ratio = rng.uniform(0.08, 1.0), np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
            cw = int(min(w, round(np.sqrt(scale * w * h * ratio))))
            ch = int(min(h, round(np.sqrt(scale * w * h / ratio))))
            left, top = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            im = im.resize((self.out, self.out), Image.BILINEAR, box=(left, top, left + cw, top + ch))
            if rng.random() < 0.5:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(im).transpose(2, 0, 1).copy()), i % 1000

    def _validation(self, i: int) -> tuple[torch.Tensor, int]:
        """torchvision's validation transform: the whole JPEG decoded, its
        shorter side resized to 8/7 of the crop, the center crop."""
        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
            w, h = im.size
            scale = self.out * 8 / 7 / min(w, h)
            im = im.resize((round(w * scale), round(h * scale)), Image.BILINEAR)
            left, top = (im.size[0] - self.out) // 2, (im.size[1] - self.out) // 2
            im = im.crop((left, top, left + self.out, top + self.out))
        return torch.from_numpy(np.asarray(im).transpose(2, 0, 1).copy()), i % 1000
