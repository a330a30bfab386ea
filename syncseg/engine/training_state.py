"""A training run's state in and out of its checkpoints: what last.pt holds, writing last.pt / best.pt, resuming.

`training_payload` is what a run's last.pt holds (Trainer.state_dict); `Checkpointer.save` checks every tensor of
the model for inf / nan first (on every process: a non-finite model stops the run and leaves the last good
checkpoint untouched), gathers every process's RNG state into last.pt, and writes best.pt as the
`weights_payload` subset; `resume_training` puts a last.pt back into the parts and the RNG streams (reseeded
when another number of processes resumes). The file format is syncseg.engine.checkpoint_file's.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from syncseg.engine.accumulation import describe_world_change
from syncseg.engine.checkpoint_file import FORMAT_VERSION, WEIGHTS_KEYS, save_checkpoint
from syncseg.engine.config import Config, from_dict, to_dict
from syncseg.engine.distributed import DistInfo, all_reduce_sum, barrier, is_dist
from syncseg.engine.ema import best_after_decay_change
from syncseg.engine.optim import load_optimizer_state
from syncseg.engine.seeding import capture_rng_state, restore_rng_state, seed_process
from syncseg.model.norm import synchronizes_statistics
from syncseg.model.weights import load_model_weights

if TYPE_CHECKING:
    from syncseg.engine.build import TrainingParts

logger = logging.getLogger(__name__)


def weights_payload(payload: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The best.pt subset of a training payload: WEIGHTS_KEYS (those present) and `metrics`."""
    small = {key: payload[key] for key in WEIGHTS_KEYS if key in payload}
    if metrics is not None:
        small["metrics"] = dict(metrics)
    return small


