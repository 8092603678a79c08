"""Train an MLP on scikit-learn's digits with a Lightning Trainer whose DDP runs over "mpidp".

    mpiexec -n 2 python examples/torch_distributed/lightning_ddp.py [--epochs 5]

The ranks are MPI's: Lightning's own MPIEnvironment reads rank and world size from MPI's
COMM_WORLD. Lightning picks it by itself under mpiexec at more than one rank, but prefers its
SLURMEnvironment wherever SLURM_NTASKS is set, and under mpiexec inside a Slurm allocation that
gives every rank of a node the same rank; passed here, the ranks are MPI's under mpiexec and srun
alike. The Trainer is told as many devices per node and nodes as MPI started: its
DistributedSampler shards the data by these.
"""

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from digits import arguments, dataset, finish, full_loss, mlp, share_cores
from lightning_fabric.plugins.environments import MPIEnvironment
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader

import mpidp
import mpidp.distributed  # noqa: F401  (registers backend "mpidp")


class Digits(pl.LightningModule):
    def __init__(self, lr: float, batch_size: int):
        super().__init__()
        self.net = mlp()
        self.lr, self.batch_size = lr, batch_size
        self.data = dataset()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _index):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        # Lightning puts a DistributedSampler of this rank's shard in place of the shuffle.
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


def main():
    args = arguments(__doc__).parse_args()

    mpidp.init()
    size, per_node = mpidp.size(), mpidp.local_size()
    share_cores(per_node)
    pl.seed_everything(0, verbose=False)
    model = Digits(args.lr, args.batch_size)
    before = full_loss(model, model.data)

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=size // per_node,
        strategy=DDPStrategy(process_group_backend="mpidp", cluster_environment=MPIEnvironment()),
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    after = full_loss(model, model.data)
    finish("lightning_ddp", before, after, trainer.world_size, trainer.global_rank)


if __name__ == "__main__":
    main()
