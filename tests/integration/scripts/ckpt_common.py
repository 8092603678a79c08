"""Shared by the checkpoint and elastic fault scripts: a job whose every step uses every RNG."""

import random

import numpy as np
import torch

import mpidp
from mpidp.elastic import ElasticSampler

BATCH = 8


def seed_rank(rank: int) -> None:
    """Different RNG streams on every rank, so a rank given another rank's state would differ."""
    torch.manual_seed(1000 + rank)
    np.random.seed(2000 + rank)
    random.seed(3000 + rank)


def setup():
    """A small model with dropout, Adam under DistributedOptimizer, a shuffling ElasticSampler."""
    data = torch.Generator().manual_seed(0)
    x = torch.randn(200, 8, generator=data)
    y = (x @ torch.randn(8, 1, generator=data)).tanh()
    dataset = torch.utils.data.TensorDataset(x, y)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    mpidp.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = mpidp.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    sampler = ElasticSampler(dataset, shuffle=True, seed=5)
    # Its own generator: a DataLoader otherwise draws from torch's global one for every new
    # iterator, which a mid-epoch resume would draw once more than the uninterrupted run.
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator()
    )
    return model, opt, sampler, loader


def step(model, opt, x, y) -> None:
    """One step whose result depends on torch's (dropout), numpy's and Python's RNG."""
    x = x + torch.from_numpy(np.random.normal(0.0, 0.05, size=tuple(x.shape))).float()
    if random.random() < 0.5:
        x = x.flip(1)
    model.train()
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def write_result(model, path: str) -> None:
    """Rank 0 writes the final parameters; every rank first checks the replicas agree."""
    mpidp.check_replicas(model)
    if mpidp.rank() == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, path)
