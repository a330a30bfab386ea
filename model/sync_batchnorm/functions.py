"""The autograd graph of the synchronized BatchNorm path.

How the synchronized path is built (one graph, any topology):

    x_i --LocalStats_i--> (mean_i, M2_i) --\
    x_j --LocalStats_j--> (mean_j, M2_j) ---CombineStats--> (mean, var) per replica --Normalize_i--> y_i

* LocalStats computes per-channel (mean, M2) of its replica in float32 (float64 for float64 input).
* CombineStats (one node shared by all thread replicas) merges them count-weighted with Chan's formula
  (stable for large means, exact for uneven batches) and, under torch.distributed, reduces the
  per-process result over the group with all-reduces of float64 sums (`reduce_over_group`), whose size
  per process does not depend on the world size.
* Normalize is an eval-mode `F.batch_norm` with the global mean/var, so eps enters exactly as in
  nn.BatchNorm. It saves only its input and the per-channel statistics.

Backward needs one global reduction of [sum(dy), sum(dy * x_hat)] per channel. Normalize_i computes
its replica's part and sends it "down" to CombineStats as the gradient of its statistics input;
CombineStats' backward adds the replicas' parts (and all-reduces across processes); LocalStats_i's
backward receives the global sums and forms the input gradient in two elementwise passes from its
saved input (the same storage Normalize saves) and the grad_output that Normalize_i hands over through
a per-forward `BackwardHandoff`. Because the reduction is a node of the graph all replicas share, it
also works where autograd runs the backward of all replicas in a single thread (CPU), where a
rendezvous between threads would deadlock.
The "gradients" exchanged between these three internal nodes are those packed sums, not true
gradients of the statistics; the input, weight and bias gradients are exact (tested with gradcheck).
Double backward is not supported on the synchronized path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from .divergence import LABEL_WIDTH, label_values

def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are float64 for float64 input, float32 otherwise (float16/bfloat16 included)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _channel_view(per_channel: torch.Tensor, ndim: int) -> torch.Tensor:
    return per_channel.view(1, -1, *([1] * (ndim - 2)))


def _batch_mean_var(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance in the statistics dtype, without upcasting the input.

    ATen's batch_norm_update_stats is the statistics half of the built-in BatchNorm kernel (two-pass,
    vectorized, channels_last aware; several times faster than var_mean over dims (0, 2, 3) on CPU).
    Given float32 running buffers it accumulates float16/bfloat16 input in float32; the buffers here
    are scratch (momentum 0).
    """
    stats_dtype = _stats_dtype(input.dtype)
    scratch_mean = scratch_var = None
    if input.dtype != stats_dtype:
        scratch_mean = torch.zeros(input.size(1), dtype=stats_dtype, device=input.device)
        scratch_var = torch.ones_like(scratch_mean)
    mean, var = torch.ops.aten.batch_norm_update_stats(input, scratch_mean, scratch_var, 0.0)
    return mean.to(stats_dtype), var.to(stats_dtype)


class BackwardHandoff:
    """Per replica and forward: what LocalStats' backward needs besides its saved input.

    Only detached per-channel tensors and Normalize's grad_output (for the duration of one backward)
    live here, so it holds no reference to graph nodes (no reference cycles, nothing kept alive).
    """

    __slots__ = ("local_count", "total_count", "mean", "invstd", "weight", "grad_output")

    def __init__(self) -> None:
        self.local_count = 0
        self.total_count = 0
        self.mean = self.invstd = self.weight = self.grad_output = None


@dataclass
class StatsMessage:
    count: int  # values per channel in this replica
    stats: torch.Tensor  # (2, C): mean, M2 of this replica, in the statistics dtype


@dataclass
class CombineMeta:
    group: Any  # torch.distributed group to merge across, or None
    # (layer key, call count): carried in the all-reduced sums (divergence.label_values), so processes that
    # called different layers at this exchange can tell (divergence.py)
    label: tuple[int, int] = (0, 0)
    # filled by CombineStats.forward: values per channel over every replica (an int) and, under
    # torch.distributed, over every process (a 0-dim tensor: reading it would stall the device queue)
    total_count: int | torch.Tensor = 0
    local_count: int = 0
    label_sums: torch.Tensor | None = None  # (LABEL_WIDTH,), the group's label sums, under torch.distributed


def label_tensor(like: torch.Tensor, key: int, call: int, group) -> torch.Tensor:
    """This process's divergence label values (divergence.label_values) as float64 on `like`'s device, filled
    on the device: one fill per value of a one-element slice. Not `label[i] = value`: on a 0-dim destination
    PyTorch makes the number a CPU tensor and copies it, a blocking host-to-device copy that drains the
    stream (tests/engine/test_host_syncs.py counts them)."""
    values = label_values(key, call, dist.get_rank(group), dist.get_world_size(group))
    if like.device.type == "cpu":
        return torch.tensor(values, dtype=torch.float64)
    label = like.new_empty(len(values), dtype=torch.float64)
    for i, value in enumerate(values):
        label.narrow(0, i, 1).fill_(float(value))
    return label


