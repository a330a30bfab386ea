"""Trainer: runs the training loop on parts built by syncseg.engine.build.build_training.

`Trainer.from_config(config, dist_info).fit()` trains `config.train.iters` optimizer steps. A run stopped at
iteration K and resumed computes the same losses as an uninterrupted run: the checkpoint holds the
model, optimizer, scheduler, scaler, iteration and every process's RNG state (`state_dict` /
`load_state_dict`: syncseg.engine.training_state's training_payload / resume_training, written by its
Checkpointer), and the data order is a function of (train.seed, epoch). A stop that every process agreed on
travels as one exception, StopTraining, from where it is seen to `fit`.
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
from syncseg.engine.accumulation import gradient_sync, step_normalizer
from syncseg.engine.build import TrainingParts, build_training
from syncseg.engine.config import Config, save_config, to_dict
from syncseg.engine.devices import autocast_for
from syncseg.engine.distributed import DistInfo, all_reduce_sum
from syncseg.engine.evaluate import validate_during_training
from syncseg.engine.overfitting import OverfittingWatch
from syncseg.engine.precise_bn import precise_batch_norms
from syncseg.engine.reporting import MetricsLog, Stopwatch, Throughput, log_training, progress_bar, training_record
from syncseg.engine.samplers import shutdown_workers, train_steps
from syncseg.engine.seeding import seed_process
from syncseg.engine.signals import StopRequest
from syncseg.engine.trackers import start_trackers
from syncseg.engine.training_state import Checkpointer, non_finite_error, resume_training, training_payload

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
    """{iteration: loss summed over processes} of the steps' (iteration, loss share) in `pending`, which it empties (one
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
    pending.clear()
    return losses


def metrics_log(config: Config, *, is_main: bool, resume: Mapping[str, Any] | None, iteration: int) -> MetricsLog:
    """The run's MetricsLog: metrics.jsonl, TensorBoard and the trackers of log.loggers (rank 0 only), continuing
    the tracker runs whose ids a resumed last.pt kept."""
    trackers = start_trackers(config.log, run_dir=config.run_dir, run_name=config.name, config_dict=to_dict(config),
                              resume_ids=(resume or {}).get("trackers")) if is_main else []
    return MetricsLog(config.run_dir, enabled=is_main, tensorboard="tensorboard" in config.log.loggers,
                      resume_iteration=iteration if resume is not None else None, trackers=trackers)


class StopTraining(Exception):
    """A stop every process agreed on (StopRequest.agreed), raised once last.pt is saved at this iteration;
    Trainer.fit catches it, and nothing else does."""


