"""Trainer: runs the training loop on parts built by syncseg.engine.build.build_training.

`Trainer.from_config(config, dist_info).fit()` trains `config.train.iters` optimizer steps. A run stopped at
iteration K and resumed computes the same losses as an uninterrupted run: the checkpoint holds the
model, optimizer, scheduler, scaler, iteration and every process's RNG state (`state_dict` /
`load_state_dict`, written by syncseg.engine.checkpointer.Checkpointer), and the data order is a function of
(train.seed, epoch).
"""
from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from syncseg.data.transforms import normalize_batch
from syncseg.engine.accumulation import describe_world_change, gradient_sync, step_normalizer
from syncseg.engine.build import TrainingParts, build_training
from syncseg.engine.checkpoint import FORMAT_VERSION
from syncseg.engine.checkpointer import Checkpointer, non_finite_error
from syncseg.engine.config import Config, from_dict, save_config, to_dict
from syncseg.engine.devices import autocast_for
from syncseg.engine.distributed import DistInfo, all_reduce_sum
from syncseg.engine.ema import best_after_decay_change
from syncseg.engine.evaluate import evaluate
from syncseg.engine.optim import load_optimizer_state
from syncseg.engine.overfitting import OverfittingWatch
from syncseg.engine.precise_bn import precise_batch_norms
from syncseg.engine.reporting import MetricsLog, Throughput, peak_memory_mb, progress_bar, progress_line
from syncseg.engine.samplers import shutdown_workers, train_steps
from syncseg.engine.seeding import seed_process
from syncseg.engine.signals import StopRequest
from syncseg.engine.visualize import prediction_grid
from syncseg.model.norm import synchronizes_statistics
from syncseg.model.weights import load_model_weights

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


@dataclass(frozen=True)
class Due:
    """What the loop does after one step: read the losses back, log, write last.pt, validate, stop.
    `validate` says this iteration's validation is due even when `stop` is set: a stop saves it as due."""

    record: bool
    log: bool
    checkpoint: bool
    validate: bool
    stop: bool  # a stop request every process agreed on

    @classmethod
    def after(cls, iteration: int, train_cfg: Any, *, stop_at: int, stop_requested: bool) -> "Due":
        """What is due after step `iteration` of a fit up to `stop_at` (train_cfg: config.train)."""
        at_end = iteration == train_cfg.iters
        stop = stop_requested and iteration < stop_at
        log = iteration % train_cfg.log_interval == 0
        checkpoint = iteration % train_cfg.ckpt_interval == 0 or at_end or iteration == stop_at or stop
        validate = iteration % train_cfg.val_interval == 0 or at_end
        return cls(record=log or checkpoint or validate, log=log, checkpoint=checkpoint, validate=validate, stop=stop)


def read_back_losses(pending: list[tuple[int, torch.Tensor]], *, run_dir: Any) -> dict[int, float]:
    """{iteration: loss summed over processes} of the steps' (iteration, loss share) in `pending` (one
    all-reduce: every process calls it with as many steps); non_finite_error on the first non-finite one."""
    if not pending:
        return {}
    values = torch.stack([loss for _, loss in pending])
    values = values.to(torch.promote_types(values.dtype, torch.float32))  # float64 losses stay float64
    all_reduce_sum(values)
    losses = {}
    for (iteration, _), value in zip(pending, values.cpu().tolist()):
        if not math.isfinite(value):
            raise non_finite_error(f"loss ({value})", iteration=iteration, run_dir=run_dir)
        losses[iteration] = value
    return losses


