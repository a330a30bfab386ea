"""PreciseBN (train.precise_bn_batches): BatchNorm running statistics recomputed as population statistics.

Running statistics are a momentum average of per-batch statistics, taken while the weights moved; with
gradient accumulation they are per micro-batch. Before each validation (and at the end) this recomputes
them over a fixed set of training micro-batches with the current weights: every BatchNorm layer's mean
and variance over all the pixels of those batches, exactly (not a momentum or batch-mean average).

How: each micro-batch goes through the training wrapper in train mode without gradients, so synchronized
layers see the statistics of the whole (global) micro-batch, as in training; with momentum 1 a layer's
running buffers then hold that batch's mean and unbiased variance, which are combined, weighted by the
batch's element count (global images x the layer's spatial size), into the population mean and unbiased
variance. The batches come from a loader of their own (the first images of a permutation seeded by
train.seed) in the main process with the global RNG state restored, so the training stream, its
augmentations and its losses are exactly those of a run without PreciseBN.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader

from syncseg.data.transforms import normalize_batch
from syncseg.engine.devices import autocast_for
from syncseg.engine.distributed import all_reduce_sum, is_dist
from syncseg.engine.seeding import SeededDataset, mix_seed
from syncseg.engine.signals import Stopped, until_stop

logger = logging.getLogger(__name__)


def build_precise_bn_loader(dataset: Any, *, num_batches: int, batch_size: int, rank: int, world_size: int,
                            seed: int) -> DataLoader:
    """`num_batches` micro-batches of `batch_size` images (global) from `dataset` (augmented as in training),
    this process's share of each, the same on every call: a permutation seeded by `seed`."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(mix_seed(seed, "precise_bn")))
    keys = [(int(index), mix_seed(seed, "precise_bn", int(index)) % 2**31) for index in order.tolist()]
    batches = []
    for number in range(num_batches):
        chunk = [keys[(number * batch_size + offset) % len(keys)] for offset in range(batch_size)]
        batches.append(chunk[rank::world_size])
    return DataLoader(SeededDataset(dataset), batch_sampler=batches, num_workers=0)


@torch.no_grad()
def recompute_batch_norm_statistics(model: nn.Module, train_model: nn.Module, loader: DataLoader, *,
                                    data_cfg: Any, precision: str, device: torch.device,
                                    should_stop: Callable[[], bool] | None = None) -> int | None:
    """Set the running statistics of every BatchNorm layer of `model` (frozen ones have none) to the
    population statistics of the batches of `loader`, run through `train_model` (the wrapper of `model`
    that training uses). Returns the number of layers updated. Every process must call it (collectives).

    `should_stop()` is asked before every batch (syncseg.engine.signals.StopRequest.agreed: every process
    asks equally often); when it says to stop, every layer keeps the statistics it had and None is returned."""
    layers = [module for module in model.modules()
              if isinstance(module, _BatchNorm) and module.track_running_stats and module.running_mean is not None]
    if not layers:
        return 0
    saved = [(layer.momentum, layer.running_mean.clone(), layer.running_var.clone(), layer.num_batches_tracked.clone())
             for layer in layers]
    sizes: dict[nn.Module, int] = {}
    # elements per image and channel (H x W); keyed by the layer itself, since DataParallel calls the hook
    # on replicas
    hooks = [layer.register_forward_pre_hook(
        lambda module, args, layer=layer: sizes.__setitem__(layer, args[0].numel() // max(1, args[0].shape[0] * args[0].shape[1])))
        for layer in layers]
    sums = [(torch.zeros_like(layer.running_mean, dtype=torch.float64),
             torch.zeros_like(layer.running_var, dtype=torch.float64)) for layer in layers]
    count = [0] * len(layers)
    was_training = model.training
    model.train()
    try:
        for layer in layers:
            layer.momentum = 1.0  # running buffers := this batch's (synchronized) mean and unbiased variance
        for images, _ in until_stop(loader, should_stop):
            # the global image count on the host (a CPU all-reduce: gloo), never read back from the device
            counts = torch.tensor([images.shape[0]], dtype=torch.int64)
            if is_dist():
                all_reduce_sum(counts)
            global_images = int(counts[0])
            images = images.to(device, non_blocking=True)
            with autocast_for(device, precision):
                train_model(normalize_batch(images, data_cfg.mean, data_cfg.std, max_value=data_cfg.max_value))
            for index, layer in enumerate(layers):
                elements = global_images * sizes[layer]
                mean, var = layer.running_mean.double(), layer.running_var.double()
                sums[index][0].add_(mean * elements)
                sums[index][1].add_(var * (elements - 1) + mean * mean * elements)
                count[index] += elements
    except BaseException as error:
        for layer, (momentum, mean, var, tracked) in zip(layers, saved):
            layer.running_mean.copy_(mean), layer.running_var.copy_(var), layer.num_batches_tracked.copy_(tracked)
        if isinstance(error, Stopped):
            return None
        raise
    finally:
        for hook in hooks:
            hook.remove()
        for layer, (momentum, _, _, _) in zip(layers, saved):
            layer.momentum = momentum
        model.train(was_training)
    for layer, (first, second), total, (_, _, _, tracked) in zip(layers, sums, count, saved):
        mean = first / total
        layer.running_mean.copy_(mean)
        layer.running_var.copy_((second - total * mean * mean) / max(1, total - 1))
        layer.num_batches_tracked.copy_(tracked)  # training's counter, as if nothing had run
    return len(layers)


def precise_batch_norms(parts: Any, *, should_stop: Callable[[], bool] | None = None) -> bool:
    """PreciseBN for the model validation uses (syncseg.engine.build.TrainingParts.eval_model): through the training
    wrapper, or, with train.ema_decay, the averaged copy itself (its synchronized layers still reduce over
    torch.distributed processes, but not over --gpus replicas). False when `should_stop()` (asked before
    every batch, as recompute_batch_norm_statistics does) ended it, the statistics unchanged."""
    wrapper = parts.train_model if parts.ema is None else parts.ema.module
    count = recompute_batch_norm_statistics(parts.eval_model, wrapper, parts.precise_bn_loader,
                                            data_cfg=parts.config.data, precision=parts.precision,
                                            device=parts.device, should_stop=should_stop)
    if count is None:
        logger.info("PreciseBN stopped by a stop request; BatchNorm statistics left as they were")
        return False
    logger.info("BatchNorm statistics of %d layers recomputed over %d batches (PreciseBN)", count,
                len(parts.precise_bn_loader))
    return True
