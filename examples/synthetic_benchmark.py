"""Synthetic ResNet-18 training throughput, data-parallel over MPI with mpidp (after Horovod's).

    mpiexec -n 2 python examples/synthetic_benchmark.py [--batch-size 16] [--image-size 32]
    mpiexec -n 1 python examples/synthetic_benchmark.py --no-mpidp --threads 1   # baseline

The model is ResNet-18 written out below (torchvision's layout: BasicBlock, four stages of
64-128-256-512 channels, 1000 classes, 11.7 M parameters in 62 tensors), fed one fixed batch of
random images per rank, so only compute and gradient communication are timed. Gradients are
averaged by mpidp.DistributedOptimizer (each one submitted as soon as backward produces it);
rank 0's parameters and optimizer state are broadcast first. Rank 0 prints the throughput of
each iteration of --num-batches-per-iter steps, then the mean over --num-iters iterations with
a 95 % interval (1.96 standard deviations) and the total over all ranks.

--image-size defaults to 32 to keep CPU runs short; 224 is what Horovod's benchmark uses.

--no-mpidp trains without the wrapper and without any broadcast: nothing is communicated.
At -n 1 this is the single-process baseline for scaling efficiency,

    efficiency = (img/sec per rank at -n N with mpidp) / (img/sec at -n 1 with --no-mpidp),

comparable when both use the same --threads (on one host the default gives each rank
cores/ranks threads, so pass --threads explicitly to the baseline). At -n N it measures N
processes computing side by side with no communication: what is left of the gap is the cost
of communication alone, the rest is contention for cores and memory bandwidth.
"""

import argparse
import os
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpidp

# ---- ResNet-18 (the layout of torchvision.models.resnet18; torchvision is not needed) ----


def conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, blocks=(2, 2, 2, 2), widths=(64, 128, 256, 512), num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers, cin = [], widths[0]
        for i, (n, width) in enumerate(zip(blocks, widths)):
            stage = []
            for j in range(n):
                stage.append(BasicBlock(cin, width, stride=2 if (i > 0 and j == 0) else 1))
                cin = width
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18(num_classes=1000):
    return ResNet((2, 2, 2, 2), num_classes=num_classes)


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ---- benchmark ----


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=16, help="images per rank per step")
    parser.add_argument(
        "--image-size",
        type=int,
        default=32,
        help="height = width of the random images (224 for ImageNet's)",
    )
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument(
        "--num-warmup-batches",
        type=int,
        default=10,
        help="untimed steps before the first iteration",
    )
    parser.add_argument(
        "--num-batches-per-iter", type=int, default=10, help="steps timed together as one iteration"
    )
    parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    parser.add_argument(
        "--fp16-allreduce",
        action="store_true",
        help="send gradients as float16 (mpidp.Compression.fp16)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: CPUs / ranks on this host)",
    )
    parser.add_argument(
        "--no-mpidp",
        action="store_true",
        help="no DistributedOptimizer, no broadcast: local training only",
    )
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    for name in ("batch_size", "image_size", "num_classes", "num_batches_per_iter", "num_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_warmup_batches < 0:
        parser.error("--num-warmup-batches must be >= 0")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    return args


def main():
    args = parse_args()
    # Initialised in both modes: rank, size and local_size come from it. With --no-mpidp the
    # engine stays idle (no op is ever submitted).
    mpidp.init()
    rank, size = mpidp.rank(), mpidp.size()
    threads = args.threads or max(1, cpu_count() // mpidp.local_size())
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)

    model = resnet18(args.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)
    if not args.no_mpidp:
        compression = mpidp.Compression.fp16 if args.fp16_allreduce else mpidp.Compression.none
        optimizer = mpidp.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(), compression=compression
        )
        mpidp.broadcast_parameters(model.state_dict(), root_rank=0)
        mpidp.broadcast_optimizer_state(optimizer, root_rank=0, model=model)

    generator = torch.Generator().manual_seed(args.seed + rank)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    target = torch.randint(0, args.num_classes, (args.batch_size,), generator=generator)

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(text):
        if rank == 0:
            print(text, flush=True)

    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"Model: resnet18 ({n_params / 1e6:.2f} M parameters in "
        f"{len(list(model.parameters()))} tensors), input {args.image_size}x{args.image_size}"
    )
    log(f"Batch size: {args.batch_size} per rank")
    log(f"Number of ranks: {size}, torch threads per rank: {threads}")
    log(
        "Gradient exchange: "
        + (
            "none (--no-mpidp)"
            if args.no_mpidp
            else "mpidp.DistributedOptimizer"
            + (", fp16 compression" if args.fp16_allreduce else "")
        )
    )

    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{x}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)

    mean, conf = float(np.mean(img_secs)), float(1.96 * np.std(img_secs))
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} rank(s): {size * mean:.1f} +-{size * conf:.1f}")
    mpidp.shutdown()


if __name__ == "__main__":
    main()
