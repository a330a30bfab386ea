"""Synchronized BatchNorm: batch statistics reduced over every replica and every process.

In training, a `SynchronizedBatchNorm*d` normalizes with the mean and variance of the whole batch seen
by all replicas of `DataParallelWithCallback` (threads, any devices, CPU included) and all processes of
an initialized `torch.distributed` group (NCCL or gloo). With neither, it is plain `F.batch_norm`, bit
for bit `nn.BatchNorm*d`. In eval mode it uses the running statistics like nn.BatchNorm.

How the synchronized path is built (one graph, any topology):

    x_i --LocalStats_i--> (mean_i, M2_i) --\
    x_j --LocalStats_j--> (mean_j, M2_j) ---CombineStats--> (mean, var) per replica --Normalize_i--> y_i

* LocalStats computes per-channel (mean, M2) of its replica in float32 (float64 for float64 input).
* CombineStats (one node shared by all thread replicas) merges them count-weighted with Chan's formula
  (stable for large means, exact for uneven batches) and, under torch.distributed, all-gathers the
  per-process result and merges again.
* Normalize is an eval-mode `F.batch_norm` with the global mean/var, so eps enters exactly as in
  nn.BatchNorm. It saves only its input and the per-channel statistics.

Backward needs one global reduction of [sum(dy), sum(dy * x_hat)] per channel. Normalize_i computes
its replica's part and sends it "down" to CombineStats as the gradient of its statistics input;
CombineStats' backward adds the replicas' parts (and all-reduces across processes); LocalStats_i's
backward receives the global sums and forms the input gradient in two elementwise passes from its
saved input (the same storage Normalize saves) and the grad_output that Normalize_i hands over through
a per-forward `_BackwardHandoff`. Because the reduction is a node of the graph all replicas share, it
also works where autograd runs the backward of all replicas in a single thread (CPU), where a
rendezvous between threads would deadlock.
The "gradients" exchanged between these three internal nodes are those packed sums, not true
gradients of the statistics; the input, weight and bias gradients are exact (tested with gradcheck).
Double backward is not supported on the synchronized path.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function
from torch.nn.modules.batchnorm import _BatchNorm

from .comm import SyncMaster

__all__ = [
    "SynchronizedBatchNorm1d",
    "SynchronizedBatchNorm2d",
    "SynchronizedBatchNorm3d",
]


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


class _BackwardHandoff:
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
class _StatsMessage:
    count: int  # values per channel in this replica
    stats: torch.Tensor  # (2, C): mean, M2 of this replica, in the statistics dtype


@dataclass
class _CombineMeta:
    group: Any  # torch.distributed group to merge across, or None
    total_count: int = 0  # filled by CombineStats.forward


def _merge(counts: torch.Tensor, means: torch.Tensor, m2s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Chan's parallel merge of (count, mean, M2) rows: counts (k,), means/m2s (k, C)."""
    total = counts.sum()
    weights = (counts / total).unsqueeze(1)
    mean = (weights * means).sum(0)
    m2 = m2s.sum(0) + (counts.unsqueeze(1) * (means - mean).square()).sum(0)
    return total, mean, m2


class _LocalStats(Function):
    @staticmethod
    def forward(ctx, input: torch.Tensor, handoff: _BackwardHandoff) -> torch.Tensor:
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


class _CombineStats(Function):
    @staticmethod
    def forward(ctx, meta: _CombineMeta, counts: tuple[int, ...], *local_stats: torch.Tensor):
        devices = [stats.device for stats in local_stats]
        master = devices[0]
        stacked = torch.stack([stats.to(master) for stats in local_stats])  # (k, 2, C)
        count_rows = torch.tensor(counts, dtype=torch.float64, device=master)
        total, mean, m2 = _merge(count_rows, stacked[:, 0].double(), stacked[:, 1].double())
        if meta.group is not None:
            row = torch.cat([total.view(1), mean, m2])
            rows = [torch.empty_like(row) for _ in range(dist.get_world_size(meta.group))]
            dist.all_gather(rows, row, group=meta.group)
            gathered = torch.stack(rows)
            channels = mean.numel()
            total, mean, m2 = _merge(gathered[:, 0], gathered[:, 1 : 1 + channels], gathered[:, 1 + channels :])
        # Host-side sum for thread replicas avoids a device sync; the gathered count needs one.
        meta.total_count = sum(counts) if meta.group is None else int(round(total.item()))
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


