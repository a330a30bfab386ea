"""One training run in this process, from a config to its result: what `train.py` and `syncseg.train` share.

Plan the run dir (lock, fresh or resume: syncseg.engine.run_plan), build the parts and the Trainer, fit, and
always close the data-loading workers and release the lock, whatever ends the run. A run dir on object
storage uploads after each checkpoint save (syncseg.engine.remote_run_dir) and waits for the last upload.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syncseg.engine.distributed import DistInfo
from syncseg.engine.run_plan import ConfigGiven, plan_run
from syncseg.engine.trainer import Trainer, TrainResult


@dataclass(frozen=True)
class CompletedRun:
    """What a training run ended with: its result and the run dir that holds last.pt, best.pt and the logs."""

    result: TrainResult
    run_dir: Path
    run_url: str = ""  # output_dir on object storage (run_dir is then its local staging folder)

    @property
    def location(self) -> str:
        """Where the run's files are kept: the URL, or the local run dir."""
        return self.run_url or str(self.run_dir)

    @property
    def iteration(self) -> int:
        return self.result.iteration

    @property
    def best_miou(self) -> float:
        """The best validation mIoU (best.pt's), -1 when nothing was validated yet."""
        return self.result.best_miou

    @property
    def last_validation(self) -> dict[str, Any] | None:
        return self.result.last_val


def run_training(given: ConfigGiven, overrides: list[str] | tuple[str, ...], *, dist_info: DistInfo,
                 resume: str | None = None, overwrite: bool = False, stop_at: int | None = None,
                 progress: bool | None = None) -> CompletedRun:
    """Train with the config `given` (a file name or path, a Config, or a run_plan.ConfigSource) and the
    KEY=VALUE `overrides`, on the topology of `dist_info`; every process of the run calls it.

    `resume`: None (a fresh run; a run dir holding a run is refused unless `overwrite`), "auto" (continue
    <run dir>/last.pt when it exists) or a checkpoint path. Raises ValueError / FileNotFoundError for bad
    input before anything is written, FloatingPointError for a non-finite loss; a stop request returns
    normally with result.reason "signal".
    """
    plan = plan_run(given, resume, list(overrides), dist_info=dist_info, overwrite=overwrite)
    trainer = None
    try:
        if plan.remote is not None:
            plan.remote.start()  # uploads in the background; plan.release() waits for the last one
        trainer = Trainer.from_config(plan.config, dist_info, resume=plan.resume, run_id=plan.run_id,
                                      overrides=plan.overrides, progress=progress)
        if plan.remote is not None:
            trainer.checkpointer.on_saved = plan.remote.request_upload
            plan.remote.request_upload()  # config.yaml, and the logs a resume trimmed
        plan.resume = None  # the payload's tensors are in the model and optimizer now
        return CompletedRun(result=trainer.fit(stop_at=stop_at), run_dir=plan.config.run_dir,
                            run_url=plan.config.run_url)
    finally:
        if trainer is not None:
            trainer.close()  # stops the data-loading workers, which ignore SIGINT/SIGTERM
        del trainer  # the DDP wrapper must be gone before the caller destroys the process group
        plan.release()
