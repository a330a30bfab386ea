"""The synchronized path as torch.compile traces it: one graph with the rest of the model.

The eager path (functions.py) is three autograd Functions around an in-place `dist.all_gather`, with
per-forward Python objects between them; Dynamo cannot put those in a graph. While torch.compile traces
a layer (`torch.compiler.is_compiling()`), the layer runs this instead:

* local (mean, M2) from `torch.var_mean` in the statistics dtype, normalization as plain tensor code, so
  autograd (and the compiler's backward) differentiates it all;
* under torch.distributed, the same row as the eager path (count, mean, M2, layer key, call count; float64)
  through torch.distributed's functional collectives (`all_gather_single_autograd`: a graph op with a
  gradient, a reduce-scatter of the rows' gradients in the backward), merged with the eager path's Chan
  formula (`functions._merge`);
* the divergence label through two custom ops, opaque to the compiler and run at each call: `next_label`
  counts the call on the layer (the count the eager path keeps) and makes its (key, count) pair;
  `check_exchange` checks the gathered labels as the eager path does (at once on CPU; on an accelerator
  from an asynchronous copy, at the layer's next call), so a divergence raises the same
  SyncDivergenceError under compile. The ops find their layer by its id in a registry of live layers.

Nothing here runs in eager mode, so the eager path stays what it was.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from . import functions

__all__: list[str] = []

# every live synchronized layer by id(layer): how the custom ops, which take ints, find theirs
_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# one namespace per import name, so that `sync_batchnorm` and `model.sync_batchnorm` can share a process
_NAMESPACE = __name__.replace(".", "_")


def register(layer) -> None:
    """Make `layer` findable by the custom ops (every layer registers itself when built or unpickled)."""
    _LAYERS[id(layer)] = layer


def _layer(layer_id: int):
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise RuntimeError("a compiled synchronized BatchNorm layer is not registered (built without "
                           "__init__ or __setstate__?); build it with its constructor or convert_model")
    return layer


@torch.library.custom_op(f"{_NAMESPACE}::next_label", mutates_args=())
def _next_label(like: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Count the layer's call and return its label (layer key, call count) as float64 on `like`'s device,
    filled on the device (no host-to-device copy)."""
    layer = _layer(layer_id)
    layer._exchange_calls += 1
    label = like.new_full((2,), float(layer._sync_key), dtype=torch.float64)
    label[1] = layer._exchange_calls
    return label


@_next_label.register_fake
def _(like: torch.Tensor, layer_id: int) -> torch.Tensor:
    return like.new_empty((2,), dtype=torch.float64)


@torch.library.custom_op(f"{_NAMESPACE}::check_exchange", mutates_args=())
def _check_exchange(rows: torch.Tensor, layer_id: int, local_count: int) -> torch.Tensor:
    """Raise SyncDivergenceError if the processes' labels (the rows' last two columns) differ, and the eager
    path's ValueError if the whole group has at most one value per channel. Returns a 0 to add to the
    counts, so that the compiler keeps the op where it is."""
    layer = _layer(layer_id)
    group = layer._distributed_group()
    layer._check_pending_labels()
    layer._check_labels(rows[:, -2:], group)
    if local_count <= 1:  # as in the eager path, only then is the total read (a host sync on a device)
        total = int(round(float(rows[:, 0].sum())))
        if total <= 1:
            raise layer._too_few_values(total, replicas=1, distributed=True)
    return rows.new_zeros(())


@_check_exchange.register_fake
def _(rows: torch.Tensor, layer_id: int, local_count: int) -> torch.Tensor:
    return rows.new_zeros(())


def _all_gather(row: torch.Tensor, group) -> torch.Tensor:
    """Every process's row, (processes, len(row)), differentiable. Imported here: the functional collectives
    cost 20 ms to import, which only a compiled layer needs to pay."""
    from torch.distributed import _functional_collectives

    gather = getattr(_functional_collectives, "all_gather_single_autograd", None)
    if gather is None:  # the older name (torch 2.14 keeps it, deprecated); untested here
        gather = _functional_collectives.all_gather_tensor_autograd
    return gather(row, 0, group).view(dist.get_world_size(group), row.numel())


def _exchange(layer, group, count: int, mean: torch.Tensor, m2: torch.Tensor):
    """The group's (total count, mean, M2) from this process's, with the layer's label on the wire."""
    channels = mean.numel()
    label = _next_label(mean.detach(), id(layer))
    row = torch.cat([mean.new_full((1,), count, dtype=torch.float64), mean.double(), m2.double(), label])
    rows = _all_gather(row, group)
    counts = rows[:, 0] + _check_exchange(rows.detach(), id(layer), count)
    return functions._merge(counts, rows[:, 1:1 + channels], rows[:, 1 + channels:1 + 2 * channels])


@torch.library.custom_op(f"{_NAMESPACE}::refuse_thread_replicas", mutates_args=())
def _refuse_thread_replicas(like: torch.Tensor, layer_id: int) -> torch.Tensor:
    """Raise when the graph runs, and abort the other replicas' waits. (An error raised while Dynamo traces
    would only send the frame back to the eager path, silently.) torch's replicate() copies layers without
    __init__, so a replica may not be registered: then there is nothing to abort through it."""
    error = RuntimeError("synchronized BatchNorm: DataParallelWithCallback's thread replicas cannot run under "
                         "torch.compile (their rendezvous is between Python threads); compile one process per "
                         "device (torch.distributed) instead")
    layer = _LAYERS.get(layer_id)
    if layer is not None:
        layer._abort_round(error)
    raise error


@_refuse_thread_replicas.register_fake
def _(like: torch.Tensor, layer_id: int) -> torch.Tensor:
    return like.new_zeros(())


def forward(layer, input: torch.Tensor, average_factor: float, running_mean: torch.Tensor | None,
            running_var: torch.Tensor | None, clamp: bool) -> torch.Tensor:
    """The layer's training-mode forward with batch statistics, reduced over its process group when it
    synchronizes; the same values as `_forward_synchronized` (to rounding) in traceable code."""
    if layer._thread_exchange() is not None:
        input = input + _refuse_thread_replicas(input.detach(), id(layer))  # used, so that the op stays
    group = layer._distributed_group()
    stats_dtype = functions._stats_dtype(input.dtype)
    with torch.autocast(device_type=input.device.type, enabled=False):
        x = input.to(stats_dtype)
        count = input.numel() // input.size(1)
        if count == 0:  # an empty process contributes nothing (its weight in the merge is 0)
            mean = x.new_zeros(input.size(1))
            m2 = torch.zeros_like(mean)
        else:
            var, mean = torch.var_mean(x, [0, *range(2, input.dim())], correction=0)
            m2 = var * count
        if group is None:
            if count <= 1:
                raise layer._too_few_values(count, replicas=1, distributed=False)
            total = count
        else:
            total, mean, m2 = _exchange(layer, group, count, mean, m2)
            mean, var = mean.to(stats_dtype), (m2 / total).to(stats_dtype)  # as the eager path rounds them
        invstd = torch.rsqrt(var.clamp_min(layer.eps) if clamp else var + layer.eps)

        def per_channel(values: torch.Tensor) -> torch.Tensor:
            return functions._channel_view(values.to(stats_dtype), input.dim())

        output = (x - per_channel(mean)) * per_channel(invstd)
        if layer.weight is not None:
            output = output * per_channel(layer.weight)
        if layer.bias is not None:
            output = output + per_channel(layer.bias)
    layer._update_running_stats(mean, var, total, average_factor, running_mean, running_var)
    return output.to(input.dtype)
