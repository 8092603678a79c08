"""SyncBatchNorm: batch normalisation whose training statistics span every rank's batch."""

import itertools

import torch
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from .. import ops
from ..log import logger
from ..runtime import world

# Construction order numbers every SyncBatchNorm; ranks that build the same model in the same order
# give each layer the same collective name, so its ops match across ranks by name.
_instances = itertools.count()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the arithmetic runs in: float64 stays float64; float32, half, bf16 use float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """(C,) -> (1, C, 1, ...) so it broadcasts against an ndim-dimensional (N, C, ...) input."""
    return t.reshape((1, -1) + (1,) * (ndim - 2))


def _reduce_dims(ndim: int):
    """Every dimension but the channels (1). No synchronization."""
    return [0] + list(range(2, ndim))


def _global_stats(x: torch.Tensor, name: str):
    """Per-channel (count, mean, sum of squared deviations) over the union of all ranks' batches,
    as a float count and float64 CPU tensors, identical on every rank.

    Each rank computes its own count, mean and squared-deviation sum (two-pass, via var_mean) and
    writes them into its row of a zeroed (size, 1 + 2C) float64 tensor; an allreduce Sum of that
    tensor is an exact allgather (every element is one rank's value plus zeros). The rows are then
    combined with Chan's parallel formula, in rank order, so there is no sum-of-squares
    cancellation. A rank with an empty batch, or one that has called join() (it contributes zeros),
    counts as a batch of size 0.

    Synchronization: one blocking allreduce named `name`, which every rank must reach.
    """
    size, rank = world.size(), world.rank()
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    slots = torch.zeros(size, 1 + 2 * channels, dtype=torch.float64)
    if count:
        var, mean = torch.var_mean(x, dim=_reduce_dims(x.dim()), correction=0)
        slots[rank, 0] = count
        slots[rank, 1 : channels + 1] = mean.to("cpu", torch.float64)
        slots[rank, channels + 1 :] = var.to("cpu", torch.float64) * count
    ops.synchronize(ops.allreduce_async_(slots, name=name, op=ops.Sum))
    counts, means, m2s = slots[:, :1], slots[:, 1 : channels + 1], slots[:, channels + 1 :]
    total = float(counts.sum())
    if total <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {int(total)} "
            f"over all ranks (input size {tuple(x.shape)} on this rank)"
        )
    mean = (counts * means).sum(0) / total
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return total, mean, m2


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias with global mean/invstd; the gradient w.r.t. x needs
    the global sums of grad_output and grad_output * (x - mean)."""

    @staticmethod
    def forward(ctx, input, weight, bias, mean, invstd, total, name):
        """Normalise with the given global statistics. No synchronization (they were exchanged
        by _global_stats); `name` is the backward allreduce's."""
        acc = mean.dtype
        x = input.to(acc)
        scale = invstd if weight is None else invstd * weight.to(acc)
        out = (x - _per_channel(mean, x.dim())) * _per_channel(scale, x.dim())
        if bias is not None:
            out = out + _per_channel(bias.to(acc), x.dim())
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total, ctx.name = total, name
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        """Synchronization: one blocking allreduce (named ctx.name) when the input needs a
        gradient; the weight and bias gradients are this rank's own (averaged later, for example
        by DistributedOptimizer), like torch.nn.SyncBatchNorm's."""
        input, weight, mean, invstd = ctx.saved_tensors
        acc, ndim = mean.dtype, input.dim()
        dims = _reduce_dims(ndim)
        g = grad_output.to(acc)
        xmu = input.to(acc) - _per_channel(mean, ndim)
        sum_dy = g.sum(dims)
        sum_dy_xmu = (g * xmu).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            channels = sum_dy.numel()
            sums = torch.cat([sum_dy, sum_dy_xmu]).to("cpu", torch.float64)
            ops.synchronize(ops.allreduce_async_(sums, name=ctx.name, op=ops.Sum))
            sums = (sums / ctx.total).to(mean.device, acc)
            mean_dy, mean_dy_xmu = sums[:channels], sums[channels:]
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_input = (
                g
                - _per_channel(mean_dy, ndim)
                - xmu * _per_channel(invstd * invstd * mean_dy_xmu, ndim)
            )
            grad_input = (grad_input * _per_channel(scale, ndim)).to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _sync_batch_norm(
    input, running_mean, running_var, weight, bias, momentum: float, eps: float, name: str
) -> torch.Tensor:
    """Training-mode batch norm over every rank's batch (F.batch_norm's arguments, training=True,
    plus the collective name prefix). Updates running_mean/running_var in place (if given) with
    the global mean and unbiased variance and exponential factor `momentum`.

    Synchronization: a blocking allreduce `name`.stats here, on every rank, and a blocking
    allreduce `name`.grad in the backward pass when the input requires a gradient.
    """
    with torch.no_grad():
        acc = _acc_dtype(input.dtype)
        total, mean, m2 = _global_stats(input.to(acc), name + ".stats")
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None:
            running_mean.mul_(1.0 - momentum).add_(
                mean.to(running_mean.device, running_mean.dtype), alpha=momentum
            )
        if running_var is not None:
            unbiased = m2 / (total - 1)
            running_var.mul_(1.0 - momentum).add_(
                unbiased.to(running_var.device, running_var.dtype), alpha=momentum
            )
        mean, invstd = mean.to(input.device, acc), invstd.to(input.device, acc)
    return _SyncBatchNormFunction.apply(input, weight, bias, mean, invstd, total, name + ".grad")


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation whose training statistics are those of the union of every rank's batch
    (per-rank batch sizes may differ, a rank may even have an empty batch), for inputs (N, C),
    (N, C, L), (N, C, H, W) and (N, C, D, H, W).

    Training mode: normalises with the global batch mean and (biased) variance, updates
    running_mean, running_var (unbiased) and num_batches_tracked exactly as torch.nn.BatchNorm
    would on the concatenated batch (momentum=None gives the cumulative average), and
    back-propagates through the global statistics. Eval mode behaves like torch.nn.BatchNorm:
    running statistics, or this rank's own batch statistics if they are not tracked, with no
    communication. In a world of size 1 it is torch.nn.BatchNorm.

    Synchronization points (training mode, world size > 1): forward makes one blocking allreduce
    (about size * (2C + 1) float64 values) and backward one more (2C values) when the input needs
    a gradient, so every rank must run the same training-mode forward and backward passes through
    each layer. Ranks that called join() contribute nothing, so their batches count as empty.

    The collectives are named "mpidp.SyncBatchNorm.<k>.stats" / ".grad", where k numbers the
    layers in order of construction in this process: every rank must construct its
    SyncBatchNorm layers in the same order (as it does when every rank builds the same model). A
    deep copy keeps its original's name, which is safe because each collective completes before
    the layer returns.

    Device-agnostic: CUDA inputs work too (the small per-channel statistics are staged through
    host memory, which is all this build of mpidp moves), but only CPU is tested here.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum=0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self._collective_name = f"mpidp.SyncBatchNorm.{next(_instances)}"

    def _check_input_dim(self, input):
        """2D to 5D input, like BatchNorm1d/2d/3d together. No synchronization."""
        if input.dim() < 2 or input.dim() > 5:
            raise ValueError(f"expected 2D to 5D input (got {input.dim()}D input)")

    def _check_channels(self, input):
        """Fail before communicating if the channel count does not match the layer's tensors."""
        channels = input.shape[1]
        for what, t in (
            ("weight", self.weight),
            ("bias", self.bias),
            ("running_mean", self.running_mean),
            ("running_var", self.running_var),
        ):
            if t is not None and t.numel() != channels:
                raise ValueError(
                    f"SyncBatchNorm: input has {channels} channels but {what} has "
                    f"{t.numel()} elements"
                )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalise `input`. Synchronization: in training mode with more than one rank, one
        blocking allreduce here and one in backward (see the class docstring); none otherwise."""
        if not self.training or world.size() == 1:
            return super().forward(input)
        self._check_input_dim(input)
        self._check_channels(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        track = self.track_running_stats
        return _sync_batch_norm(
            input,
            self.running_mean if track else None,
            self.running_var if track else None,
            self.weight,
            self.bias,
            factor,
            self.eps,
            self._collective_name,
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Replace every BatchNorm*d (any torch.nn.modules.batchnorm._BatchNorm) in `module`,
        recursively, with a SyncBatchNorm that shares its weight, bias, running statistics and
        num_batches_tracked (so requires_grad flags and optimizers holding the parameters carry
        over) and copies its training mode, like torch.nn.SyncBatchNorm.convert_sync_batchnorm.
        Returns `module`, or the new layer if `module` itself is a batch norm.

        Synchronization: none, but the new layers are numbered in traversal order, so every rank
        must convert the same model (see SyncBatchNorm's collective names)."""
        converted: list = []
        result = cls._convert(module, converted)
        logger.debug(
            "convert_sync_batchnorm: replaced %d batch norm layer(s)%s",
            len(converted),
            f" ({', '.join(converted)})" if converted else "",
        )
        return result

    @classmethod
    def _convert(cls, module, converted, path="") -> torch.nn.Module:
        """convert_sync_batchnorm's recursion; appends each replaced layer to `converted`."""
        output = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            output = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
            )
            if module.affine:
                with torch.no_grad():
                    output.weight = module.weight
                    output.bias = module.bias  # None for a BatchNorm built with bias=False
            output.running_mean = module.running_mean
            output.running_var = module.running_var
            output.num_batches_tracked = module.num_batches_tracked
            output.training = module.training
            if hasattr(module, "qconfig"):
                output.qconfig = module.qconfig
            converted.append(f"{path or '<root>'}: {type(module).__name__}")
        for name, child in module.named_children():
            output.add_module(
                name, cls._convert(child, converted, f"{path}.{name}" if path else name)
            )
        return output
