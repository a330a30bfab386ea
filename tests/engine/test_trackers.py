"""log.loggers: MLflow (a real `mlflow server` on loopback, and the default SQLite store in the run dir) and W&B
offline, read back through MLflow's client and the W&B run files; a resume continues the same runs; a tracker
that cannot be reached or falls behind never stops or stalls training."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from syncseg.engine import trackers
from syncseg.engine.config import load_config
from syncseg.engine.trackers import Tracker, flat_params, metric_key, require_trackers
from tests.e2e.common import ROOT, TINY_BASE, read_metrics
from tests.trackers import mlflow_server, wandb_history, wandb_run_record

RUN = TINY_BASE + ["train.iters=6", "train.val_interval=3", "train.ckpt_interval=3"]


def train(run_dir: Path, *extra: str, resume: bool = False, stop_at: int | None = None,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "train.py"), "--config", "demo.yaml", f"output_dir={run_dir}", *RUN, *extra]
    command += ["--resume", "auto"] if resume else []
    command += ["--stop-at", str(stop_at)] if stop_at else []
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=run_dir.parent,
                          env={**os.environ, "WANDB_SILENT": "true", **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def train_losses(run_dir: Path) -> dict[int, float]:
    return {record["iteration"]: record["loss"] for record in read_metrics(run_dir) if record["type"] == "train"}


def last_checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "last.pt", map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_a_run_on_an_mlflow_server_is_one_run_across_a_resume(tmp_path):
    """Against `mlflow server` (SQLite backend, proxied artifacts): params = the resolved config, the losses and the
    per-class IoU at their iterations, config.yaml and best.pt as artifacts; the resumed half continues the run
    whose id last.pt kept, and the changed train.iters is a tag (MLflow keeps a parameter's first value)."""
    from mlflow.tracking import MlflowClient

    with mlflow_server(tmp_path / "server") as uri:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        options = ["log.loggers=mlflow", f"log.mlflow_uri={uri}", "log.mlflow_experiment=trackers",
                   "log.mlflow_checkpoint=true"]
        train(run_dir, *options, "train.iters=3")
        first_id = last_checkpoint(run_dir)["trackers"]["mlflow"]
        train(run_dir, *options, "train.iters=6", resume=True)
        assert last_checkpoint(run_dir)["trackers"] == {"mlflow": first_id}
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name("trackers")
        runs = client.search_runs([experiment.experiment_id])
        assert [run.info.run_id for run in runs] == [first_id]
        run = runs[0]
        assert run.info.status == "FINISHED"
        assert run.data.params["train.lr"] == "0.002" and run.data.params["model.backbone"] == "resnet18"
        assert run.data.params["train.iters"] == "3" and "train.iters=6" in run.data.tags["syncseg.resumed_with"]
        history = {metric.step: metric.value for metric in client.get_metric_history(first_id, "train/loss")}
        assert history == pytest.approx(train_losses(run_dir), rel=1e-6) and sorted(history) == list(range(1, 7))
        validations = [record for record in read_metrics(run_dir) if record["type"] == "val"]
        assert [record["iteration"] for record in validations] == [3, 6]
        for name, value in validations[-1]["iou"].items():
            points = {metric.step: metric.value for metric in client.get_metric_history(first_id, f"val/iou/{name}")}
            assert points[6] == pytest.approx(value)
        artifacts = {item.path for item in client.list_artifacts(first_id)}
        assert {"config.yaml", "checkpoints"} <= artifacts
        downloaded = Path(client.download_artifacts(first_id, "checkpoints/best.pt", str(tmp_path / "down")))
        best = torch.load(downloaded, map_location="cpu", weights_only=True)
        assert best["iteration"] == torch.load(run_dir / "best.pt", map_location="cpu", weights_only=True)["iteration"]


@pytest.mark.slow
def test_default_stores_mlflow_sqlite_in_the_run_dir_and_wandb_offline_continue_across_a_resume(tmp_path):
    """No URI, no server: MLflow writes run_dir/mlflow.db (accepted by MLflow >= 3.13 without
    MLFLOW_ALLOW_FILE_STORE) and W&B writes offline run files in run_dir/wandb, both beside TensorBoard; a stop
    and --resume auto keep both run ids, and the records of both halves are metrics.jsonl's."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    options = ["log.loggers=tensorboard,mlflow,wandb", "log.wandb_project=syncseg-tests"]
    env = {"MLFLOW_ALLOW_FILE_STORE": "false"}
    train(run_dir, *options, stop_at=3, env=env)
    ids = last_checkpoint(run_dir)["trackers"]
    train(run_dir, *options, resume=True, env=env)
    assert last_checkpoint(run_dir)["trackers"] == ids and set(ids) == {"mlflow", "wandb"}
    assert list(run_dir.glob("events.out.tfevents.*"))
    losses = train_losses(run_dir)

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.artifact_uri.startswith((run_dir / "mlartifacts").as_uri())
    history = {metric.step: metric.value for metric in client.get_metric_history(ids["mlflow"], "train/loss")}
    assert history == pytest.approx(losses, rel=1e-6)

    files = sorted(run_dir.glob(f"wandb/offline-run-*-{ids['wandb']}/run-{ids['wandb']}.wandb"))
    assert len(files) == 2  # one offline file per process; `wandb sync` joins them as one run (resume=allow)
    for path in files:
        record = wandb_run_record(path)
        assert record.run_id == ids["wandb"] and record.project == "syncseg-tests" and record.display_name == "demo"
    config = {item.key: json.loads(item.value_json) for item in wandb_run_record(files[0]).config.update}
    assert config["train.batch_size"] == "4"
    logged = {}
    for path in files:
        for row in wandb_history(path):
            if "train/loss" in row:
                logged[int(json.loads(row["iteration"]))] = json.loads(row["train/loss"])
    assert logged == pytest.approx(losses, rel=1e-9)


@pytest.mark.slow
def test_a_tracking_server_that_does_not_answer_turns_its_logger_off_once_and_training_finishes(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    from tests.trackers import free_port

    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    done = train(run_dir, "log.loggers=tensorboard,mlflow", f"log.mlflow_uri={uri}", "log.timeout_s=5")
    assert time.monotonic() - started < 120
    warnings = [line for line in done.stderr.splitlines() if "logging to it is off" in line]
    assert len(warnings) == 1 and uri in warnings[0] and "does not answer" in warnings[0], done.stderr[-2000:]
    assert sorted(train_losses(run_dir)) == list(range(1, 7))
    assert "trackers" not in last_checkpoint(run_dir)


class _Stuck(Tracker):
    """A tracker whose every record waits for `release`: a server that stopped answering."""

    name = "stuck"

    def __init__(self, *, timeout_s: float) -> None:
        self.release, self.busy, self.sent = threading.Event(), threading.Event(), []
        super().__init__(timeout_s=timeout_s)

    def log(self, values, step):
        def send():
            self.busy.set()
            self.release.wait(30)
            self.sent.append(step)

        self.submit(send)

    def finish(self, *, status, files):
        self.sent.append(status)


def test_a_tracker_that_falls_behind_never_blocks_the_caller_and_its_end_is_bounded(monkeypatch, caplog):
    monkeypatch.setattr(trackers, "QUEUE_SIZE", 4)
    tracker = _Stuck(timeout_s=0.5)
    tracker.log([("train/loss", 1.0)], 0)
    assert tracker.busy.wait(10)  # the worker is sending step 0 and waits for the server
    started = time.monotonic()
    for step in range(1, 10):
        tracker.log([("train/loss", 1.0)], step)
    assert time.monotonic() - started < 10  # not the 30 s a blocking put would wait for the stuck record
    assert tracker.dropped == 9 - 4  # four wait in the queue, the rest were dropped
    assert sum("falls behind" in record.message for record in caplog.records) == 1
    started = time.monotonic()
    tracker.close(status="finished", files={})
    assert time.monotonic() - started < 5
    assert any("not all sent within log.timeout_s=0.5" in record.message for record in caplog.records)
    tracker.release.set()


def test_a_tracker_drains_its_queue_at_close_and_a_failing_one_is_off_with_one_warning(caplog):
    tracker = _Stuck(timeout_s=10)
    tracker.release.set()
    for step in range(5):
        tracker.log([("train/loss", 1.0)], step)
    tracker.close(status="killed", files={})
    assert tracker.sent == [0, 1, 2, 3, 4, "killed"]

    failing = _Stuck(timeout_s=10)
    failing.release.set()
    failing.submit(lambda: (_ for _ in ()).throw(PermissionError("403 Forbidden: bad token")))
    failing.log([("train/loss", 1.0)], 1)
    failing.close(status="finished", files={})
    assert failing.sent == [] and not failing.enabled
    warnings = [record.message for record in caplog.records if "logging to it is off" in record.message]
    assert len(warnings) == 1 and "403 Forbidden: bad token" in warnings[0]


def test_a_missing_package_is_one_error_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    require_trackers(["tensorboard", "mlflow"])
    with pytest.raises(ValueError, match=r"log.loggers names wandb, but the wandb package is not installed; "
                                         r"pip install 'syncseg\[wandb\]'"):
        require_trackers(["tensorboard", "wandb"])


def test_a_missing_package_refuses_the_run_before_overwrite_deletes_anything(tmp_path, monkeypatch):
    from syncseg.engine.distributed import DistInfo
    from syncseg.engine.run_plan import plan_run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "last.pt").write_bytes(b"an earlier run")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match="mlflow package is not installed"):
        plan_run("demo.yaml", None, [f"output_dir={run_dir}", "log.loggers=mlflow"], dist_info=DistInfo(),
                 overwrite=True)
    assert (run_dir / "last.pt").read_bytes() == b"an earlier run"


@pytest.mark.parametrize("override, message", [
    ("log.loggers=tensorboard,comet", "log.loggers names 'comet', which is not one of tensorboard, mlflow, wandb"),
    ("log.loggers=mlflow,mlflow", "log.loggers lists 'mlflow' twice"),
    ("log.mlflow_uri=http://tracking:5000", "log.mlflow_uri=http://tracking:5000 is set but log.loggers (tensorboard) "
                                            "does not name mlflow; add it (log.loggers=tensorboard,mlflow)"),
    ("log.wandb_project=seg", "log.wandb_project=seg is set but log.loggers (tensorboard) does not name wandb"),
    ("log.timeout_s=0", "log.timeout_s=0.0: must be > 0"),
])
def test_log_settings_are_checked(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config("demo.yaml", [override])


def test_names_and_params_as_mlflow_takes_them():
    assert metric_key("val/iou/potted plant") == "val/iou/potted plant"
    assert metric_key("val/iou/car (parked)") == "val/iou/car _parked_"
    params = flat_params({"name": "demo", "train": {"lr": 0.01, "loss": [["ce", 1.0]]}, "data": {"root": "x" * 7000}})
    assert params["train.lr"] == "0.01" and params["train.loss"] == "[['ce', 1.0]]"
    assert len(params["data.root"]) == trackers.PARAM_LENGTH