def reduce_over_group(count: int | torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, label: torch.Tensor,
                      exact: bool, all_reduce) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The group's (count, mean, M2) from this process's float64 (count, mean, M2), and the group's label
    sums, through `all_reduce(tensor) -> summed tensor` (eager: dist.all_reduce; compiled: a functional
    collective with a gradient). Every process sends and receives the same bytes whatever the world size.

    exact=False (statistics in float32: float32, float16 and bfloat16 input): one all-reduce of
    [count, n * mean, M2 + n * mean^2, label]; M2 = sum - N * mean^2 loses about eps64 * (mean / std)^2
    relatively (1e-8 at mean/std = 1e4), below the float32 rounding of the result.
    exact=True (float64 input): two all-reduces, [count, n * mean, label] for the mean, then
    M2 + n * (mean_i - mean)^2: Chan's merge term by term, exact at any mean/std as the float64 path was.
    """
    channels = mean.numel()
    n = count if isinstance(count, torch.Tensor) else mean.new_full((1,), float(count))
    n = n.reshape(1).to(mean.dtype)
    if exact:
        first = all_reduce(torch.cat([n, mean * n, label]))
        total = first[0]
        global_mean = first[1:1 + channels] / total
        global_m2 = all_reduce(m2 + (mean - global_mean).square() * n)
    else:
        first = all_reduce(torch.cat([n, mean * n, m2 + mean.square() * n, label]))
        total = first[0]
        global_mean = first[1:1 + channels] / total
        global_m2 = (first[1 + channels:1 + 2 * channels] - first[1:1 + channels] * global_mean).clamp_min(0)
    return total, global_mean, global_m2, first[-LABEL_WIDTH:]


def _eager_all_reduce(group):
    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=group)
        return tensor
    return reduce


def reads_stall_the_device(tensor: torch.Tensor) -> bool:
    """Whether reading `tensor` on the host waits for a device queue (anything but CPU tensors)."""
    return tensor.device.type != "cpu"


def _merge_local(counts: tuple[int, ...], means: torch.Tensor, m2s: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Chan's merge of this process's replicas, whose counts the host knows (no host-to-device copy)."""
    total = sum(counts)
    if len(counts) == 1:
        return total, means[0], m2s[0]
    mean = sum(means[i] * (count / total) for i, count in enumerate(counts))
    m2 = m2s.sum(0) + sum((means[i] - mean).square() * count for i, count in enumerate(counts))
    return total, mean, m2


def _merge(counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Chan's parallel merge of (count, mean, M2) rows: counts (k,), means/m2s (k, C)."""
    total = counts.sum()
    weights = (counts / total).unsqueeze(1)
    mean = (weights * means).sum(0)
    m2 = m2s.sum(0) + (counts.unsqueeze(1) * (means - mean).square()).sum(0)
    return total, mean, m2


class LocalStats(Function):
    @staticmethod
    def forward(ctx, input: torch.Tensor, handoff: BackwardHandoff) -> torch.Tensor:
        count = input.numel() // input.size(1)
        if count == 0:  # an empty replica contributes nothing (its weight in the merge is 0)
            mean = input.new_zeros(input.size(1), dtype=_stats_dtype(input.dtype))
            var = torch.zeros_like(mean)
        else:
            mean, var = _batch_mean_var(input)
        handoff.local_count = count
        # The same tensor Normalize saves: one storage, kept once.
        ctx.save_for_backward(input)
        ctx.handoff = handoff
        return torch.stack([mean, var * count])

    @staticmethod
    def backward(ctx, global_sums: torch.Tensor):
        handoff = ctx.handoff
        try:
            (x,) = ctx.saved_tensors
            sum_dy, sum_dy_xhat = global_sums[0], global_sums[1]
            mean, invstd, count = handoff.mean, handoff.invstd, handoff.total_count
            if handoff.grad_output is not None and uses_fused_kernels(x):
                return _fused_input_gradient(x, handoff.grad_output, mean, invstd, handoff.weight, sum_dy,
                                             sum_dy_xhat, count), None
            scale = handoff.weight * invstd  # dy coefficient: gamma / sigma
            xhat_coef = invstd * sum_dy_xhat / count
            x_coef = -scale * xhat_coef
            constant = -scale * sum_dy / count + scale * xhat_coef * mean
            # x * x_coef + constant in one fused pass (an eval-mode batch_norm is a per-channel affine map).
            grad_input = F.batch_norm(x, torch.zeros_like(mean), torch.ones_like(mean), x_coef, constant,
                                      False, 0.0, 0.0)
            if handoff.grad_output is not None:  # None when this replica's output did not reach the loss
                grad_input.addcmul_(handoff.grad_output, _channel_view(scale, x.dim()))
            return grad_input, None
        finally:
            handoff.grad_output = None


def uses_fused_kernels(tensor: torch.Tensor) -> bool:
    """Whether the input gradient comes from torch's fused CUDA kernel (CUDA tensors; CPU has none)."""
    return tensor.is_cuda


def _fused_input_gradient(x: torch.Tensor, grad_output: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                          weight: torch.Tensor, sum_dy: torch.Tensor, sum_dy_xhat: torch.Tensor,
                          count: int | torch.Tensor) -> torch.Tensor:
    """gamma * invstd * (dy - sum(dy)/N - (x - mean) * invstd^2 * sum(dy * (x - mean))/N) in one pass
    (torch.batch_norm_backward_elemt, the kernel torch.nn.SyncBatchNorm uses), instead of an affine map
    of x plus a multiply-add with dy (two passes over the activation)."""
    total = count.reshape(1) if isinstance(count, torch.Tensor) else torch.full((1,), count, device=x.device)
    if not any(grad_output.is_contiguous(memory_format=layout)
               for layout in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)):
        grad_output = grad_output.contiguous()
    return torch.batch_norm_backward_elemt(grad_output, x, mean, invstd, weight, sum_dy, sum_dy_xhat / invstd,
                                           total.round().to(torch.int32))


