"""evaluate(): the one evaluation loop, used by train.py's validation and by eval.py; validate_during_training():
a training run's validation with its logging.

Its loader (syncseg.engine.samplers.build_eval_loader) yields (images N x C x H x W, uint8 or uint16, masks
N x H x W: uint8 from the trainer's and eval.py's datasets where the labels fit, int64 otherwise); images are
normalized on the device and predicted by syncseg.engine.inference.predict_batch (as eval.py, predict.py and
the grid do), counted in one ConfusionMatrix on the device. Under torch.distributed each process evaluates a
disjoint shard (syncseg.engine.samplers.ShardSampler, which never pads, unlike torch's DistributedSampler) and
the matrices are summed, so every image is counted exactly once.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from syncseg.engine.confusion import ConfusionMatrix
from syncseg.engine.devices import cudnn_autotuning
from syncseg.engine.distributed import all_reduce_sum, get_rank
from syncseg.engine.inference import predict_batch
from syncseg.engine.signals import Stopped, until_stop
from syncseg.engine.visualize import prediction_grid

if TYPE_CHECKING:
    from syncseg.engine.build import TrainingParts
    from syncseg.engine.reporting import MetricsLog
    from syncseg.engine.signals import StopRequest

logger = logging.getLogger(__name__)


def evaluate(
    model: nn.Module,
    loader: DataLoader,
    *,
    num_classes: int,
    device: torch.device | str,
    data_cfg: Any,
    eval_cfg: Any,
    classes: Sequence[str] | None = None,
    progress: bool = True,
    on_batch: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, Any] | None:
    """Evaluate `model` on `loader`; returns ConfusionMatrix.compute()'s dict plus num_images, or None when
    `should_stop` ended it early.

    Each batch is predicted by syncseg.engine.inference.predict_batch with `data_cfg` (mean, std) and `eval_cfg`
    (mode, window, stride, scales, flip, amp) and counted with data_cfg.ignore_index skipped.
    The model is put in eval mode and restored to its previous mode afterwards; a
    DistributedDataParallel wrapper is bypassed (its forward would synchronize buffers across
    processes that see different numbers of images). Under torch.distributed every process must
    call evaluate (the matrix and the image count are all-reduced). `classes` adds a "classes" entry
    naming the per-class lists. `on_batch(batch_index, predictions N x H x W int64 on the CPU,
    masks as the loader gave them, on the CPU)` is called for every batch on every process (e.g. to save
    predictions). `should_stop()` is asked before every batch (a stop request agreed by every process,
    syncseg.engine.signals): every process asks it equally often, a shorter shard after its last batch too,
    and all end at the same batch.

    Where the process autotunes cuDNN (training on CUDA), a batch is autotuned only when its size came
    before in this pass: whole images of VOC or ADE20K come in many sizes, most seen once, and timing every
    algorithm for a size used once costs more than that one call can save; one-size validation sets are
    autotuned from their second batch. The process's setting is restored for training.
    """
    device = torch.device(device)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    if classes is not None and len(classes) != num_classes:
        raise ValueError(f"evaluate: {len(classes)} class names given for num_classes={num_classes}")
    rank = get_rank()
    matrix = ConfusionMatrix(num_classes, ignore_index=data_cfg.ignore_index, device=device)
    num_images = torch.zeros((), dtype=torch.int64, device=device)
    was_training = model.training
    model.eval()
    autotune, seen_sizes = torch.backends.cudnn.benchmark, set()
    batches = loader
    redirect = contextlib.nullcontext()
    if progress and rank == 0 and sys.stderr.isatty():  # a progress bar only where it redraws in place
        batches = tqdm(loader, desc="eval", total=len(loader), dynamic_ncols=True, leave=False)
        redirect = logging_redirect_tqdm()  # log lines above the bar, not written into it
    try:
        with torch.inference_mode(), redirect:
            for batch_index, (images, masks) in enumerate(until_stop(batches, should_stop)):
                images = images.to(device, non_blocking=True)
                masks = masks.to(device, non_blocking=True)
                size = tuple(images.shape)
                with cudnn_autotuning(autotune and size in seen_sizes):
                    # an image resized by the pipeline, not its mask: the logits come back at the mask's size
                    logits = predict_batch(model, images, num_classes=num_classes, data_cfg=data_cfg,
                                           eval_cfg=eval_cfg, output_size=tuple(masks.shape[-2:]))
                seen_sizes.add(size)
                predictions = logits.argmax(dim=1)
                matrix.update(predictions, masks)
                num_images += images.shape[0]
                if on_batch is not None:
                    on_batch(batch_index, predictions.cpu(), masks.cpu())
    except Stopped:
        return None
    finally:
        model.train(was_training)
    matrix.all_reduce()
    all_reduce_sum(num_images)
    results = matrix.compute()
    results["num_images"] = int(num_images)
    if classes is not None:
        results["classes"] = list(classes)
    return results


def validate_during_training(parts: "TrainingParts", *, log: "MetricsLog", iteration: int, vis_indices: Sequence[int],
                             stop: "StopRequest | None" = None) -> dict[str, Any] | None:
    """A training run's validation at `iteration`: evaluate() on this process's validation shard (the same code path
    as eval.py) and rank 0's TensorBoard grid of `vis_indices`, then logged (metrics.jsonl, TensorBoard, one log
    line); the averaged weights when train.ema_decay > 0 (parts.eval_model). None, with nothing logged, when
    `stop` ended it: agreed before every validation batch and once after the grid, which rank 0 draws alone
    (asking only its own flag between images, since the other processes are not drawing)."""
    classes, model, config = parts.classes, parts.eval_model, parts.config
    should_stop = None if stop is None else stop.agreed
    metrics = evaluate(model, parts.val_loader, num_classes=len(classes), device=parts.device,
                       data_cfg=config.data, eval_cfg=config.eval, classes=classes, progress=False,
                       should_stop=should_stop)
    grid = None
    if metrics is not None and parts.dist.is_main and vis_indices:
        grid = prediction_grid(model, parts.val_set, list(vis_indices), device=parts.device, data_cfg=config.data,
                               eval_cfg=config.eval, should_stop=None if stop is None else lambda: stop.requested)
    if metrics is None or (should_stop is not None and should_stop()):
        return None
    if parts.dist.is_main:
        log.validation(metrics, classes=classes, step=iteration)
        if grid is not None:
            log.image("val/image_truth_prediction", grid, step=iteration)
        logger.info("iteration %d: val mIoU %.4f, pixel acc %.4f (%d images)", iteration,
                    metrics["miou"], metrics["pixel_acc"], metrics["num_images"])
    return metrics
