"""Counting host synchronizations of CUDA code on a machine without CUDA.

Under `FakeTensorMode` a `device="cuda"` tensor carries its device and shape but no data, so CUDA code runs
(shapes only) on a CPU-only build. `SyncCounter`, a `TorchDispatchMode` inside it, records every call that
makes the host wait for the device queue:

* a blocking copy between the host and the device (`copy_` / `_to_copy` with `non_blocking=False`, either
  direction): `gpu_tensor[0] = 5` is one (PyTorch turns the number into a CPU tensor and copies it);
* `_local_scalar_dense` of a device tensor (`.item()`, `int(t)`, `float(t)`, `bool(t)`, `.tolist()`), which
  is answered with a stand-in value (1) so that the code goes on and every later read is counted too;
* (a fake host tensor's values, read where the code has copied them asynchronously, are 0: not counted);
* an op whose output size depends on the data (`nonzero`, boolean indexing, `unique`, ...), which raises.

`backward(loss)` runs the autograd graph in this thread, node by node: torch's engine hands CUDA nodes to
a device thread, which a build without CUDA cannot start. `fake_cuda()` also gives the two things the CPU
build lacks there: shape functions for `aten::batch_norm_update_stats`, `batch_norm_backward_elemt` and the fused
optimizers and `torch.cuda.Event`.

`training_step_syncs` counts one `Trainer.train_step` (tests/engine/test_host_syncs.py holds it to 0;
benchmarks/bench_host_syncs.py prints it for a config). What it cannot see: autocast and GradScaler switch
themselves off without a CUDA runtime, so the step is counted in fp32 (bf16 adds casts, no syncs; fp16's
GradScaler reads its inf flag once per step, torch's own design).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _device(value) -> torch.device | None:
    return None if value is None else torch.device(value)


class SyncCounter(TorchDispatchMode):
    """Records (what, op) for every host synchronization the code under it would make on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is aten.copy_:
            destination, source = args[0], args[1]
            if not kwargs.get("non_blocking", args[2] if len(args) > 2 else False):
                self._copy(source.device, destination.device, func)
        elif packet is aten._to_copy:
            target = _device(kwargs.get("device"))
            if target is not None and not kwargs.get("non_blocking", False):
                self._copy(args[0].device, target, func)
        elif packet is aten._local_scalar_dense:
            if args[0].device.type != "cpu":
                self.events.append(("read", str(func)))
                return True if args[0].dtype == torch.bool else 1
            if isinstance(args[0], FakeTensor):  # a host copy: free to read, but a fake one has no values
                return False if args[0].dtype == torch.bool else 0
        try:
            return func(*args, **kwargs)
        except DynamicOutputShapeException:
            self.events.append(("data-dependent shape", str(func)))
            raise

    def _copy(self, source: torch.device, destination: torch.device, func) -> None:
        if (source.type == "cpu") != (destination.type == "cpu"):
            self.events.append(("host-to-device copy" if source.type == "cpu" else "device-to-host copy", str(func)))

    def __len__(self) -> int:
        return len(self.events)


class _EventStandIn:
    """torch.cuda.Event without CUDA: recorded at once, always complete."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _batch_norm_update_stats_shape(input, running_mean, running_var, momentum):
    dtype = running_mean.dtype if running_mean is not None else input.dtype
    return input.new_empty(input.size(1), dtype=dtype), input.new_empty(input.size(1), dtype=dtype)


def _like_grad_output(grad_output, *args, **kwargs):
    return torch.empty_like(grad_output)


def _in_place_update(*args, **kwargs) -> None:
    """The fused optimizers' update: in place, nothing to return."""


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """A FakeTensorMode (to enter, as often as needed) in which `device="cuda"` tensors can be made and
    SyncBN runs. Build modules before entering it, then move them: a fake parameter cannot be swapped for
    another. normalize_batch's per-device constants are dropped before and after (a cached constant
    belongs to one mode's fake device)."""
    from syncseg.data import transforms

    library = torch.library.Library("aten", "IMPL")
    library.impl("batch_norm_update_stats", _batch_norm_update_stats_shape, "Meta")
    library.impl("batch_norm_backward_elemt", _like_grad_output, "Meta")
    library.impl("_fused_sgd_", _in_place_update, "Meta")
    library.impl("_fused_adamw_", _in_place_update, "Meta")
    event = torch.cuda.Event
    torch.cuda.Event = _EventStandIn
    transforms._normalization_constants.cache_clear()
    try:
        yield FakeTensorMode(allow_non_fake_inputs=True)
    finally:
        transforms._normalization_constants.cache_clear()
        torch.cuda.Event = event
        library._destroy()


@contextlib.contextmanager
def one_process_group(backend: str = "gloo") -> Iterator[None]:
    """A 1-process group (gloo, or nccl on a GPU) whose synchronized layers take the synchronized path (with
    one process they would be plain batch_norm): the all-reduces, the label and the fused backward of a
    multi-GPU run."""
    import torch.distributed as dist

    from syncseg.model.sync_batchnorm.batchnorm import _SynchronizedBatchNorm

    def group(layer):
        return dist.group.WORLD if layer.training else None

    original = _SynchronizedBatchNorm.__dict__["_distributed_group"]
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _SynchronizedBatchNorm._distributed_group = group
    try:
        yield
    finally:
        _SynchronizedBatchNorm._distributed_group = original
        dist.destroy_process_group()


@contextlib.contextmanager
def backward_in_this_thread() -> Iterator[None]:
    """`tensor.backward()` runs `backward(tensor)` (for code that calls it, such as Trainer.train_step)."""
    original = torch.Tensor.backward
    torch.Tensor.backward = lambda self, *args, **kwargs: backward(self)
    try:
        yield
    finally:
        torch.Tensor.backward = original


