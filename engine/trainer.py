"""Trainer: builds the training parts from a Config and runs the loop.

`Trainer(config, dist_info).fit()` trains `config.train.iters` optimizer steps. The parts live in
their own modules: data order and loaders (engine.samplers), randomness (engine.seeding), the loss
(engine.loss), optimizer and schedule (engine.optim), logging (engine.reporting), stop requests
(engine.signals), checkpoints (engine.checkpoint) and validation (engine.evaluate). A run stopped at
iteration K and resumed computes the same losses as an uninterrupted run: the checkpoint holds the
model, optimizer, scheduler, scaler, iteration and every process's RNG state, and the data order is
a function of (train.seed, epoch).
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from data import build_dataset
from data.transforms import normalize_batch
from engine.accumulation import describe_batches, gradient_sync, step_normalizer
from engine.checkpoint import (
    FORMAT_VERSION,
    RESUME_KEYS,
    first_non_finite,
    init_from_weights,
    load_model_weights,
    save_checkpoint,
    weights_payload,
)
from engine.config import Config
from engine.config import from_dict, save_config, to_dict
from engine.distributed import DistInfo, all_reduce_sum, barrier, compile_for_training, is_dist, wrap_for_training
from engine.evaluate import build_eval_loader, check_batching, evaluate
from engine.loss import build_loss
from engine.optim import PolyWarmupLR, build_optimizer, build_param_groups
from engine.devices import autocast_for, log_precision
from engine.reporting import MetricsLog, Throughput, peak_memory_mb, progress_bar, progress_line
from engine.samplers import (
    ResumableBatchSampler,
    build_train_loader,
    shutdown_workers,
    train_batches,
)
from engine.seeding import capture_rng_state, mix_seed, restore_rng_state, seed_process
from engine.signals import StopRequest
from engine.visualize import prediction_grid
from model.builder import build_model
from model.norm import synchronizes_statistics

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What `Trainer.fit` returns: per-step losses (iteration -> global mean loss of that step), the
    last validation metrics, the best mIoU, why the loop ended ("finished", "stopped", "signal") and
    the seconds spent training (the loop without its validations and checkpoints)."""

    losses: dict[int, float] = field(default_factory=dict)
    last_val: dict[str, Any] | None = None
    best_miou: float = -1.0
    iteration: int = 0
    reason: str = "finished"
    signal: int | None = None  # the signal that stopped the run (reason "signal")
    train_seconds: float = 0.0


