"""Checkpointer: writes a training run's last.pt / best.pt and restores the RNG state from one.

Saving checks every tensor of the model for inf / nan first (on every process: a non-finite model stops the
run and leaves the last good checkpoint untouched), gathers every process's RNG state into last.pt, and
writes best.pt as the `weights_payload` subset. syncseg.engine.trainer.Trainer.state_dict / load_state_dict
are the rest of the pair; the file format is syncseg.engine.checkpoint's.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from syncseg.engine.checkpoint import WEIGHTS_KEYS, save_checkpoint
from syncseg.engine.distributed import DistInfo, all_reduce_sum, barrier, is_dist
from syncseg.engine.seeding import capture_rng_state, restore_rng_state

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

    def save(self, names: Iterable[str], state: Mapping[str, Any], *, best_metrics: Mapping[str, Any] | None,
             weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write run_dir/<name> for each name: last.pt gets `state` (syncseg.engine.trainer.Trainer.state_dict) plus
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
        barrier()

    def restore_rng(self, rng: Mapping[str, Any]) -> bool:
        """This process's RNG state from a checkpoint's `rng`; False, restoring nothing, when it was saved by
        a different number of processes (the caller reseeds: syncseg.engine.trainer.Trainer.load_state_dict)."""
        states = rng.get("per_rank") or []
        if len(states) != self.dist.world_size:
            return False
        restore_rng_state(states[self.dist.rank])
        return True