class Trainer:
    """Trains `parts` (build_training's); only rank 0 writes files. `resume`: a last.pt payload to continue from, on
    parts built with init_weights=False; `run_id` and `overrides` (RunPlan's) go into every checkpoint. `fit` may
    be called again with a later `stop_at`: it continues the same data stream."""

    def __init__(self, parts: TrainingParts, *, resume: Mapping[str, Any] | None = None, run_id: str = "",
                 overrides: Mapping[str, str] | None = None, progress: bool | None = None) -> None:
        self.parts, self.config, self.dist, self.device = parts, parts.config, parts.dist, parts.device
        self.model, self.optimizer, self.run_dir = parts.model, parts.optimizer, parts.config.run_dir
        self.run_id = run_id or (resume or {}).get("run_id", "")
        self.overrides = dict(overrides or {})  # saved with the run: a resume checks its --config against them
        self.progress = (sys.stderr.isatty() if progress is None else progress) and self.dist.is_main
        self.checkpointer = Checkpointer(self.run_dir, self.dist)
        self.iteration, self.best_miou, self.best_metrics = 0, -1.0, None  # best_metrics: best.pt's validation
        self.validation_due = False  # a stop ended this iteration's validation: a resume runs it first
        self._steps: Iterator[list[Any]] | None = None  # created at the first fit, from self.iteration
        self._pending_losses: list[tuple[int, torch.Tensor]] = []  # (iteration, loss) not yet read back
        # (iteration, best mIoU, validation due) of the last last.pt written: between steps, what tells states apart
        self._last_saved: tuple[int, float, bool] | None = None
        self.overfitting = OverfittingWatch()  # replaced at the first fit, with the best mIoU a resume brings
        self.vis_indices = list(range(min(self.config.train.num_vis_images, len(parts.val_set))))
        seed_process(self.config.train.seed, self.dist.rank)
        if resume is not None:
            self.load_state_dict(resume)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.config, self.run_dir / "config.yaml")
        self.log = metrics_log(self.config, is_main=self.dist.is_main, resume=resume, iteration=self.iteration)

    @classmethod
    def from_config(cls, config: Config, dist_info: DistInfo, *, resume: Mapping[str, Any] | None = None,
                    **options: Any) -> "Trainer":
        """build_training(config, dist_info) and a Trainer on its parts (`options`: the constructor's)."""
        return cls(build_training(config, dist_info, init_weights=resume is None), resume=resume, **options)

    def fit(self, *, stop_at: int | None = None) -> TrainResult:
        """Train up to `stop_at` (default train.iters). last.pt every train.ckpt_interval, at `stop_at` and on a signal,
        before that iteration's validation (which then cannot cost the work); best.pt at each better validation. A
        signal is answered within a step or a batch between steps: last.pt at that iteration, with a validation it
        skipped or cut short left due (the resume runs it first: the validations are an uninterrupted run's)."""
        total = self.config.train.iters
        stop_at = total if stop_at is None else min(total, stop_at)
        result = TrainResult(best_miou=self.best_miou, iteration=self.iteration)
        logger.info("training from iteration %d to %d", self.iteration, stop_at)
        if self._steps is None:
            self._steps = train_steps(self.parts.train_loader, self.iteration)
            self.overfitting = OverfittingWatch(best_miou=self.best_miou)  # from this fit's first losses
        self.model.train()
        throughput, loop_start, between_steps = Throughput(self.iteration), time.perf_counter(), Stopwatch()
        with StopRequest() as stop, progress_bar(enabled=self.progress, total=stop_at,
                                                 initial=self.iteration) as bar, self.log.flushed_at_exit():
            stop.iteration = self.iteration
            try:
                if self.validation_due:  # the one a stop left due
                    self._validation(stop, result)
                while self.iteration < stop_at:
                    stop.iteration = self.iteration + 1
                    wait_start = time.perf_counter()
                    micro_batches = next(self._steps)
                    throughput.add(images=self.config.train.batch_size, data_seconds=time.perf_counter() - wait_start)
                    self._pending_losses.append((self.iteration + 1, self.train_step(micro_batches)))
                    self.iteration += 1
                    due = Due.after(self.iteration, self.config.train, stop_at=stop_at, stop_requested=stop.agreed())
                    if due.record:  # raises on a non-finite loss, before anything is saved
                        losses = read_back_losses(self._pending_losses, run_dir=self.run_dir)  # and empties it
                        result.losses.update(losses)
                        self.overfitting.add_losses(losses)
                    if due.log:
                        record = training_record(result.losses, iteration=self.iteration, throughput=throughput,
                                                 interval=self.config.train.log_interval, device=self.device,
                                                 scheduler=self.parts.scheduler, optimizer=self.optimizer)
                        log_training(self.log, record, iteration=self.iteration, stop_at=stop_at, bar=bar,
                                     eta=throughput.eta_seconds(self.iteration, stop_at),
                                     line_logger=logger if self.dist.is_main else None)
                    if bar is not None:
                        bar.update(1)
                    with between_steps:
                        self._between_steps(due, stop, result)
            except StopTraining:
                result.reason, result.signal = "signal", stop.received
                logger.warning("stopped by signal at iteration %d; last.pt saved", self.iteration)
        result.train_seconds = time.perf_counter() - loop_start - between_steps.seconds
        if result.reason != "signal" and self.iteration < total:
            result.reason = "stopped"
        result.iteration, result.best_miou = self.iteration, self.best_miou
        self.outcome = "killed" if result.reason == "signal" else "finished"
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
                # DDP averages gradients over processes: times the world size, the sum of their global-loss shares
                parts.scaler.scale(loss * self.dist.world_size).backward()
            shares.append(loss.detach())
        parts.scaler.step(self.optimizer)
        parts.scaler.update()
        parts.scheduler.step()
        if parts.ema is not None:
            parts.ema.update(self.model)
        return torch.stack(shares).sum()

    def _between_steps(self, due: Due, stop: StopRequest, result: TrainResult) -> None:
        """What `due` asks for after a step: last.pt, PreciseBN, validation; StopTraining when a stop that every
        process agreed on (StopRequest.agreed) ends the run here, last.pt saved at this iteration."""
        if due.stop:
            self._stop_here(validation_due=due.validate)
        if due.validate:
            self._validation(stop, result, checkpoint=due.checkpoint)
        elif due.checkpoint:
            self.save(["last.pt"])
        if (due.validate or due.checkpoint) and stop.agreed():  # a signal during a save or the grid's last image
            self._stop_here(validation_due=False)

    def _validation(self, stop: StopRequest, result: TrainResult, *, checkpoint: bool = False) -> None:
        """PreciseBN, then last.pt when `checkpoint` (after PreciseBN: it keeps the statistics validation used), then
        validation and best.pt when better. A stop agreed between their batches saves last.pt with the validation
        due (the resume runs it all again: PreciseBN's batches are fixed) and raises StopTraining."""
        if self.parts.precise_bn_loader is not None and not precise_batch_norms(self.parts, should_stop=stop.agreed):
            self._stop_here(validation_due=True)
        if checkpoint:
            self.save(["last.pt"])
        metrics = validate_during_training(self.parts, log=self.log, iteration=self.iteration,
                                           vis_indices=self.vis_indices, stop=stop)
        if metrics is None:
            self._stop_here(validation_due=True)
        self.validation_due = False
        if metrics["miou"] > self.best_miou:
            self.best_miou, self.best_metrics = float(metrics["miou"]), metrics
            self.save(["best.pt"])
        warning = self.overfitting.after_validation(self.iteration, float(metrics["miou"]))
        if warning is not None and self.dist.is_main:
            logger.warning("%s", warning)
        result.last_val = metrics

    def _stop_here(self, *, validation_due: bool) -> None:
        """last.pt at this iteration (unless the one saved last is this very state), then StopTraining."""
        self.validation_due = validation_due
        if validation_due:
            logger.warning("iteration %d's validation is left due: the resume runs it first", self.iteration)
        if self._last_saved != (self.iteration, self.best_miou, self.validation_due):
            self.save(["last.pt"])
        raise StopTraining

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint payload of this run (without the RNG states, which the Checkpointer adds)."""
        return training_payload(self.parts, iteration=self.iteration, best_miou=self.best_miou, run_id=self.run_id,
                                overrides=self.overrides, validation_due=self.validation_due, trackers=self.log.tracker_ids())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a last.pt payload (syncseg.engine.training_state.resume_training)."""
        self.iteration, self.best_miou, self.validation_due = resume_training(self.parts, state,
                                                                              checkpointer=self.checkpointer)

    def save(self, names: list[str]) -> None:
        """Write run_dir/<name> for each name (syncseg.engine.training_state.Checkpointer.save; every process calls it).
        best.pt shares the weights validation used (the averaged ones with train.ema_decay)."""
        state = self.state_dict()
        self.checkpointer.save(names, state, best_metrics=self.best_metrics, weights=state.get("ema"))
        if "last.pt" in names:
            self._last_saved = (self.iteration, self.best_miou, self.validation_due)

    def close(self) -> None:
        """Stop the data workers, end the trackers' runs, close TensorBoard (however training ended)."""
        if self._steps is not None:
            self._steps.close()
        shutdown_workers(self.parts.train_loader)
        self.log.close(status=getattr(self, "outcome", "failed"), files={"best.pt": self.run_dir / "best.pt"})