class Trainer:
    """Builds everything from a Config and trains. Only rank 0 writes files.

    `resume`: a checkpoint payload (engine.checkpoint.load_checkpoint with RESUME_KEYS) to continue
    from, or None; `run_id` and `overrides` (engine.run_plan.RunPlan) are saved in every checkpoint.
    `stop_at`: stop (saving last.pt, as on a signal) at this iteration; None = train.iters. `fit` may be
    called again with a later `stop_at`: it continues the same data stream.
    """

    def __init__(self, config: Config, dist_info: DistInfo, *, resume: Mapping[str, Any] | None = None,
                 run_id: str = "", overrides: Mapping[str, str] | None = None, stop_at: int | None = None,
                 progress: bool | None = None) -> None:
        self.config, self.dist, self.device = config, dist_info, dist_info.device
        self.is_main = dist_info.is_main
        self.run_id = run_id or (resume or {}).get("run_id", "")
        self.overrides = dict(overrides or {})  # saved with the run: a resume checks its --config against them
        self.stop_at = stop_at
        self.progress = (sys.stderr.isatty() if progress is None else progress) and self.is_main
        self.run_dir = config.run_dir
        train_cfg, data_cfg = config.train, config.data
        self.ignore_index = data_cfg.ignore_index
        # The model initializes identically on every process; each then gets its own stream (dropout).
        torch.manual_seed(mix_seed(train_cfg.seed, "init") % 2**63)
        self.train_set = build_dataset(data_cfg, data_cfg.train_split, train=True)
        self.val_set = build_dataset(data_cfg, data_cfg.val_split, train=False)
        check_batching(self.val_set, config.eval.batch_size, key="eval.batch_size")  # fail now, not at validation
        self.classes = tuple(self.train_set.classes)
        self.num_classes = len(self.classes)
        self.model = self._build_model(init_weights=resume is None)  # unwrapped: checkpoints, validation
        self.train_model = wrap_for_training(self.model, dist_info)  # DDP / DataParallelWithCallback / as is
        self.forward_model = compile_for_training(self.train_model, dist_info, enabled=train_cfg.compile)
        groups = build_param_groups(self.model, lr=train_cfg.lr, head_lr_mult=train_cfg.head_lr_mult,
                                    weight_decay=train_cfg.weight_decay)
        self.group_names = [group["name"] for group in groups]
        self.optimizer = build_optimizer(groups, train_cfg)
        self.scheduler = PolyWarmupLR(self.optimizer, total_iters=train_cfg.iters, power=train_cfg.poly_power,
                                      warmup_iters=train_cfg.warmup_iters)
        self.precision = log_precision("train.amp", train_cfg.amp, self.device)  # off | fp16 | bf16: what runs
        log_precision("eval.amp", config.eval.amp, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")
        self.criterion = build_loss(train_cfg, ignore_index=self.ignore_index).to(self.device)
        self.iteration, self.best_miou, self.best_metrics = 0, -1.0, None  # best_metrics: best.pt's validation
        if resume is not None:
            self._load_training_state(resume)
        self.sampler = ResumableBatchSampler(len(self.train_set), global_batch=train_cfg.batch_size,
                                             seed=train_cfg.seed, rank=dist_info.rank, world_size=dist_info.world_size,
                                             accumulate=train_cfg.accumulate)
        pin = self.device.type == "cuda"
        self.train_loader = build_train_loader(self.train_set, self.sampler, num_workers=data_cfg.num_workers,
                                               pin_memory=pin, seed=train_cfg.seed)
        self.val_loader = build_eval_loader(self.val_set, batch_size=config.eval.batch_size,
                                            num_workers=min(data_cfg.num_workers, 2), pin_memory=pin,
                                            rank=dist_info.rank, world_size=dist_info.world_size,
                                            seed=train_cfg.seed)
        self.batches = train_batches(self.train_loader, self.iteration)
        self._pending_losses: list[tuple[int, torch.Tensor]] = []  # (iteration, loss) not yet read back
        self.vis_indices = list(range(min(train_cfg.num_vis_images, len(self.val_set))))
        if resume is not None:
            self._restore_rng(resume["rng"])
        else:
            seed_process(train_cfg.seed, dist_info.rank)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, self.run_dir / "config.yaml")
        self.log = MetricsLog(self.run_dir, enabled=self.is_main,
                              resume_iteration=self.iteration if resume is not None else None)
        self._describe()

    # ------------------------------------------------------------------------------------- setup
    def _build_model(self, *, init_weights: bool) -> nn.Module:
        model = build_model(self.config.model, self.num_classes)
        if self.config.model.init_checkpoint and init_weights:
            init_from_weights(model, self.config.model.init_checkpoint, model_cfg=self.config.model)
        model.to(self.device)
        if self.config.model.channels_last:
            model.to(memory_format=torch.channels_last)
        return model

    def _load_training_state(self, resume: Mapping[str, Any]) -> None:
        missing = [key for key in RESUME_KEYS if key not in resume]
        if missing:
            raise ValueError(f"cannot resume: the checkpoint lacks {', '.join(missing)} (a last.pt from train.py "
                             "has them)")
        load_model_weights(self.model, resume["model"], checkpoint=resume.get("path", "resumed"),
                           saved_model_cfg=from_dict(resume["config"]).model, model_cfg=self.config.model)
        configured = [(group["initial_lr"], group["weight_decay"]) for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(resume["optimizer"])
        # the (possibly overridden) config decides the base LR and weight decay from here on
        for group, (initial_lr, weight_decay) in zip(self.optimizer.param_groups, configured):
            group["initial_lr"], group["weight_decay"] = initial_lr, weight_decay
        self.scheduler.load_state_dict(resume["scheduler"])
        if resume["scaler"]:
            self.scaler.load_state_dict(resume["scaler"])
        self.iteration = int(resume["iteration"])
        self.best_miou = float(resume["best_miou"])

    def _restore_rng(self, rng: Mapping[str, Any]) -> None:
        states = rng.get("per_rank") or []
        if len(states) == self.dist.world_size:
            restore_rng_state(states[self.dist.rank])
        else:
            logger.warning("checkpoint RNG states are for %d process(es), this run has %d: reseeding",
                           len(states), self.dist.world_size)
            torch.manual_seed(mix_seed(self.config.train.seed, "train", self.dist.rank, self.iteration))

    def _describe(self) -> None:
        sync = self.dist.describe_batch_norm(synchronized=synchronizes_statistics(self.config.model.norm))
        batches = describe_batches(self.config.train.batch_size, accumulate=self.config.train.accumulate,
                                   num_replicas=self.dist.num_replicas, batch_norm=sync)
        logger.info("%s; %s", self.dist.describe(), batches)
        logger.info("%d training / %d validation images, %d classes, %d batches per epoch; run dir %s",
                    len(self.train_set), len(self.val_set), self.num_classes, self.sampler.batches_per_epoch,
                    self.run_dir)

    # ---------------------------------------------------------------------------------- the loop
    def fit(self, *, stop_at: int | None = None) -> TrainResult:
        """Train up to `stop_at` (default: the constructor's, else train.iters). last.pt is written every
        train.ckpt_interval, at the stop iteration and on a signal (before any validation of the same
        iteration, so a failing validation cannot cost the work); best.pt at each better validation."""
        total = self.config.train.iters
        stop_at = min(total, next((s for s in (stop_at, self.stop_at) if s is not None), total))
        result = TrainResult(best_miou=self.best_miou, iteration=self.iteration)
        logger.info("training from iteration %d to %d", self.iteration, stop_at)
        self.model.train()
        throughput, loop_start, periodic_seconds = Throughput(self.iteration), time.perf_counter(), 0.0
        with StopRequest(self.device) as stop, progress_bar(enabled=self.progress, total=stop_at,
                                                            initial=self.iteration) as bar, self._flushing_log():
            while self.iteration < stop_at:
                wait_start = time.perf_counter()
                micro_batches = [next(self.batches) for _ in range(self.config.train.accumulate)]
                throughput.add(images=self.config.train.batch_size, data_seconds=time.perf_counter() - wait_start)
                self._pending_losses.append((self.iteration + 1, self.train_step(micro_batches)))
                self.iteration += 1
                stopped = stop.agreed() and self.iteration < stop_at
                validate, checkpoint, log = self._due(stop_at)
                if validate or checkpoint or log or stopped:
                    self._record_losses(result)  # raises on a non-finite loss, before anything is saved
                if self.iteration % self.config.train.log_interval == 0:
                    self._log_training(result, throughput, stop_at, bar)
                if bar is not None:
                    bar.update(1)
                periodic_start = time.perf_counter()
                if checkpoint or stopped:
                    with stop.deferring_interrupts():
                        self.save(["last.pt"])
                if validate and not stopped and self._validate_is_best(result):
                    with stop.deferring_interrupts():
                        self.save(["best.pt"])
                periodic_seconds += time.perf_counter() - periodic_start
                if stopped:
                    result.reason, result.signal = "signal", stop.received
                    logger.warning("stopped by signal at iteration %d; last.pt saved", self.iteration)
                    break
        result.train_seconds = time.perf_counter() - loop_start - periodic_seconds
        if result.reason != "signal" and self.iteration < total:
            result.reason = "stopped"
        result.iteration, result.best_miou = self.iteration, self.best_miou
        return result

    @contextlib.contextmanager
    def _flushing_log(self) -> Iterator[None]:
        """Flush the TensorBoard events when the loop ends; after an error, without letting a failed
        flush (the same full disk, say) replace the error that ended it."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(OSError):
                self.log.flush()
            raise
        self.log.flush()

    def _due(self, stop_at: int) -> tuple[bool, bool, bool]:
        """(validate, checkpoint, record losses) at the current iteration."""
        it, train_cfg = self.iteration, self.config.train
        at_end = it == train_cfg.iters
        validate = it % train_cfg.val_interval == 0 or at_end
        checkpoint = it % train_cfg.ckpt_interval == 0 or at_end or it == stop_at
        return validate, checkpoint, it % train_cfg.log_interval == 0 or it == stop_at

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step on train.accumulate (uint8 images, masks) micro-batches (engine.accumulation);
        returns the detached loss share of this process (the sum over processes is the global batch's loss)."""
        data_cfg = self.config.data
        micro_batches = [(images.to(self.device, non_blocking=True), masks.to(self.device, non_blocking=True))
                         for images, masks in micro_batches]
        normalizer = step_normalizer(self.criterion, [masks for _, masks in micro_batches])
        self.optimizer.zero_grad(set_to_none=True)
        shares = []
        for index, (images, masks) in enumerate(micro_batches):
            with gradient_sync(self.train_model, last=index == len(micro_batches) - 1):
                inputs = normalize_batch(images, data_cfg.mean, data_cfg.std)
                if self.config.model.channels_last:
                    inputs = inputs.contiguous(memory_format=torch.channels_last)
                with autocast_for(self.device, self.precision):
                    outputs = self.forward_model(inputs)
                loss = self.criterion(outputs, masks, step_weight=normalizer)
                # DDP averages gradients over processes; scaling by the world size makes that the sum of the
                # processes' shares of the global loss.
                self.scaler.scale(loss * self.dist.world_size).backward()
            shares.append(loss.detach())
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return torch.stack(shares).sum()

    def _record_losses(self, result: TrainResult) -> None:
        """Move the pending per-step losses (summed over processes) into result.losses."""
        if not self._pending_losses:
            return
        values = torch.stack([loss for _, loss in self._pending_losses])
        values = values.to(torch.promote_types(values.dtype, torch.float32))  # float64 losses stay float64
        all_reduce_sum(values)
        for (iteration, _), value in zip(self._pending_losses, values.cpu().tolist()):
            if not math.isfinite(value):
                raise FloatingPointError(
                    f"non-finite loss ({value}) at iteration {iteration}; stopping. The last good checkpoint "
                    f"({self.run_dir / 'last.pt'}) was left untouched; lower train.lr, try train.amp=off, or "
                    "check the data")
            result.losses[iteration] = value
        self._pending_losses = []

    def _log_training(self, result: TrainResult, throughput: Throughput, stop_at: int, bar: Any) -> None:
        interval = self.config.train.log_interval
        recent = [result.losses[i] for i in range(self.iteration - interval + 1, self.iteration + 1)
                  if i in result.losses]
        factor = self.scheduler.factor(self.iteration - 1)  # the rate the last step used
        images_per_s, data_wait = throughput.window()
        record = {
            "loss": sum(recent) / max(1, len(recent)),
            "lr": {name: group["initial_lr"] * factor for name, group in zip(self.group_names,
                                                                             self.optimizer.param_groups)},
            "images_per_s": images_per_s,
            "data_wait_fraction": data_wait,
            "peak_memory_mb": peak_memory_mb(self.device),
        }
        self.log.scalars(record, step=self.iteration, prefix="train")
        if bar is not None:
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{next(iter(record['lr'].values()), 0.0):.2e}")
        elif self.is_main:
            logger.info(progress_line(record, iteration=self.iteration, stop_at=stop_at,
                                      eta=throughput.eta_seconds(self.iteration, stop_at)))

    # ------------------------------------------------------------------------ periodic actions
    def _validate_is_best(self, result: TrainResult) -> bool:
        """Validate; True when the mIoU beats the best so far (best.pt is then saved)."""
        metrics = self.validate()
        result.last_val = metrics
        if metrics["miou"] > self.best_miou:
            self.best_miou, self.best_metrics = float(metrics["miou"]), metrics
            return True
        return False

    def validate(self) -> dict[str, Any]:
        """evaluate() on the validation shard of this process (the same code path as eval.py)."""
        self.model.eval()
        data_cfg = self.config.data
        metrics = evaluate(self.model, self.val_loader, num_classes=self.num_classes, device=self.device,
                           mean=data_cfg.mean, std=data_cfg.std, eval_cfg=self.config.eval,
                           ignore_index=self.ignore_index, classes=self.classes, progress=False)
        if self.is_main:
            self.log.validation(metrics, classes=self.classes, step=self.iteration)
            if self.vis_indices:
                grid = prediction_grid(self.model, self.val_set, self.vis_indices, num_classes=self.num_classes,
                                       device=self.device, data_cfg=self.config.data, eval_cfg=self.config.eval)
                self.log.image("val/image_truth_prediction", grid, step=self.iteration)
            logger.info("iteration %d: val mIoU %.4f, pixel acc %.4f (%d images)", self.iteration,
                        metrics["miou"], metrics["pixel_acc"], metrics["num_images"])
        self.model.train()
        return metrics

    def _payload(self, rng: dict[str, Any]) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model": self.model.state_dict(),
            "config": to_dict(self.config),
            "classes": list(self.classes),
            "iteration": self.iteration,
            "epoch": self.iteration // self.sampler.batches_per_epoch,
            "best_miou": self.best_miou,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng,
            "run_id": self.run_id,
            "overrides": self.overrides,
        }

    def save(self, names: list[str]) -> None:
        """Write run_dir/<name> for each name (rank 0); every process must call it (RNG gathering).
        best.pt gets the weights and the best validation's metrics only (engine.checkpoint.weights_payload).

        Raises FloatingPointError, before writing, when a parameter or buffer is not finite (on any
        process): the previous checkpoint stays the last good one.
        """
        bad = first_non_finite(self.model.state_dict())
        flag = torch.tensor([0.0 if bad is None else 1.0], device=self.device)
        all_reduce_sum(flag)
        if flag.item() > 0:
            where = f"tensor {bad}" if bad is not None else "a tensor of another process"
            raise FloatingPointError(
                f"non-finite {where} at iteration {self.iteration}; stopping without saving. The last good "
                f"checkpoint ({self.run_dir / 'last.pt'}) was left untouched; lower train.lr, try train.amp=off, "
                "or check the data")
        state = capture_rng_state()
        states: list[Any] = [state]
        if is_dist():
            states = [None] * self.dist.world_size
            torch.distributed.all_gather_object(states, state)
        if self.is_main:
            payload = self._payload({"per_rank": states})
            for name in names:
                save_checkpoint(self.run_dir / name, weights_payload(payload, metrics=self.best_metrics)
                                if name == "best.pt" else payload)
            logger.info("saved %s at iteration %d", " and ".join(names), self.iteration)
        barrier()

    def close(self) -> None:
        """Stop the data-loading workers and close the TensorBoard writer (call it however training ended)."""
        self.batches.close()
        shutdown_workers(self.train_loader)
        self.log.close()
