"""evaluate(): the one evaluation loop, used by train.py's validation and by eval.py.

The loader yields (uint8 images N x 3 x H x W, int64 masks N x H x W); images are normalized on the
device with data.transforms.normalize_batch, predicted with engine.inference.predict, and counted in
one ConfusionMatrix on the device. Under torch.distributed each process evaluates a disjoint shard
(`ShardSampler`, which never pads, unlike torch's DistributedSampler) and the matrices are summed,
so every image is counted exactly once.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from data.transforms import normalize_batch
from engine.distributed import all_reduce_sum, get_rank, get_world_size
from engine.inference import predict
from engine.metrics import ConfusionMatrix

logger = logging.getLogger(__name__)

AMP_DTYPES = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class ShardSampler(Sampler[int]):
    """Indices rank, rank + world_size, ... of range(num_samples), in order, without padding.

    Shards are disjoint and together cover every index once; their lengths differ by at most one.
    rank / world_size default to torch.distributed's (0 / 1 when it is not initialized).
    """

    def __init__(self, num_samples: int, *, rank: int | None = None, world_size: int | None = None):
        self.rank = get_rank() if rank is None else rank
        self.world_size = get_world_size() if world_size is None else world_size
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"ShardSampler: rank={self.rank} must lie in [0, world_size={self.world_size})")
        self.num_samples = num_samples

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_samples, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))


def build_eval_loader(
    dataset: Dataset, *, batch_size: int = 1, num_workers: int = 0, pin_memory: bool = False,
    rank: int | None = None, world_size: int | None = None,
) -> DataLoader:
    """A DataLoader over this process's ShardSampler shard, in dataset order, no shuffling or padding.

    batch_size > 1 needs images of one size (the default collate stacks them).
    """
    sampler = ShardSampler(len(dataset), rank=rank, world_size=world_size)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, drop_last=False, persistent_workers=False)


def autocast_for(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """The autocast context for `amp` (off | fp16 | bf16) on `device`; training uses it too."""
    if amp not in AMP_DTYPES:
        raise ValueError(f"evaluate: amp={amp!r} is not one of {', '.join(AMP_DTYPES)}")
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def evaluate(
    model: nn.Module,
    loader: DataLoader,
    *,
    num_classes: int,
    device: torch.device | str,
    mean: Sequence[float],
    std: Sequence[float],
    eval_cfg: Any,
    ignore_index: int = 255,
    classes: Sequence[str] | None = None,
    progress: bool = True,
    amp: str = "off",
    on_batch: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> dict[str, Any]:
    """Evaluate `model` on `loader`; returns ConfusionMatrix.compute()'s dict plus num_images.

    `eval_cfg` supplies mode, crop_size, stride, scales and flip (an engine.config.EvalConfig).
    The model is put in eval mode and restored to its previous mode afterwards; a
    DistributedDataParallel wrapper is bypassed (its forward would synchronize buffers across
    processes that see different numbers of images). Under torch.distributed every process must
    call evaluate (the matrix and the image count are all-reduced). `classes` adds a "classes" entry
    naming the per-class lists. `on_batch(batch_index, predictions N x H x W int64 on the CPU,
    masks)` is called for every batch on every process (e.g. to save predictions).
    """
    device = torch.device(device)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if classes is not None and len(classes) != num_classes:
        raise ValueError(f"evaluate: {len(classes)} class names given for num_classes={num_classes}")
    mode = eval_cfg.mode
    crop_size = int(eval_cfg.crop_size)
    stride = int(eval_cfg.stride)
    scales = tuple(eval_cfg.scales)
    flip = bool(eval_cfg.flip)
    rank = get_rank()
    matrix = ConfusionMatrix(num_classes, ignore_index=ignore_index, device=device)
    num_images = torch.zeros((), dtype=torch.int64, device=device)
    was_training = model.training
    model.eval()
    batches = loader
    if progress and rank == 0 and sys.stderr.isatty():  # a progress bar only where it redraws in place
        from tqdm import tqdm

        batches = tqdm(loader, desc="eval", total=len(loader), dynamic_ncols=True, leave=False)
    try:
        with torch.inference_mode():
            for batch_index, (images, masks) in enumerate(batches):
                images = images.to(device, non_blocking=True)
                masks = masks.to(device, non_blocking=True)
                inputs = normalize_batch(images, mean, std)
                with autocast_for(device, amp):
                    logits = predict(model, inputs, num_classes=num_classes, mode=mode, crop_size=crop_size,
                                     stride=stride, scales=scales, flip=flip)
                if logits.shape[-2:] != masks.shape[-2:]:  # an image resized by the pipeline, not its mask
                    logits = F.interpolate(logits.float(), size=masks.shape[-2:], mode="bilinear",
                                           align_corners=False)
                predictions = logits.argmax(dim=1)
                matrix.update(predictions, masks)
                num_images += images.shape[0]
                if on_batch is not None:
                    on_batch(batch_index, predictions.cpu(), masks.cpu())
    finally:
        model.train(was_training)
    matrix.all_reduce()
    all_reduce_sum(num_images)
    results = matrix.compute()
    results["num_images"] = int(num_images)
    if classes is not None:
        results["classes"] = list(classes)
    return results
