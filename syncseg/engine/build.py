"""build_training: every object a training run needs, built from a Config, handed to syncseg.engine.trainer.Trainer.

The parts live in their own modules: data order and loaders (syncseg.engine.samplers), the model
(syncseg.model.builder; `init_from_weights` here starts it from model.init_checkpoint) and its wrapper
(syncseg.engine.distributed), the loss (syncseg.engine.loss), parameter groups, optimizer and schedule
(syncseg.engine.optim), precision (syncseg.engine.devices). Nothing here runs a step; a test or a benchmark
may build the parts, replace one, and give them to a Trainer.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from syncseg.data import build_dataset, check_data_at_start
from syncseg.engine.accumulation import describe_batches
from syncseg.engine.checkpoint_file import load_weights_file
from syncseg.engine.config import Config
from syncseg.engine.devices import apply_fp32_precision, log_precision, resolve_channels_last
from syncseg.engine.distributed import DistInfo, assign_sync_groups, compile_for_training, wrap_for_training
from syncseg.engine.ema import ModelEMA
from syncseg.engine.object_store import local_data
from syncseg.engine.loss import SegmentationLoss, build_loss
from syncseg.engine.precise_bn import build_precise_bn_loader
from syncseg.engine.optim import PolyWarmupLR, build_optimizer, build_param_groups
from syncseg.engine.samplers import (ResumableBatchSampler, build_eval_loader, build_train_loader, check_batching,
                                     split_batch)
from syncseg.engine.seeding import mix_seed
from syncseg.model.builder import build_model
from syncseg.model.norm import synchronizes_statistics
from syncseg.model.weights import LoadedWeights, describe_architecture, load_segmentation_weights

logger = logging.getLogger(__name__)


@dataclass
class TrainingParts:
    """The built objects of one training process. `model` is the bare network (checkpoints, validation);
    `train_model` wraps it for gradient synchronization (DDP, DataParallelWithCallback, or the model
    itself); `forward_model` is `train_model`, compiled when train.compile. `precision` is what
    train.amp runs as on this device (off | tf32 | fp16 | bf16). `eval_model` is what validation runs: the
    averaged weights when train.ema_decay > 0, else `model`."""

    config: Config
    dist: DistInfo
    train_set: Any
    val_set: Any
    classes: tuple[str, ...]
    model: nn.Module
    train_model: nn.Module
    forward_model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: PolyWarmupLR
    scaler: torch.amp.GradScaler
    precision: str
    criterion: SegmentationLoss
    sampler: ResumableBatchSampler
    train_loader: DataLoader
    val_loader: DataLoader
    ema: ModelEMA | None = None  # train.ema_decay > 0: the averaged weights, for validation and best.pt
    precise_bn_loader: DataLoader | None = None  # train.precise_bn_batches > 0: syncseg.engine.precise_bn's batches

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def eval_model(self) -> nn.Module:
        return self.ema.module if self.ema is not None else self.model


def init_from_weights(model: nn.Module, path: str | Path, *, model_cfg: Any) -> LoadedWeights:
    """Fine-tuning: load `path` (see syncseg.engine.checkpoint_file.load_weights_file) into `model`, built from `model_cfg`, and log
    which keys were loaded, skipped (the classifier of another class count) and left fresh. Raises one
    ValueError naming the file and both architectures when the weights do not fit."""
    state_dict, kind = load_weights_file(path)
    try:
        report = load_segmentation_weights(model, state_dict)
    except ValueError as error:
        raise ValueError(f"model.init_checkpoint '{path}' ({kind}) does not fit the model "
                         f"[{describe_architecture(model_cfg)}]: {error}") from None
    logger.info("model.init_checkpoint '%s' (%s): %s", path, kind, report.summary())
    return report


def build_training(config: Config, dist_info: DistInfo, *, init_weights: bool = True) -> TrainingParts:
    """Datasets, model, wrapper, optimizer, schedule, scaler, loss, sampler and loaders for `config` on this
    process. `init_weights`: load model.init_checkpoint (a fresh run; a resumed one loads its checkpoint
    instead). The model initializes identically on every process. Raises ValueError / FileNotFoundError
    for data, weights or settings that cannot be used (before any step)."""
    train_cfg, data_cfg, device = config.train, local_data(config.data), dist_info.device  # a URL root: mirrored
    torch.manual_seed(mix_seed(train_cfg.seed, "init"))  # mix_seed: 63 bits
    # masks stay uint8 until the device (Trainer.train_step widens them; the confusion matrix counts them as
    # they are): less work per sample, 8x less to collate, share and transfer
    train_set = build_dataset(data_cfg, data_cfg.train_split, train=True, compact_masks=True)
    val_set = build_dataset(data_cfg, data_cfg.val_split, train=False, compact_masks=True)
    for dataset in {data_cfg.train_split: train_set, data_cfg.val_split: val_set}.values():
        check_data_at_start(dataset)  # a bounded sample of images and masks: a bad encoding fails now, not mid-run
    check_batching(val_set, config.eval.batch_size, key="eval.batch_size")  # fail now, not at validation
    classes = tuple(train_set.classes)
    precision = log_precision("train.amp", train_cfg.amp, device)
    apply_fp32_precision(precision, device)  # the backward runs outside autocast_for's TF32 setting
    log_precision("eval.amp", config.eval.amp, device)
    channels_last, why = resolve_channels_last(config.model.channels_last, train_cfg.amp, device, config.model.backbone)
    logger.info("model.channels_last=%s: %s (%s)", config.model.channels_last, "on" if channels_last else "off", why)
    model = build_model(config.model, len(classes), in_channels=data_cfg.in_channels, channels_last=channels_last)
    if config.model.init_checkpoint and init_weights:
        init_from_weights(model, config.model.init_checkpoint, model_cfg=config.model)
    model.to(device)
    assign_sync_groups(model, dist_info, group_size=config.model.syncbn_group_size, timeout_s=config.dist.timeout_s)
    train_model = wrap_for_training(model, dist_info)
    groups = build_param_groups(model, lr=train_cfg.lr, head_lr_mult=train_cfg.head_lr_mult,
                                weight_decay=train_cfg.weight_decay)
    optimizer = build_optimizer(groups, train_cfg)
    scheduler = PolyWarmupLR(optimizer, total_iters=train_cfg.iters, power=train_cfg.poly_power,
                             warmup_iters=train_cfg.warmup_iters)
    sampler = ResumableBatchSampler(len(train_set), global_batch=train_cfg.batch_size, seed=train_cfg.seed,
                                    rank=dist_info.rank, world_size=dist_info.world_size,
                                    accumulate=train_cfg.accumulate)
    pin = device.type == "cuda"
    parts = TrainingParts(
        config=config, dist=dist_info, train_set=train_set, val_set=val_set, classes=classes, model=model,
        train_model=train_model,
        forward_model=compile_for_training(train_model, dist_info, enabled=train_cfg.compile),
        optimizer=optimizer, scheduler=scheduler,
        scaler=torch.amp.GradScaler(device.type, enabled=precision == "fp16"), precision=precision,
        criterion=build_loss(train_cfg, ignore_index=data_cfg.ignore_index).to(device), sampler=sampler,
        train_loader=build_train_loader(train_set, sampler, num_workers=data_cfg.num_workers, pin_memory=pin,
                                        seed=train_cfg.seed, num_classes=len(classes),
                                        ignore_index=data_cfg.ignore_index),
        val_loader=build_eval_loader(val_set, batch_size=config.eval.batch_size,
                                     num_workers=min(data_cfg.num_workers, 2), pin_memory=pin,
                                     rank=dist_info.rank, world_size=dist_info.world_size, seed=train_cfg.seed),
        ema=ModelEMA(model, train_cfg.ema_decay) if train_cfg.ema_decay > 0 else None,
        precise_bn_loader=build_precise_bn_loader(  # micro-batches of training's size (what BN sees)
            train_set, num_batches=train_cfg.precise_bn_batches,
            batch_size=max(split_batch(train_cfg.batch_size, train_cfg.accumulate)), rank=dist_info.rank,
            world_size=dist_info.world_size, seed=train_cfg.seed) if train_cfg.precise_bn_batches > 0 else None,
    )
    describe(parts)
    return parts


def describe(parts: TrainingParts) -> None:
    """Log the topology, the batch split and the data sizes."""
    config, dist_info = parts.config, parts.dist
    sync = dist_info.describe_batch_norm(synchronized=synchronizes_statistics(config.model.norm))
    batches = describe_batches(config.train.batch_size, accumulate=parts.sampler.accumulate,
                               num_replicas=dist_info.num_replicas, batch_norm=sync)
    logger.info("%s; %s", dist_info.describe(), batches)
    logger.info("%d training / %d validation images, %d classes, %d batches per epoch; run dir %s",
                len(parts.train_set), len(parts.val_set), len(parts.classes), parts.sampler.batches_per_epoch,
                config.run_dir)
