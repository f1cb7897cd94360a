"""Handwritten-digit data for the image examples: scikit-learn's digits (shipped with the package),
MNIST from a local copy, and an ``imagefolder`` tree made from the digits."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

MEAN, STD = 0.3, 0.4  # of the digits' pixels scaled to [0, 1]; MNIST's are 0.13 / 0.31


def load_digits_split(image_size: int = 16, test_fraction: float = 0.2, seed: int = 0) -> dict[str, torch.Tensor]:
    """scikit-learn's 1,797 8x8 digits, resized to ``image_size``, normalized, split train/test by a seeded permutation."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    if image_size != 8:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(len(images) * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    images = (images - MEAN) / STD
    return {"train_x": images[train], "train_y": labels[train], "test_x": images[test], "test_y": labels[test]}


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        data = fh.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find(datadir: Path, stem: str) -> Path:
    for candidate in (datadir / stem, datadir / f"{stem}.gz", datadir / "MNIST" / "raw" / stem,
                      datadir / "MNIST" / "raw" / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{stem}(.gz) not found under {datadir}; --datadir must hold the four MNIST idx files")


def load_mnist_split(datadir: str, image_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """MNIST from a local copy of its idx files (``train-images-idx3-ubyte[.gz]`` ...), normalized."""
    root = Path(datadir)
    out = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = torch.tensor(_read_idx(_find(root, f"{prefix}-images-idx3-ubyte")), dtype=torch.float32)[:, None] / 255.0
        if image_size and image_size != images.shape[-1]:
            images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
        out[f"{split}_x"] = (images - 0.1307) / 0.3081
        out[f"{split}_y"] = torch.tensor(_read_idx(_find(root, f"{prefix}-labels-idx1-ubyte")), dtype=torch.long)
    return out


def spawn_and_report(train: Callable[[int, Any], dict], args: Any) -> None:
    """Run ``train(index, args)`` in one process per XLA device (``xmp.spawn``); rank 0 prints the results as
    JSON and writes them to ``args.output_json`` when set."""
    import torch_xla.distributed.xla_multiprocessing as xmp

    xmp.spawn(_train_and_report, args=(train, args))


def _train_and_report(index: int, train: Callable[[int, Any], dict], args: Any) -> None:
    import json

    import torch_xla.runtime as xr

    results = train(index, args)
    if xr.global_ordinal() == 0:
        text = json.dumps(results, indent=2)
        print(text, flush=True)
        if getattr(args, "output_json", None):
            Path(args.output_json).write_text(text)


def make_digits_imagefolder(directory: str, image_size: int = 32, seed: int = 0) -> Path:
    """Write the digits as PNGs in ``directory/{train,validation}/<label>/<n>.png`` (an ``imagefolder`` data set)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    root = Path(directory)
    digits = load_digits()
    perm = np.random.default_rng(seed).permutation(len(digits.images))
    n_val = len(perm) // 5
    for i, idx in enumerate(perm):
        split = "validation" if i < n_val else "train"
        folder = root / split / str(digits.target[idx])
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (digits.images[idx] * (255.0 / 16.0)).astype(np.uint8)
        Image.fromarray(pixels, mode="L").resize((image_size, image_size), Image.BILINEAR).save(folder / f"{idx}.png")
    return root


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write scikit-learn's digits as an imagefolder data set.")
    parser.add_argument("--make_imagefolder", required=True, metavar="DIR")
    parser.add_argument("--image_size", type=int, default=32)
    cli = parser.parse_args()
    made = make_digits_imagefolder(cli.make_imagefolder, cli.image_size)
    print(f"wrote {sum(1 for _ in made.rglob('*.png'))} images to {made}/{{train,validation}}/<label>/")
