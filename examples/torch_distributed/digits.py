"""What the torch.distributed examples share: scikit-learn's digits, a small MLP, the last line.

The data set ships inside scikit-learn (1,797 8x8 images), so nothing is downloaded.
"""

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler


def arguments(doc: str, epochs: int = 5, lr: float = 0.05) -> argparse.ArgumentParser:
    """The options every example takes; a script adds its own before parse_args()."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=lr)
    return parser


def dataset() -> TensorDataset:
    """All 1,797 digits as (64 pixels in [0, 1], label), in scikit-learn's order on every rank."""
    # The file load_digits() reads, read without importing scikit-learn (and SciPy): that import
    # costs each rank seconds at start-up, more than these examples train.
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "these examples read the digits that ship inside scikit-learn: pip install scikit-learn"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    x = torch.from_numpy(table[:, :-1] / 16.0)
    return TensorDataset(x, torch.from_numpy(table[:, -1].astype(np.int64)))


def mlp(width: int = 64) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def full_loss(model: nn.Module, data: TensorDataset) -> float:
    """The model's cross-entropy over the whole data set: the same number on every rank, so
    training is judged without a collective of its own (an FSDP2 model's forward is one)."""
    x, y = data.tensors
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def train(model, optimizer, loader, epochs: int, backward=torch.Tensor.backward) -> None:
    """Epochs over `loader`; its DistributedSampler, if it has one, reshuffles every epoch (a
    loader Accelerate prepared does so itself)."""
    sampler = getattr(loader, "sampler", None)
    for epoch in range(epochs):
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            backward(F.cross_entropy(model(x), y))
            optimizer.step()


def share_cores(local_size: int) -> None:
    """Ranks of one host split its cores, instead of each starting a thread per core."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_size)))


def finish(name: str, before: float, after: float, ranks: int, rank: int) -> None:
    """Rank 0 prints the one line the tests read; every rank exits 1 if the loss did not drop
    (the ranks hold the same loss, so they agree)."""
    if rank == 0:
        print(f"{name}: loss {before:.4f} -> {after:.4f} on {ranks} rank(s)", flush=True)
    if not after < before:
        print(
            f"{name}: training did not reduce the loss ({before:.4f} -> {after:.4f})",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
