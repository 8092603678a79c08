"""Train an MLP on scikit-learn's digits with FSDP2 (fully_shard) over backend "mpidp", with a
distributed checkpoint (torch.distributed.checkpoint) saved and loaded at any rank count.

    mpiexec -n 2 python examples/torch_distributed/fsdp2.py --save out/fsdp2_ckpt
    mpiexec -n 3 python examples/torch_distributed/fsdp2.py --load out/fsdp2_ckpt

Each rank holds a shard of every layer's parameters and of Adam's state; FSDP2 all-gathers a
layer for its forward and backward and reduce-scatters (averages) its gradients. A checkpoint
is written as each rank's shards and resharded on load, so a job may load it at another size.
Rank 0 prints a checksum of the full parameters after --load and before --save, so the two runs
can be compared.
"""

import hashlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from digits import arguments, dataset, finish, full_loss, mlp, share_cores, train
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import mpidp
import mpidp.distributed  # noqa: F401  (registers backend "mpidp")


def checksum(model) -> str:
    """sha256 of the full parameters, in name order: the same on every rank and every size.
    Synchronization: the group (the shards are all-gathered)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    digest = hashlib.sha256()
    for name in sorted(full):
        digest.update(name.encode())
        digest.update(full[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def main():
    parser = arguments(__doc__, epochs=3, lr=3e-3)
    parser.add_argument("--save", metavar="DIR", help="write a DCP checkpoint here at the end")
    parser.add_argument("--load", metavar="DIR", help="start from the DCP checkpoint here")
    args = parser.parse_args()

    dist.init_process_group("mpidp")
    rank, size = dist.get_rank(), dist.get_world_size()
    share_cores(mpidp.local_size())
    torch.manual_seed(0)

    model = mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    if args.load:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=args.load)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        sums = checksum(model)
        if rank == 0:
            print(f"loaded {args.load}: params {sums}", flush=True)

    data = dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    before = full_loss(model, data)
    train(model, optimizer, loader, args.epochs)
    after = full_loss(model, data)

    if args.save:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=args.save)
        sums = checksum(model)
        if rank == 0:
            print(f"saved {args.save}: params {sums}", flush=True)

    dist.destroy_process_group()
    finish("fsdp2", before, after, size, rank)


if __name__ == "__main__":
    main()
