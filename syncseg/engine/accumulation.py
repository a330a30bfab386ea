"""Gradient accumulation: one optimizer step over `train.accumulate` micro-batches.

train.batch_size stays the global batch of one optimizer step; syncseg.engine.samplers cuts it into
`train.accumulate` micro-batches (each split over the processes), so the step sees the same samples
as without accumulation, and the LR schedule, checkpoints and resume all count optimizer steps.
What makes the accumulated gradient the global batch's gradient:

- the loss of every micro-batch is divided by the weight (valid pixels, class-weighted; for Dice and
  Lovasz the images with a valid pixel) of the whole step over every process (`step_normalizer`: one
  all-reduce per step), so the micro-batch losses add up to the global batch's loss;
- under DDP the gradient all-reduce runs once per step, in the backward of the last micro-batch
  (`gradient_sync`: DDP's `no_sync` for the others), and sums what every micro-batch accumulated.

BatchNorm statistics are those of each micro-batch (synchronized across devices and processes, as
without accumulation), so training-mode BatchNorm is the one thing that differs from the unsplit batch.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import ContextManager

import torch
from torch import nn

from syncseg.engine.distributed import all_reduce_sum
from syncseg.engine.loss import SegmentationLoss
from syncseg.engine.samplers import split_batch


def gradient_sync(model: nn.Module, *, last: bool) -> ContextManager:
    """The context for one micro-batch's forward and backward: DDP's `no_sync()` unless it is the step's
    `last` micro-batch (then the usual gradient all-reduce); nothing for other models."""
    if not last and isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def step_normalizer(criterion: SegmentationLoss, masks: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The all-reduced target weights (one per normalizer of the loss: valid pixel weight, images) of all
    micro-batches of a step (`masks`, this process's), for SegmentationLoss(step_weight=...); None for a
    single micro-batch, whose loss normalizes itself."""
    if len(masks) == 1:
        return None
    total = torch.stack([criterion.target_weight(mask) for mask in masks]).sum(dim=0)
    all_reduce_sum(total)
    return total


def per_device_batch(global_batch: int, *, accumulate: int, num_replicas: int) -> str:
    """The devices' shares of a (micro-)batch, for the log: "4" when even, "3,3,2" per device when uneven,
    the distinct sizes ("2,1") when accumulating unevenly."""
    micro = split_batch(global_batch, accumulate)
    shares = [share for size in micro for share in split_batch(size, num_replicas)]
    if len(set(shares)) == 1:
        return f"{shares[0]}"
    if accumulate == 1:
        return ",".join(map(str, shares[:num_replicas]))
    return ",".join(map(str, sorted(set(shares), reverse=True)))


def describe_batches(global_batch: int, *, accumulate: int, num_replicas: int, batch_norm: str) -> str:
    """For the log: `global batch 16, per-device batch 4; BN statistics <batch_norm>`, with the
    micro-batches (and BN statistics "per micro-batch") when accumulating."""
    per_device = per_device_batch(global_batch, accumulate=accumulate, num_replicas=num_replicas)
    if accumulate == 1:
        return f"global batch {global_batch}, per-device batch {per_device}; BN statistics {batch_norm}"
    micro = split_batch(global_batch, accumulate)
    sizes = f"{micro[0]}" if len(set(micro)) == 1 else ",".join(map(str, micro))
    return (f"global batch {global_batch} in {accumulate} accumulated micro-batches of {sizes}, per-device "
            f"batch {per_device}; BN statistics per micro-batch, {batch_norm}")


def describe_world_change(saved_world_size: int, world_size: int, *, global_batch: int, accumulate: int,
                          num_replicas: int, global_statistics: bool) -> str:
    """For the log of a resume by another number of processes than saved the checkpoint: what changes (the
    per-device batch, the processes' random streams) and what does not (the global batches, their order and
    augmentation; with `global_statistics`, BatchNorm synchronized over every device, the statistics)."""
    now = per_device_batch(global_batch, accumulate=accumulate, num_replicas=num_replicas)
    was = per_device_batch(global_batch, accumulate=accumulate, num_replicas=saved_world_size)
    statistics = ("BN statistics still those of the whole (micro-)batch" if global_statistics else
                  "BN statistics per device or sync group, now of other samples, so the steps differ from an "
                  "unchanged world size's")
    return (f"resumed from world size {saved_world_size} at world size {world_size}: per-device batch {now} (was "
            f"{was}), global batch {global_batch} unchanged; data order unchanged (the same global order of samples "
            f"and per-sample augmentation seeds); {statistics}; each process's random streams (dropout) reseeded "
            "from (train.seed, rank, iteration)")