def first_non_finite(state: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding inf or nan, or None."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def non_finite_error(what: str, *, iteration: int, run_dir: Path) -> FloatingPointError:
    """The error that stops training at a non-finite loss or tensor (`what`), saving nothing; it says
    whether a last good checkpoint exists (a run that fails at its first iterations has none)."""
    last = run_dir / "last.pt"
    kept = (f"The last good checkpoint ({last}) was left untouched" if last.is_file()
            else f"No checkpoint was written yet ({last} does not exist)")
    return FloatingPointError(f"non-finite {what} at iteration {iteration}; stopping without saving. {kept}; lower "
                              "train.lr, try train.amp=off, or check the data")


class Checkpointer:
    """Writes a training run's last.pt / best.pt into `run_dir` (rank 0 writes; every process calls `save`,
    which gathers the RNG states) and restores this process's RNG state from one."""

    def __init__(self, run_dir: Path, dist_info: DistInfo) -> None:
        self.run_dir, self.dist = Path(run_dir), dist_info
        self.on_saved: Callable[[], None] | None = None  # rank 0, after each save (a run dir's upload)

    def save(self, names: Iterable[str], state: Mapping[str, Any], *, best_metrics: Mapping[str, Any] | None,
             weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write run_dir/<name> for each name: last.pt gets `state` (training_payload) plus
        every process's RNG state; best.pt `weights_payload(state, metrics=best_metrics)` with `weights`
        (e.g. the averaged ones) as its model when given.

        Raises FloatingPointError, before writing, when a tensor of state["model"] is not finite on any
        process: the previous checkpoint stays the last good one.
        """
        names = list(names)
        bad = first_non_finite(state["model"])
        flag = torch.tensor([0.0 if bad is None else 1.0], device=self.dist.device)
        all_reduce_sum(flag)
        if flag.item() > 0:
            where = f"tensor {bad}" if bad is not None else "a tensor of another process"
            raise non_finite_error(where, iteration=int(state["iteration"]), run_dir=self.run_dir)
        rng_states: list[Any] = [capture_rng_state()]
        if is_dist():
            rng_states = [None] * self.dist.world_size
            torch.distributed.all_gather_object(rng_states, capture_rng_state())
        if self.dist.is_main:
            payload = {**state, "rng": {"per_rank": rng_states}}
            for name in names:
                shared = payload if weights is None else {**payload, "model": weights}
                save_checkpoint(self.run_dir / name, weights_payload(shared, metrics=best_metrics)
                                if name == "best.pt" else payload)
            logger.info("saved %s at iteration %d", " and ".join(names), state["iteration"])
            if self.on_saved is not None:
                self.on_saved()
        barrier()

    def restore_rng(self, rng: Mapping[str, Any]) -> bool:
        """This process's RNG state from a checkpoint's `rng`; False, restoring nothing, when it was saved by
        a different number of processes (the caller reseeds: resume_training)."""
        states = rng.get("per_rank") or []
        if len(states) != self.dist.world_size:
            return False
        restore_rng_state(states[self.dist.rank])
        return True


def training_payload(parts: "TrainingParts", *, iteration: int, best_miou: float, run_id: str,
                     overrides: Mapping[str, str], validation_due: bool,
                     trackers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a run's last.pt holds at `iteration` (without the RNG states, which Checkpointer.save adds);
    `trackers`: the MLflow / W&B run ids (name -> id) a resume continues."""
    return {
        "format_version": FORMAT_VERSION, "model": parts.model.state_dict(), "config": to_dict(parts.config),
        "classes": list(parts.classes), "iteration": iteration,
        "epoch": iteration // parts.sampler.batches_per_epoch, "best_miou": best_miou,
        "optimizer": parts.optimizer.state_dict(), "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict(), "run_id": run_id, "overrides": dict(overrides),
        "validation_due": validation_due,
        **({"ema": parts.ema.state_dict()} if parts.ema is not None else {}),
        # an annotation export's numeric label ids (COCO category ids), so predictions go back with them
        **({"label_ids": list(label_ids)} if (label_ids := getattr(parts.train_set, "label_ids", None)) else {}),
        **({"trackers": dict(trackers)} if trackers else {}),
    }


class ResumePoint(NamedTuple):
    """Where a resumed run continues: its iteration, its best mIoU so far, and whether a stop left that
    iteration's validation due."""

    iteration: int
    best_miou: float
    validation_due: bool


def resume_training(parts: "TrainingParts", state: Mapping[str, Any], *, checkpointer: Checkpointer) -> ResumePoint:
    """Put a last.pt payload back into `parts`: weights, optimizer, schedule, scaler, the averaged weights, and this
    process's RNG state (reseeded by reseed_for_world_size when another number of processes saved it). The
    (possibly overridden) config of `parts` decides the base LR and weight decay from here on."""
    saved = from_dict(state["config"])
    load_model_weights(parts.model, state["model"], checkpoint=state.get("path", "resumed"),
                       saved_model_cfg=saved.model, model_cfg=parts.config.model)
    load_optimizer_state(parts.optimizer, state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
    if state["scaler"]:
        parts.scaler.load_state_dict(state["scaler"])
    if parts.ema is not None:
        parts.ema.resume(state.get("ema"), parts.model)
    point = ResumePoint(int(state["iteration"]),
                        best_after_decay_change(saved.train.ema_decay, parts.config.train.ema_decay,
                                                float(state["best_miou"])),
                        bool(state.get("validation_due", False)))
    if not checkpointer.restore_rng(state["rng"]):
        reseed_for_world_size(parts.config, parts.dist, iteration=point.iteration,
                              saved_world_size=len(state["rng"].get("per_rank") or []))
    return point


def reseed_for_world_size(config: Config, dist_info: DistInfo, *, iteration: int, saved_world_size: int) -> None:
    """A resume by another number of processes: the saved random streams cannot be dealt out, so each
    process's come from (train.seed, rank, iteration); the data order does not depend on them."""
    seed_process(config.train.seed, dist_info.rank, iteration=iteration)
    if not dist_info.is_main:
        return
    if saved_world_size < 1:
        logger.warning("the checkpoint holds no RNG states: each process's random streams reseeded from "
                       "(train.seed, rank, iteration)")
        return
    model_cfg, train_cfg = config.model, config.train
    global_statistics = dist_info.num_replicas == 1 or (  # as build.describe tells synchronized BN apart
        synchronizes_statistics(model_cfg.norm) and model_cfg.syncbn_group_size in (0, dist_info.world_size))
    logger.info(describe_world_change(
        saved_world_size, dist_info.world_size, global_batch=train_cfg.batch_size, accumulate=train_cfg.accumulate,
        num_replicas=dist_info.num_replicas, global_statistics=global_statistics))
