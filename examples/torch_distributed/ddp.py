"""Train an MLP on scikit-learn's digits with DistributedDataParallel over backend "mpidp".

    mpiexec -n 2 python examples/torch_distributed/ddp.py [--epochs 5]

`import mpidp.distributed` registers the backend; rank and world size come from MPI, so
init_process_group needs no MASTER_ADDR/MASTER_PORT, RANK or WORLD_SIZE. Each rank trains on its
shard (DistributedSampler); DDP averages the gradients over mpidp's engine.
"""

import torch
import torch.distributed as dist
from digits import arguments, dataset, finish, full_loss, mlp, share_cores, train
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import mpidp
import mpidp.distributed  # noqa: F401  (registers backend "mpidp")


def main():
    args = arguments(__doc__).parse_args()

    dist.init_process_group("mpidp")
    rank, size = dist.get_rank(), dist.get_world_size()
    share_cores(mpidp.local_size())
    torch.manual_seed(0)  # the same initial model everywhere (DDP also broadcasts rank 0's)

    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = DistributedDataParallel(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    before = full_loss(model.module, data)
    train(model, optimizer, loader, args.epochs)
    after = full_loss(model.module, data)

    dist.destroy_process_group()
    finish("ddp", before, after, size, rank)


if __name__ == "__main__":
    main()