class CombineStats(Function):
    @staticmethod
    def forward(ctx, meta: CombineMeta, counts: tuple[int, ...], *local_stats: torch.Tensor):
        devices = [stats.device for stats in local_stats]
        master = devices[0]
        stacked = torch.stack([stats.to(master) for stats in local_stats])  # (k, 2, C)
        total, mean, m2 = _merge_local(counts, stacked[:, 0].double(), stacked[:, 1].double())
        meta.local_count = total
        if meta.group is not None:
            # the count travels in the sums, so no process needs the others' counts on the host; the label
            # (layer key, call count) ends them
            label = label_tensor(mean, *meta.label, meta.group)
            total, mean, m2, meta.label_sums = reduce_over_group(
                total, mean, m2, label, exact=stacked.dtype == torch.float64,
                all_reduce=_eager_all_reduce(meta.group))
        meta.total_count = total
        result = torch.stack([mean, m2 / total]).to(stacked.dtype)  # (2, C): mean, biased var
        ctx.devices = devices
        ctx.group = meta.group
        return tuple(result.to(device, copy=True) for device in devices)

    @staticmethod
    def backward(ctx, *partial_sums: torch.Tensor):
        master = ctx.devices[0]
        total = partial_sums[0].to(master, copy=True)
        for part in partial_sums[1:]:
            total += part.to(master)
        if ctx.group is not None:
            dist.all_reduce(total, group=ctx.group)
        return (None, None, *(total.to(device) for device in ctx.devices))


class Normalize(Function):
    @staticmethod
    def forward(ctx, input, global_stats, weight, bias, handoff: BackwardHandoff, eps: float, clamp: bool):
        mean, var = global_stats[0], global_stats[1]
        ctx.variance_passes = None
        if clamp:  # set_sbn_eps_mode('clamp'): divide by sqrt(max(var, eps)) instead of sqrt(var + eps)
            ctx.variance_passes = var >= eps  # where the clamp passes the variance's gradient (as torch.clamp)
            var, eps = var.clamp_min(eps), 0.0
        output = F.batch_norm(input, mean, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(input, weight, mean, var)
        ctx.handoff = handoff
        ctx.eps = eps
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, var = ctx.saved_tensors
        invstd = torch.rsqrt(var + ctx.eps)
        gamma = weight if weight is not None else torch.ones_like(mean)
        if input.numel() == 0:  # an empty share adds nothing (and the CPU kernel divides by 0: SIGFPE, torch 2.14)
            sum_dy_xhat, sum_dy = torch.zeros_like(mean), torch.zeros_like(mean)
        else:  # one fused pass: sum(dy * x_hat) and sum(dy) per channel, with the *global* mean/invstd
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad_output, input, gamma, None, None, mean, invstd, True, ctx.eps, [False, True, True]
            )
        grad_stats = None
        if ctx.needs_input_grad[1]:
            ctx.handoff.grad_output = grad_output
            # where a clamped variance is the constant eps, no gradient flows through it
            through_variance = sum_dy_xhat if ctx.variance_passes is None else sum_dy_xhat * ctx.variance_passes
            grad_stats = torch.stack([sum_dy, through_variance]).to(mean.dtype)
        grad_weight = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_bias = sum_dy.to(ctx.bias_dtype) if ctx.needs_input_grad[3] else None
        return None, grad_stats, grad_weight, grad_bias, None, None, None


