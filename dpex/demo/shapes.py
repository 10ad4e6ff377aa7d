"""A small on-disk image-classification dataset of PNG files, and the
dataset class workers use to decode and augment it."""
from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

CLASSES = ["circle", "square", "triangle", "cross", "hbar", "vbar"]
SIZE = 32
MEAN, STD = 0.5, 0.25
_VERSION = 2  # bump when the generator changes


def _draw(kind: str, rng: np.random.Generator) -> Image.Image:
    background = tuple(int(c) for c in rng.integers(0, 90, 3))
    image = Image.new("RGB", (SIZE, SIZE), background)
    d = ImageDraw.Draw(image)
    color = tuple(int(c) for c in rng.integers(120, 256, 3))
    r = int(rng.integers(4, 11))
    cx, cy = (int(v) for v in rng.integers(r + 1, SIZE - r - 1, 2))
    if kind == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif kind == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif kind == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    elif kind == "cross":
        d.line([cx - r, cy - r, cx + r, cy + r], fill=color, width=3)
        d.line([cx - r, cy + r, cx + r, cy - r], fill=color, width=3)
    elif kind == "hbar":
        d.rectangle([cx - r, cy - 2, cx + r, cy + 2], fill=color)
    else:
        d.rectangle([cx - 2, cy - r, cx + 2, cy + r], fill=color)
    for _ in range(3):  # clutter: small random blobs
        x, y = (int(v) for v in rng.integers(0, SIZE, 2))
        d.ellipse([x, y, x + 3, y + 3], fill=tuple(int(c) for c in rng.integers(60, 200, 3)))
    noise = rng.normal(0, 40, (SIZE, SIZE, 3))
    return Image.fromarray(np.clip(np.asarray(image) + noise, 0, 255).astype(np.uint8))


def generate(root: str, per_class: dict[str, int] | None = None, seed: int = 0) -> str:
    """Writes root/{train,test}/{class}/*.png once; returns root."""
    per_class = per_class or {"train": 700, "test": 150}
    if os.path.exists(os.path.join(root, f".complete-v{_VERSION}")):
        return root
    rng = np.random.default_rng(seed)
    for split, n in per_class.items():
        for kind in CLASSES:
            folder = os.path.join(root, split, kind)
            os.makedirs(folder, exist_ok=True)
            for i in range(n):
                _draw(kind, rng).save(os.path.join(folder, f"{i:05d}.png"))
    open(os.path.join(root, f".complete-v{_VERSION}"), "w").close()
    return root


class ShapesDataset(Dataset):
    """Decodes PNGs from ``root/split``; with ``augment``, random crop
    (4-pixel padding) and horizontal flip; always normalises to a float tensor."""

    def __init__(self, root: str, split: str = "train", augment: bool = False) -> None:
        self.augment = augment
        self.files: list[tuple[str, int]] = []
        base = os.path.join(root, split)
        if not os.path.isdir(base):
            raise FileNotFoundError(f"no {split} split under {root!r} on this machine")
        for label, kind in enumerate(CLASSES):
            folder = os.path.join(base, kind)
            self.files += [(os.path.join(folder, f), label) for f in sorted(os.listdir(folder))]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[i]
        with Image.open(path) as im:
            x = np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0
        if self.augment:
            x = np.pad(x, ((4, 4), (4, 4), (0, 0)), mode="reflect")
            top, left = np.random.randint(0, 9, 2)
            x = x[top:top + SIZE, left:left + SIZE]
            if np.random.rand() < 0.5:
                x = x[:, ::-1]
        x = (x - MEAN) / STD
        return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1))), label
