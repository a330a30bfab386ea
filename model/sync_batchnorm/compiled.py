"""The synchronized path as torch.compile traces it: one graph with the rest of the model.

The eager path (functions.py) is three autograd Functions around in-place `dist.all_reduce`s, with
per-forward Python objects between them; Dynamo cannot put those in a graph. While torch.compile traces
a layer (`torch.compiler.is_compiling()`), the layer runs this instead:

* local (mean, M2) from `torch.var_mean` in the statistics dtype, normalization as plain tensor code, so
  autograd (and the compiler's backward) differentiates it all;
* under torch.distributed, the same float64 sums as the eager path (`functions.reduce_over_group`: count,
  sums of the means and second moments, the divergence label), summed over the group by torch.distributed's
  functional collectives with gradients (a reduce-scatter and an all-gather: graph ops, whose bytes per
  process do not grow with the world size);
* the divergence label through two custom ops, opaque to the compiler and run at each call: `next_label`
  counts the call on the layer (the count the eager path keeps) and makes its label values;
  `check_exchange` checks the label sums as the eager path does (at once on CPU; on an accelerator
  from an asynchronous copy, at the layer's next call), so a divergence raises the same
  SyncDivergenceError under compile. The ops find their layer by its id in a registry of live layers.

Nothing here runs in eager mode, so the eager path stays what it was.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from . import functions
from .divergence import LABEL_WIDTH

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
    """Count the layer's call and return its label values (divergence.label_values) as float64 on `like`'s
    device, filled on the device (no host-to-device copy)."""
    layer = _layer(layer_id)
    layer._exchange_calls += 1
    return functions.label_tensor(like, layer._sync_key, layer._exchange_calls, layer._distributed_group())


@_next_label.register_fake
def _(like: torch.Tensor, layer_id: int) -> torch.Tensor:
    return like.new_empty((LABEL_WIDTH,), dtype=torch.float64)


@torch.library.custom_op(f"{_NAMESPACE}::check_exchange", mutates_args=())
def _check_exchange(sums: torch.Tensor, layer_id: int, local_count: int) -> torch.Tensor:
    """Raise SyncDivergenceError if the processes' labels differ (`sums`: the group's count, then its label
    sums), and the eager path's ValueError if the whole group has at most one value per channel. Returns
    a 0 to add to the count, so that the compiler keeps the op where it is."""
    layer = _layer(layer_id)
    group = layer._distributed_group()
    layer._check_pending_labels()
    layer._check_labels(sums[1:], group, (layer._sync_key, layer._exchange_calls))
    if local_count <= 1:  # as in the eager path, only then is the total read (a host sync on a device)
        total = int(round(float(sums[0])))
        if total <= 1:
            raise layer._too_few_values(total, replicas=1, distributed=True)
    return sums.new_zeros(())


@_check_exchange.register_fake
def _(sums: torch.Tensor, layer_id: int, local_count: int) -> torch.Tensor:
    return sums.new_zeros(())


def _all_reduce(group):
    """A differentiable sum over the group's processes, as a reduce-scatter and an all-gather (what a ring
    all-reduce does): each process sends and receives about twice the tensor, whatever the world size.
    Not the functional `all_reduce`: with a gradient to trace, Inductor's code for it returned wrong sums
    on CPU (gloo) in torch 2.14.1 where these two are right (the package's test_compile.py catches it). Imported here:
    the functional collectives cost 20 ms to import, which only a compiled layer needs to pay."""
    from torch.distributed import _functional_collectives as collectives

    # the newer names (torch >= 2.12), else the older ones, which torch 2.14 keeps, deprecated
    scatter = getattr(collectives, "reduce_scatter_single_autograd", None) or collectives.reduce_scatter_tensor_autograd
    gather = getattr(collectives, "all_gather_single_autograd", None) or collectives.all_gather_tensor_autograd
    world = dist.get_world_size(group)

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel()
        padded = torch.nn.functional.pad(tensor, (0, -size % world))  # equal shares
        return collectives.wait_tensor(gather(scatter(padded, "sum", 0, group), 0, group))[:size]
    return reduce


def _exchange(layer, group, count: int, mean: torch.Tensor, m2: torch.Tensor, exact: bool):
    """The group's (total count, mean, M2) from this process's, with the layer's label in the sums."""
    label = _next_label(mean.detach(), id(layer))
    total, mean, m2, label_sums = functions.reduce_over_group(count, mean.double(), m2.double(), label, exact,
                                                              _all_reduce(group))
    total = total + _check_exchange(torch.cat([total.detach().reshape(1), label_sums.detach()]), id(layer), count)
    return total, mean, m2


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
            total, mean, m2 = _exchange(layer, group, count, mean, m2, exact=stats_dtype == torch.float64)
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