def step_batch(data_cfg, *, num_classes: int, image_size: int, batch_size: int, seed: int = 0) -> list:
    """One micro-batch as the training loader hands it over: integer images and uint8 masks, on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    maximum = int(data_cfg.max_value) + 1
    images = torch.randint(0, maximum, (batch_size, data_cfg.in_channels, image_size, image_size),
                           dtype=torch.uint8 if maximum <= 256 else torch.int32, generator=generator)
    masks = torch.randint(0, num_classes, (batch_size, image_size, image_size), dtype=torch.uint8, generator=generator)
    return [(images, masks)]


def step_harness(model, train_cfg, data_cfg, device: torch.device, *, precision: str = "off", ema=None) -> Any:
    """What `Trainer.train_step(harness, batch)` needs, for `model` already on `device`: the config's loss,
    optimizer, schedule and `ema`, a GradScaler for fp16, one process (no DDP: the synchronized layers
    reduce over whatever group they see)."""
    import types

    from syncseg.engine.loss import build_loss
    from syncseg.engine.optim import PolyWarmupLR, build_optimizer, build_param_groups

    groups = build_param_groups(model, lr=train_cfg.lr, head_lr_mult=train_cfg.head_lr_mult,
                                weight_decay=train_cfg.weight_decay)
    optimizer = build_optimizer(groups, train_cfg)
    parts = types.SimpleNamespace(
        criterion=build_loss(train_cfg, ignore_index=data_cfg.ignore_index).to(device), train_model=model,
        forward_model=model, precision=precision,
        scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"),
        scheduler=PolyWarmupLR(optimizer, total_iters=max(2, train_cfg.iters), power=train_cfg.poly_power,
                               warmup_iters=train_cfg.warmup_iters),
        ema=ema)
    return types.SimpleNamespace(parts=parts, config=types.SimpleNamespace(data=data_cfg), device=device,
                                 optimizer=optimizer, dist=types.SimpleNamespace(world_size=1), model=model)


def training_step_syncs(model_cfg, train_cfg, data_cfg, *, num_classes: int, image_size: int = 32,
                        batch_size: int = 2, synchronized: bool = True) -> tuple[list[tuple[str, str]], Any, Any]:
    """The host synchronizations of one `Trainer.train_step` on fake CUDA (the second: the first creates the
    optimizer state and normalize_batch's constants), with the model, loss, optimizer, schedule and EMA the
    config sections build. `synchronized`: through a 1-process group (a multi-GPU run's path), else the
    layers' one-process path. Returns (events, loss, model)."""
    from syncseg.engine.ema import ModelEMA
    from syncseg.engine.trainer import Trainer
    from syncseg.model.builder import build_model

    torch.manual_seed(0)
    model = build_model(model_cfg, num_classes, in_channels=data_cfg.in_channels)
    cuda = torch.device("cuda")
    batch = step_batch(data_cfg, num_classes=num_classes, image_size=image_size, batch_size=batch_size)
    ema = ModelEMA(model, train_cfg.ema_decay) if train_cfg.ema_decay > 0 else None  # copied before faking
    group = one_process_group() if synchronized else contextlib.nullcontext()
    with fake_cuda() as mode, group, backward_in_this_thread():
        with mode:
            model = model.to(cuda).train()
            if ema is not None:
                ema.module.to(cuda)
            harness = step_harness(model, train_cfg, data_cfg, cuda, ema=ema)
            Trainer.train_step(harness, batch)
            with SyncCounter() as counter:
                loss = Trainer.train_step(harness, batch)
    return counter.events, loss, model


def backward(loss: torch.Tensor) -> None:
    """loss.backward() run in this thread: each node once all the nodes that feed it have run."""
    order: list = []
    seen: set = set()
    stack = [(loss.grad_fn, False)]
    while stack:  # depth-first post-order without recursion (deep models)
        node, expanded = stack.pop()
        if node is None:
            continue
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in seen)
    gradients: dict = {loss.grad_fn: [torch.ones_like(loss)]}
    for node in reversed(order):
        incoming = gradients.pop(node, None)
        if incoming is None:
            continue
        if type(node).__name__ == "AccumulateGrad":
            variable = node.variable
            variable.grad = incoming[0] if variable.grad is None else variable.grad + incoming[0]
            continue
        with torch.no_grad():
            outputs = node.apply(*incoming) if hasattr(node, "apply") else node(*incoming)
        if outputs is None or isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        outputs = _tensor_inputs_only(tuple(outputs), len(node.next_functions))
        for (child, index), gradient in zip(node.next_functions, outputs):
            if child is None or gradient is None:
                continue
            slots = gradients.setdefault(child, [])
            slots.extend([None] * (index + 1 - len(slots)))
            slots[index] = gradient if slots[index] is None else slots[index] + gradient


def _tensor_inputs_only(outputs: tuple, num_edges: int) -> tuple:
    """A custom Function's backward returns one gradient per forward argument, its node has edges for the
    tensor ones only; torch's engine drops the others' (None) itself. Here: the non-tensor arguments must
    all come first or all last (as in the synchronized layer's Functions)."""
    extra = len(outputs) - num_edges
    if extra <= 0:
        return outputs
    if all(gradient is None for gradient in outputs[num_edges:]):
        return outputs[:num_edges]
    if all(gradient is None for gradient in outputs[:extra]):
        return outputs[extra:]
    raise AssertionError(f"cannot match {len(outputs)} gradients to {num_edges} graph edges")