class _Normalize(Function):
    @staticmethod
    def forward(ctx, input, global_stats, weight, bias, handoff: _BackwardHandoff, eps: float):
        mean, var = global_stats[0], global_stats[1]
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
        # One fused pass: sum(dy * x_hat) and sum(dy) per channel, with the *global* mean/invstd.
        _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
            grad_output, input, gamma, None, None, mean, invstd, True, ctx.eps, [False, True, True]
        )
        grad_stats = None
        if ctx.needs_input_grad[1]:
            ctx.handoff.grad_output = grad_output
            grad_stats = torch.stack([sum_dy, sum_dy_xhat]).to(mean.dtype)
        grad_weight = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_bias = sum_dy.to(ctx.bias_dtype) if ctx.needs_input_grad[3] else None
        return None, grad_stats, grad_weight, grad_bias, None, None


class _SynchronizedBatchNorm(_BatchNorm):
    """Base class; use SynchronizedBatchNorm1d/2d/3d. Same constructor and state dict as nn.BatchNorm."""

    _accepted_dims: tuple[int, ...] = ()
    _shape_hint = ""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = None  # None: the default group when torch.distributed is initialized
        self._sync_master = SyncMaster(self._data_parallel_master)
        self._is_parallel = False
        self._parallel_id: int | None = None
        self._slave_pipe = None

    # --- state: runtime rendezvous objects never travel with the module ------------------------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_slave_pipe"] = None
        state["_is_parallel"] = False
        state["_parallel_id"] = None
        return state

    @property
    def sync_timeout(self) -> float:
        """Seconds a replica waits for the others before raising (thread replicas)."""
        return self._sync_master.timeout

    @sync_timeout.setter
    def sync_timeout(self, seconds: float) -> None:
        self._sync_master.timeout = float(seconds)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() not in self._accepted_dims:
            dims = " or ".join(f"{d}D" for d in self._accepted_dims)
            raise ValueError(
                f"{type(self).__name__}: expected {dims} input of shape {self._shape_hint.format(C=self.num_features)}, "
                f"got {input.dim()}D input of shape {tuple(input.shape)}"
            )
        if input.size(1) != self.num_features:
            raise ValueError(
                f"{type(self).__name__}: expected {self.num_features} channels in dimension 1 "
                f"(shape {self._shape_hint.format(C=self.num_features)}), got shape {tuple(input.shape)}"
            )

    # --- replication protocol (DataParallelWithCallback / execute_replication_callbacks) --------
    def __data_parallel_replicate__(self, ctx, copy_id: int) -> None:
        self._is_parallel = True
        self._parallel_id = copy_id
        if copy_id == 0:
            ctx.sync_master = self._sync_master
            self._sync_master.start_round()
            self._slave_pipe = None
        else:
            self._slave_pipe = ctx.sync_master.register_slave(copy_id)

    def _distributed_group(self):
        """The process group to reduce over in training, or None when not distributed."""
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _thread_exchange(self) -> Callable[[_StatsMessage], Any] | None:
        if not self._is_parallel:
            return None
        if self._slave_pipe is not None:
            return self._slave_pipe.run_slave
        if self._parallel_id == 0 and self._sync_master.nr_slaves > 0:
            return self._sync_master.run_master
        return None

    def synchronizes(self) -> bool:
        """Whether a forward with batch statistics would now reduce over other replicas or processes.

        All replicas of one step agree on it, so a caller may branch on it without risking a hang.
        """
        return self._thread_exchange() is not None or self._distributed_group() is not None

    def _abort_round(self, error: BaseException) -> None:
        """Fail this step's rendezvous for every thread replica (they raise at once instead of waiting)."""
        if self._slave_pipe is not None:
            self._slave_pipe.abort(error)
        elif self._is_parallel and self._parallel_id == 0:
            self._sync_master.abort(error)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        try:
            self._check_input_dim(input)
        except ValueError as error:
            self._abort_round(error)
            raise
        # Running-statistics bookkeeping exactly as nn.BatchNorm.
        average_factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            average_factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None

        if use_batch_stats and self.synchronizes():
            exchange = self._thread_exchange()
            return self._forward_synchronized(input, exchange, average_factor, running_mean, running_var)
        return F.batch_norm(
            input, running_mean, running_var, self.weight, self.bias, use_batch_stats, average_factor, self.eps
        )

    def _forward_synchronized(
        self,
        input: torch.Tensor,
        exchange: Callable[[_StatsMessage], Any] | None,
        average_factor: float,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
    ) -> torch.Tensor:
        """Normalize with statistics merged through `exchange` (None: this replica alone, plus any
        torch.distributed group). Updates running statistics in place with the global values."""
        handoff = _BackwardHandoff()
        with torch.autocast(device_type=input.device.type, enabled=False):
            local = _LocalStats.apply(input, handoff)
            message = _StatsMessage(handoff.local_count, local)
            if exchange is None:
                global_stats, total_count = self._data_parallel_master([(0, message)])[0][1]
            else:
                global_stats, total_count = exchange(message)
            handoff.total_count = total_count
            stats = global_stats.detach()
            handoff.mean = stats[0]
            handoff.invstd = torch.rsqrt(stats[1] + self.eps)
            handoff.weight = self.weight.detach().to(stats.dtype) if self.weight is not None else torch.ones_like(stats[0])
            output = _Normalize.apply(input, global_stats, self.weight, self.bias, handoff, self.eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                mean, var = global_stats[0].detach(), global_stats[1].detach()
                unbiased = var * (total_count / (total_count - 1))
                running_mean.mul_(1 - average_factor).add_(mean.to(running_mean.dtype), alpha=average_factor)
                running_var.mul_(1 - average_factor).add_(unbiased.to(running_var.dtype), alpha=average_factor)
        return output

    def _data_parallel_master(self, intermediates: list[tuple[int, _StatsMessage]]) -> list[tuple[int, Any]]:
        """Merge every replica's statistics (runs once per step, in the master replica's thread)."""
        meta = _CombineMeta(group=self._distributed_group())
        counts = tuple(message.count for _, message in intermediates)
        outputs = _CombineStats.apply(meta, counts, *(message.stats for _, message in intermediates))
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        if meta.total_count <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {meta.total_count} in total "
                f"over {len(intermediates)} replica(s)"
                + (" and all processes" if meta.group is not None else "")
            )
        return [(copy_id, (stats, meta.total_count)) for (copy_id, _), stats in zip(intermediates, outputs)]


class SynchronizedBatchNorm1d(_SynchronizedBatchNorm):
    """BatchNorm1d over (N, C) or (N, C, L) input, statistics synchronized across replicas/processes."""

    _accepted_dims = (2, 3)
    _shape_hint = "(N, {C}) or (N, {C}, L)"


class SynchronizedBatchNorm2d(_SynchronizedBatchNorm):
    """BatchNorm2d over (N, C, H, W) input, statistics synchronized across replicas/processes."""

    _accepted_dims = (4,)
    _shape_hint = "(N, {C}, H, W)"


class SynchronizedBatchNorm3d(_SynchronizedBatchNorm):
    """BatchNorm3d over (N, C, D, H, W) input, statistics synchronized across replicas/processes."""

    _accepted_dims = (5,)
    _shape_hint = "(N, {C}, D, H, W)"