class Trainer:
    """Trains `parts` (syncseg.engine.build.TrainingParts). Only rank 0 writes files.

    `resume`: a checkpoint payload (syncseg.engine.checkpoint.load_checkpoint with RESUME_KEYS) to continue from
    (build the parts with init_weights=False then); `run_id` and `overrides` (syncseg.engine.run_plan.RunPlan) are
    saved in every checkpoint. `fit` may be called again with a later `stop_at`: it continues the same
    data stream.
    """

    def __init__(self, parts: TrainingParts, *, resume: Mapping[str, Any] | None = None, run_id: str = "",
                 overrides: Mapping[str, str] | None = None, progress: bool | None = None) -> None:
        self.parts, self.config, self.dist, self.device = parts, parts.config, parts.dist, parts.device
        self.model, self.optimizer = parts.model, parts.optimizer
        self.run_id = run_id or (resume or {}).get("run_id", "")
        self.overrides = dict(overrides or {})  # saved with the run: a resume checks its --config against them
        self.progress = (sys.stderr.isatty() if progress is None else progress) and self.dist.is_main
        self.run_dir = self.config.run_dir
        self.checkpointer = Checkpointer(self.run_dir, self.dist)
        self.iteration, self.best_miou, self.best_metrics = 0, -1.0, None  # best_metrics: best.pt's validation
        self.validation_due = False  # a stop ended this iteration's validation: a resume runs it first
        self._steps: Iterator[list[Any]] | None = None  # created at the first fit, from self.iteration
        self._pending_losses: list[tuple[int, torch.Tensor]] = []  # (iteration, loss) not yet read back
        self._last_saved: tuple[int, float, bool] | None = None  # _saved_state_key() of the last last.pt written
        self.overfitting = OverfittingWatch()  # replaced at the first fit, with the best mIoU a resume brings
        self.vis_indices = list(range(min(self.config.train.num_vis_images, len(parts.val_set))))
        seed_process(self.config.train.seed, self.dist.rank)
        if resume is not None:
            self.load_state_dict(resume)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.config, self.run_dir / "config.yaml")
        self.log = MetricsLog(self.run_dir, enabled=self.dist.is_main,
                              resume_iteration=self.iteration if resume is not None else None)

    @classmethod
    def from_config(cls, config: Config, dist_info: DistInfo, *, resume: Mapping[str, Any] | None = None,
                    **options: Any) -> "Trainer":
        """build_training(config, dist_info) and a Trainer on its parts (`options`: the constructor's)."""
        return cls(build_training(config, dist_info, init_weights=resume is None), resume=resume, **options)

    # ------------------------------------------------------------------------------ the loop
    def fit(self, *, stop_at: int | None = None) -> TrainResult:
        """Train up to `stop_at` (default train.iters). last.pt is written every train.ckpt_interval, at the
        stop iteration and on a signal (before any validation of the same iteration, so a failing
        validation cannot cost the work); best.pt at each better validation. A signal is answered within a
        step or a batch of what runs between steps (PreciseBN, validation, the grid): last.pt is saved at
        that iteration, with a validation the stop skipped or cut short recorded as due (the resume runs it
        first, so the validations and best.pt are an uninterrupted run's)."""
        total = self.config.train.iters
        stop_at = total if stop_at is None else min(total, stop_at)
        result = TrainResult(best_miou=self.best_miou, iteration=self.iteration)
        logger.info("training from iteration %d to %d", self.iteration, stop_at)
        if self._steps is None:
            self._steps = train_steps(self.parts.train_loader, self.iteration)
            self.overfitting = OverfittingWatch(best_miou=self.best_miou)  # from this fit's first losses
        self.model.train()
        throughput, loop_start, periodic_seconds = Throughput(self.iteration), time.perf_counter(), 0.0
        with StopRequest() as stop, progress_bar(enabled=self.progress, total=stop_at,
                                                 initial=self.iteration) as bar, self.log.flushed_at_exit():
            stop.iteration = self.iteration
            stopped = self.validation_due and not self._validation(stop, result)  # the one a stop left due
            while self.iteration < stop_at and not stopped:
                stop.iteration = self.iteration + 1
                wait_start = time.perf_counter()
                micro_batches = next(self._steps)
                throughput.add(images=self.config.train.batch_size, data_seconds=time.perf_counter() - wait_start)
                self._pending_losses.append((self.iteration + 1, self.train_step(micro_batches)))
                self.iteration += 1
                due = Due.after(self.iteration, self.config.train, stop_at=stop_at, stop_requested=stop.agreed())
                if due.record:  # raises on a non-finite loss, before anything is saved
                    losses = read_back_losses(self._pending_losses, run_dir=self.run_dir)
                    result.losses.update(losses)
                    self.overfitting.add_losses(losses)
                    self._pending_losses = []
                if due.log:
                    self._log_training(result, throughput, stop_at, bar)
                if bar is not None:
                    bar.update(1)
                periodic_start = time.perf_counter()
                stopped = not self._between_steps(due, stop, result)
                periodic_seconds += time.perf_counter() - periodic_start
            if stopped:
                result.reason, result.signal = "signal", stop.received
                logger.warning("stopped by signal at iteration %d; last.pt saved", self.iteration)
        result.train_seconds = time.perf_counter() - loop_start - periodic_seconds
        if result.reason != "signal" and self.iteration < total:
            result.reason = "stopped"
        result.iteration, result.best_miou = self.iteration, self.best_miou
        return result

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step on train.accumulate (integer images, masks) micro-batches (syncseg.engine.accumulation);
        returns the detached loss share of this process (the sum over processes is the global batch's loss)."""
        parts, data_cfg = self.parts, self.config.data
        # masks arrive uint8 from the training loader (syncseg.engine.build): widened here, on the device
        micro_batches = [(images.to(self.device, non_blocking=True), masks.to(self.device, non_blocking=True).long())
                         for images, masks in micro_batches]
        normalizer = step_normalizer(parts.criterion, [masks for _, masks in micro_batches])
        self.optimizer.zero_grad(set_to_none=True)
        shares = []
        for index, (images, masks) in enumerate(micro_batches):
            with gradient_sync(parts.train_model, last=index == len(micro_batches) - 1):
                with autocast_for(self.device, parts.precision):
                    inputs = normalize_batch(images, data_cfg.mean, data_cfg.std, max_value=data_cfg.max_value)
                    outputs = parts.forward_model(inputs)
                loss = parts.criterion(outputs, masks, step_weight=normalizer)
                # DDP averages gradients over processes; scaling by the world size makes that the sum of the
                # processes' shares of the global loss.
                parts.scaler.scale(loss * self.dist.world_size).backward()
            shares.append(loss.detach())
        parts.scaler.step(self.optimizer)
        parts.scaler.update()
        parts.scheduler.step()
        if parts.ema is not None:
            parts.ema.update(self.model)
        return torch.stack(shares).sum()

    def _log_training(self, result: TrainResult, throughput: Throughput, stop_at: int, bar: Any) -> None:
        interval = self.config.train.log_interval
        recent = [result.losses[i] for i in range(self.iteration - interval + 1, self.iteration + 1)
                  if i in result.losses]
        factor = self.parts.scheduler.factor(self.iteration - 1)  # the rate the last step used
        images_per_s, data_wait = throughput.window()
        record = {
            "loss": sum(recent) / max(1, len(recent)),
            "lr": {group["name"]: group["initial_lr"] * factor for group in self.optimizer.param_groups},
            "images_per_s": images_per_s,
            "data_wait_fraction": data_wait,
            "peak_memory_mb": peak_memory_mb(self.device),
        }
        self.log.scalars(record, step=self.iteration, prefix="train")
        if bar is not None:
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{next(iter(record['lr'].values()), 0.0):.2e}")
        elif self.dist.is_main:
            logger.info(progress_line(record, iteration=self.iteration, stop_at=stop_at,
                                      eta=throughput.eta_seconds(self.iteration, stop_at)))

    def _between_steps(self, due: Due, stop: StopRequest, result: TrainResult) -> bool:
        """What `due` asks for after a step: last.pt, PreciseBN, validation. False when a stop ends the run
        here, last.pt saved at this iteration (every process agrees on it: StopRequest.agreed)."""
        if due.stop:
            return self._stop_saving(validation_due=due.validate)
        if due.validate:
            if not self._validation(stop, result, checkpoint=due.checkpoint):
                return False
        elif due.checkpoint:
            self.save(["last.pt"])
        if (due.validate or due.checkpoint) and stop.agreed():  # a signal during a save or the grid's last image
            return self._stop_saving(validation_due=False)
        return True

    def _validation(self, stop: StopRequest, result: TrainResult, *, checkpoint: bool = False) -> bool:
        """PreciseBN (train.precise_bn_batches), then last.pt when `checkpoint` (after PreciseBN, as it keeps the
        statistics validation used; before validating, so a failing validation cannot cost the work), then
        validate and write best.pt when better. False when a stop agreed between batches ended PreciseBN or
        the validation: last.pt is then saved with the validation due, and the resume runs all of this again
        (PreciseBN's batches are fixed, so the same weights give it the same statistics)."""
        if self.parts.precise_bn_loader is not None and not precise_batch_norms(self.parts, should_stop=stop.agreed):
            return self._stop_saving(validation_due=True)
        if checkpoint:
            self.save(["last.pt"])
        metrics = self.validate(stop=stop)
        if metrics is None:
            return self._stop_saving(validation_due=True)
        self.validation_due = False
        if metrics["miou"] > self.best_miou:
            self.best_miou, self.best_metrics = float(metrics["miou"]), metrics
            self.save(["best.pt"])
        warning = self.overfitting.after_validation(self.iteration, float(metrics["miou"]))
        if warning is not None and self.dist.is_main:
            logger.warning("%s", warning)
        result.last_val = metrics
        return True

    def _stop_saving(self, *, validation_due: bool) -> bool:
        """Stop here: last.pt at this iteration (unless the one saved last is this very state); returns False."""
        self.validation_due = validation_due
        if validation_due:
            logger.warning("iteration %d's validation is left due: the resume runs it first", self.iteration)
        if self._last_saved != self._saved_state_key():
            self.save(["last.pt"])
        return False

    def validate(self, *, stop: StopRequest | None = None) -> dict[str, Any] | None:
        """evaluate() on the validation shard of this process (the same code path as eval.py) and rank 0's
        TensorBoard grid, then logged; the averaged weights when train.ema_decay > 0. None, with nothing logged,
        when `stop` ended it: agreed before every validation batch and once after the grid, which rank 0 draws
        alone (asking only its own flag between images, since the other processes are not drawing)."""
        parts, classes, model = self.parts, self.parts.classes, self.parts.eval_model
        should_stop = None if stop is None else stop.agreed
        metrics = evaluate(model, parts.val_loader, num_classes=len(classes), device=self.device,
                           data_cfg=self.config.data, eval_cfg=self.config.eval, classes=classes, progress=False,
                           should_stop=should_stop)
        grid = None
        if metrics is not None and self.dist.is_main and self.vis_indices:
            grid = prediction_grid(model, parts.val_set, self.vis_indices, device=self.device,
                                   data_cfg=self.config.data, eval_cfg=self.config.eval,
                                   should_stop=None if stop is None else lambda: stop.requested)
        if metrics is None or (should_stop is not None and should_stop()):
            return None
        if self.dist.is_main:
            self.log.validation(metrics, classes=classes, step=self.iteration)
            if grid is not None:
                self.log.image("val/image_truth_prediction", grid, step=self.iteration)
            logger.info("iteration %d: val mIoU %.4f, pixel acc %.4f (%d images)", self.iteration,
                        metrics["miou"], metrics["pixel_acc"], metrics["num_images"])
        return metrics

    # ------------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint payload of this run (without the RNG states, which the Checkpointer adds)."""
        parts = self.parts
        return {
            "format_version": FORMAT_VERSION, "model": self.model.state_dict(), "config": to_dict(self.config),
            "classes": list(parts.classes), "iteration": self.iteration,
            "epoch": self.iteration // parts.sampler.batches_per_epoch, "best_miou": self.best_miou,
            "optimizer": self.optimizer.state_dict(), "scheduler": parts.scheduler.state_dict(),
            "scaler": parts.scaler.state_dict(), "run_id": self.run_id, "overrides": self.overrides,
            "validation_due": self.validation_due,
            **({"ema": parts.ema.state_dict()} if parts.ema is not None else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a last.pt payload: weights, optimizer, schedule, scaler, iteration, best mIoU, RNG.
        The (possibly overridden) config decides the base LR and weight decay from here on."""
        parts = self.parts
        saved = from_dict(state["config"])
        load_model_weights(self.model, state["model"], checkpoint=state.get("path", "resumed"),
                           saved_model_cfg=saved.model, model_cfg=self.config.model)
        load_optimizer_state(self.optimizer, state["optimizer"])
        parts.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            parts.scaler.load_state_dict(state["scaler"])
        if parts.ema is not None:
            parts.ema.resume(state.get("ema"), self.model)
        self.iteration = int(state["iteration"])
        self.best_miou = best_after_decay_change(saved.train.ema_decay, self.config.train.ema_decay,
                                                 float(state["best_miou"]))
        self.validation_due = bool(state.get("validation_due", False))
        if not self.checkpointer.restore_rng(state["rng"]):
            self._reseed_for_world_size(len(state["rng"].get("per_rank") or []))

    def _reseed_for_world_size(self, saved_world_size: int) -> None:
        """A resume by another number of processes: the saved random streams cannot be dealt out, so each
        process's come from (train.seed, rank, iteration); the data order does not depend on them."""
        seed_process(self.config.train.seed, self.dist.rank, iteration=self.iteration)
        if not self.dist.is_main:
            return
        if saved_world_size < 1:
            logger.warning("the checkpoint holds no RNG states: each process's random streams reseeded from "
                           "(train.seed, rank, iteration)")
            return
        model_cfg, train_cfg = self.config.model, self.config.train
        global_statistics = self.dist.num_replicas == 1 or (  # as build.describe tells synchronized BN apart
            synchronizes_statistics(model_cfg.norm) and model_cfg.syncbn_group_size in (0, self.dist.world_size))
        logger.info(describe_world_change(
            saved_world_size, self.dist.world_size, global_batch=train_cfg.batch_size, accumulate=train_cfg.accumulate,
            num_replicas=self.dist.num_replicas, global_statistics=global_statistics))

    def save(self, names: list[str]) -> None:
        """Write run_dir/<name> for each name (syncseg.engine.checkpointer.Checkpointer.save; every process calls it).
        best.pt shares the weights validation used (the averaged ones with train.ema_decay)."""
        state = self.state_dict()
        self.checkpointer.save(names, state, best_metrics=self.best_metrics, weights=state.get("ema"))
        if "last.pt" in names:
            self._last_saved = self._saved_state_key()

    def _saved_state_key(self) -> tuple[int, float, bool]:
        """What tells last.pt states of one run apart between steps (the weights change only in a step)."""
        return self.iteration, self.best_miou, self.validation_due

    def close(self) -> None:
        """Stop the data-loading workers and close the TensorBoard writer (call it however training ended)."""
        if self._steps is not None:
            self._steps.close()
        shutdown_workers(self.parts.train_loader)
        self.log.close()
