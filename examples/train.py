"""Train a small CNN on scikit-learn's handwritten digits, data-parallel over MPI with mpidp.

    mpiexec -n 2 python examples/train.py [--epochs 10] [--resume] [--device cuda]

The data set ships inside scikit-learn (1,797 8x8 images), so nothing is downloaded; on a machine
without scikit-learn, --data reads the same images from an .npz (`make gpu-wheels` writes one).
Each rank trains on its shard (DistributedSampler, reshuffled every epoch with set_epoch);
gradients are averaged by mpidp.DistributedOptimizer; rank 0 prints progress; mpidp.checkpoint
writes a checkpoint after every epoch and, with --resume, continues from it.
"""

import argparse
import importlib.util
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import mpidp


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by size")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint", default="out/train_digits.pt")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="cpu",
        help="cuda: GPU local_rank %% count on each rank; auto: cuda if present",
    )
    parser.add_argument(
        "--data",
        help="the digits as an .npz of `images` and `target` instead "
        "of scikit-learn's copy (make gpu-wheels writes one)",
    )
    return parser.parse_args()


def pick_device(choice):
    """This rank's device: ranks of one host spread over its GPUs (several may share one)."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda: torch sees no GPU here (torch.cuda.is_available() is "
            "false); use --device cpu"
        )
    device = torch.device("cuda", mpidp.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def sklearn_digits():
    """The file scikit-learn's load_digits() reads, read without importing scikit-learn: its
    import (SciPy's with it) costs each rank more CPU at start-up than these epochs train."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the digits ship inside scikit-learn: pip install scikit-learn, or --data")
    folder = Path(list(spec.submodule_search_locations)[0])
    table = np.loadtxt(folder / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)


def datasets(seed, path=None):
    if path:
        with np.load(path) as digits:
            images, target = digits["images"], digits["target"]
    else:
        images, target = sklearn_digits()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_test = len(y) // 5
    return TensorDataset(x[n_test:], y[n_test:]), TensorDataset(x[:n_test], y[:n_test])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def evaluate(model, loader, device):
    """Accuracy over the whole test set: each rank counts its shard, then Sum across ranks."""
    model.eval()
    counts = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            counts[0] += (model(x).argmax(1) == y).sum()
            counts[1] += len(y)
    counts = mpidp.allreduce(counts, op=mpidp.Sum, name="eval.counts")
    return (counts[0] / counts[1]).item()


def main():
    args = parse_args()
    mpidp.init()
    rank, size = mpidp.rank(), mpidp.size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // mpidp.local_size()))
    torch.manual_seed(args.seed)
    device = pick_device(args.device)

    train_set, test_set = datasets(args.seed, args.data)
    sampler = DistributedSampler(
        train_set, num_replicas=size, rank=rank, shuffle=True, seed=args.seed
    )
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    test_loader = DataLoader(
        test_set,
        batch_size=256,
        sampler=DistributedSampler(test_set, num_replicas=size, rank=rank, shuffle=False),
    )

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)

    start_epoch = 0
    if args.resume:
        try:  # rank 0 reads, every rank gets the model, optimizer state and its own RNG states
            start_epoch = mpidp.checkpoint.load(args.checkpoint, model=model, optimizer=optimizer)[
                "epoch"
            ]
        except mpidp.CheckpointNotFoundError:  # raised on every rank alike
            pass
    # Every rank starts from rank 0's weights and optimizer state (fresh or resumed).
    mpidp.broadcast_parameters(model.state_dict(), root_rank=0)
    mpidp.broadcast_optimizer_state(optimizer, root_rank=0, model=model)
    optimizer = mpidp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    if rank == 0:
        print(
            f"training on {len(train_set)} digits with {size} rank(s) on {device.type}, "
            f"{len(sampler)} samples per rank per epoch"
            + (f", resuming after epoch {start_epoch}" if start_epoch else ""),
            flush=True,
        )
    for epoch in range(start_epoch, args.epochs):
        began = time.perf_counter()
        model.train()
        sampler.set_epoch(epoch)
        totals = torch.zeros(3)  # loss sum, correct, seen
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
            totals += torch.tensor(
                [loss.item() * len(y), (out.argmax(1) == y).sum().item(), len(y)]
            )
        totals = mpidp.allreduce(totals, op=mpidp.Sum, name="train.totals")
        test_acc = evaluate(model, test_loader, device)
        os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
        # Collective; rank 0 writes atomically, so a crash mid-save keeps the previous one.
        mpidp.checkpoint.save(args.checkpoint, model=model, optimizer=optimizer, epoch=epoch + 1)
        if rank == 0:
            print(
                f"epoch {epoch + 1:3d}/{args.epochs}  loss {totals[0] / totals[2]:.4f}  "
                f"train acc {totals[1] / totals[2]:.4f}  test acc {test_acc:.4f}  "
                f"({time.perf_counter() - began:.2f} s)",
                flush=True,
            )
    mpidp.check_replicas(model)
    test_acc = evaluate(model, test_loader, device)
    if rank == 0:
        print(f"final test accuracy: {test_acc:.4f}", flush=True)
    mpidp.shutdown()


if __name__ == "__main__":
    main()
