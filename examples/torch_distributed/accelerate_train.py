"""Train an MLP on scikit-learn's digits with Hugging Face Accelerate on CPUs, over "mpi".

    mpiexec -n 2 python examples/torch_distributed/accelerate_train.py [--epochs 5]

Accelerator(cpu=True) reads the world from the launcher's environment (PMI_RANK and PMI_SIZE,
which MPICH's hydra sets; OMPI_COMM_WORLD_* under Open MPI) and takes backend "mpi" when
torch.distributed.is_mpi_available(): `import mpidp.distributed` first makes it so, and "mpi"
then runs on mpidp (Accelerate refuses the name "mpidp"; without the import it takes gloo, which
wants MASTER_ADDR). No `accelerate launch`, config file, MASTER_ADDR or RANK is needed.
"""

import torch
from accelerate import Accelerator
from digits import arguments, dataset, finish, full_loss, mlp, train
from torch.utils.data import DataLoader

import mpidp.distributed  # noqa: F401  (before Accelerator: makes "mpi" available)


def main():
    args = arguments(__doc__).parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    data = dataset()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # prepare() wraps the model in DDP and shards the loader over the ranks.
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    before = full_loss(accelerator.unwrap_model(model), data)
    train(model, optimizer, loader, args.epochs, backward=accelerator.backward)
    after = full_loss(accelerator.unwrap_model(model), data)

    state = accelerator.state
    accelerator.end_training()
    finish(
        f"accelerate ({state.distributed_type.value}, backend {state.backend})",
        before,
        after,
        accelerator.num_processes,
        accelerator.process_index,
    )


if __name__ == "__main__":
    main()
