"""Experiment trackers beside metrics.jsonl: MLflow and Weights & Biases (log.loggers), on rank 0 only.

Each tracker works in a thread of its own behind a bounded queue (QUEUE_SIZE records), so a slow or
unreachable server never stalls a training step: a record that finds the queue full is dropped and counted
(metrics.jsonl has every record), and one warning says so. Starting waits at most log.timeout_s, and so does
sending what is queued when training ends. A tracker that fails (no answer, bad credentials, a full store) is
switched off with one warning naming its URI and the error; training goes on. A missing package is refused
before the run starts (`require_trackers`), one line naming the pip extra.

MLflow's default store is a SQLite file in the run dir (`sqlite:///<run dir>/mlflow.db`, artifacts in
<run dir>/mlartifacts), which MLflow >= 3.13 accepts without a server and without MLFLOW_ALLOW_FILE_STORE. W&B
logs offline unless WANDB_MODE says otherwise; its records carry the iteration as their x-axis
(`define_metric`), so a resumed run may log an iteration again after a killed run logged past its last.pt.
Each tracker's run id goes into last.pt (`trackers`), so `--resume auto` continues the same run.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import queue
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

QUEUE_SIZE = 1000  # records waiting for one tracker; at log.train.log_interval=20 that is 20,000 iterations
PACKAGES = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}  # logger -> (module, pip extra)
_KEY_CHARACTERS = re.compile(r"[^\w\-./ ]")  # what MLflow accepts in a metric or parameter name
PARAM_LENGTH = 6000  # MLflow's longest parameter value
BATCH = 100  # MLflow's most parameters per log_batch


def require_trackers(loggers: Iterable[str]) -> None:
    """ValueError naming the pip extra when a package log.loggers needs is not installed."""
    for name in loggers:
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name][0]) is None:
            module, extra = PACKAGES[name]
            raise ValueError(f"log.loggers names {name}, but the {module} package is not installed; "
                             f"pip install 'syncseg[{extra}]' (or {module}), or leave {name} out of log.loggers")


def metric_key(key: str) -> str:
    """`key` as MLflow accepts it: characters other than letters, digits, _ - . / and space become _."""
    return _KEY_CHARACTERS.sub("_", key).lstrip("/") or "_"


class Tracker:
    """One tracker's worker: calls run in its thread, in order; `describe` names it in warnings."""

    name = "tracker"

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.run_id = ""
        self.enabled = True
        self.dropped = 0
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(QUEUE_SIZE)
        self._thread = threading.Thread(target=self._work, name=f"syncseg-{self.name}", daemon=True)
        self._thread.start()

    def describe(self) -> str:
        return self.name

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            try:
                if task is None:
                    return
                if self.enabled:
                    task()
            except Exception as error:  # a tracker's fault never ends training
                self.disable(error)
            finally:
                self._queue.task_done()

    def disable(self, error: BaseException) -> None:
        if self.enabled:
            self.enabled = False
            logger.warning("%s: %s; logging to it is off for the rest of this run (metrics.jsonl has every record)",
                           self.describe(), one_line(error))

    def submit(self, task: Callable[[], None]) -> None:
        """Queue `task` for the worker; never blocks (a full queue drops it and counts)."""
        if not self.enabled:
            return
        try:
            self._queue.put_nowait(task)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("%s falls behind: %d records wait for it; records are dropped until it catches up "
                               "(metrics.jsonl has every record)", self.describe(), QUEUE_SIZE)

    def start_and_wait(self, start: Callable[[], None]) -> None:
        """Run `start` in the worker, waiting at most timeout_s; a start that does not finish by then disables
        the tracker (its thread is left to finish or fail on its own)."""
        done = threading.Event()

        def task() -> None:
            try:
                start()
            finally:
                done.set()

        self.submit(task)
        if not done.wait(self.timeout_s):
            self.disable(TimeoutError(f"no answer within log.timeout_s={self.timeout_s:g} s"))

    def log(self, values: list[tuple[str, float]], step: int) -> None:
        raise NotImplementedError

    def close(self, *, status: str, files: Mapping[str, Path]) -> None:
        """Send what is queued, then end the run with `status` (finished, failed, killed), waiting at most
        timeout_s in all; `files`: artifacts to upload first (name -> path), where the tracker takes them."""
        if self.enabled:
            self.submit(lambda: self.finish(status=status, files=files))
        self.submit_stop()
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            logger.warning("%s: what was queued was not all sent within log.timeout_s=%g s; the rest is left out "
                           "(metrics.jsonl has every record)", self.describe(), self.timeout_s)
        if self.dropped:
            logger.warning("%s: %d records were dropped while it fell behind", self.describe(), self.dropped)

    def submit_stop(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                self._queue.put(None, timeout=0.1)
                return
            except queue.Full:
                continue

    def finish(self, *, status: str, files: Mapping[str, Path]) -> None:
        raise NotImplementedError


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def flat_params(config_dict: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved config as {"section.key": "value"} strings (nested mappings joined with dots)."""
    params: dict[str, str] = {}
    for key, value in config_dict.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            params.update(flat_params(value, f"{name}."))
        else:
            params[name] = str(value)[:PARAM_LENGTH]
    return params


def _answers(uri: str, timeout_s: float) -> None:
    """Raise ConnectionError naming `uri` when an http(s) tracking server does not answer its health check."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
            response.read(64)
    except urllib.error.HTTPError:
        return  # it answered; the client's own calls say what it refuses
    except (OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise ConnectionError(f"tracking server {uri} does not answer ({one_line(reason)})") from None


class MlflowTracker(Tracker):
    """An MLflow run: params = the resolved config, metrics = metrics.jsonl's numbers, artifacts = config.yaml
    (at the start) and best.pt (at the end, with log.mlflow_checkpoint)."""

    name = "mlflow"

    def __init__(self, *, run_dir: Path, log_cfg: Any, run_name: str, params: Mapping[str, str],
                 resume_id: str | None) -> None:
        super().__init__(timeout_s=log_cfg.timeout_s)
        self.run_dir = Path(run_dir).resolve()
        self.uri = log_cfg.mlflow_uri or f"sqlite:///{self.run_dir / 'mlflow.db'}"
        self.experiment = log_cfg.mlflow_experiment or run_name
        self.upload_checkpoint = log_cfg.mlflow_checkpoint
        self.client: Any = None
        self.start_and_wait(lambda: self._start(run_name, params, resume_id))

    def describe(self) -> str:
        return f"MLflow ({self.uri})"

    def _start(self, run_name: str, params: Mapping[str, str], resume_id: str | None) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")  # its default retries for minutes
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, self.timeout_s))))
        _answers(self.uri, self.timeout_s)
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        run = None
        if resume_id:
            try:
                run = client.get_run(resume_id)
            except MlflowException:
                logger.warning("MLflow run %s (from last.pt) is not in %s; logging to a new run", resume_id, self.uri)
        if run is None:
            experiment = client.get_experiment_by_name(self.experiment)
            if experiment is None:
                default_store = not self.uri.startswith(("http://", "https://", "databricks"))
                location = (self.run_dir / "mlartifacts").as_uri() if default_store else None
                try:
                    experiment_id = client.create_experiment(self.experiment, artifact_location=location)
                except MlflowException:  # another run created it meanwhile
                    experiment_id = client.get_experiment_by_name(self.experiment).experiment_id
            else:
                experiment_id = experiment.experiment_id
            run = client.create_run(experiment_id, run_name=run_name, tags={"syncseg.run_dir": str(self.run_dir)})
            logged: dict[str, str] = {}
        else:
            client.update_run(run.info.run_id, status="RUNNING")
            logged = dict(run.data.params)
        self.run_id = run.info.run_id
        new = [Param(metric_key(key), value) for key, value in params.items() if metric_key(key) not in logged]
        changed = sorted(key for key, value in params.items() if logged.get(metric_key(key), value) != value)
        for index in range(0, len(new), BATCH):
            client.log_batch(self.run_id, params=new[index:index + BATCH])
        if changed:  # MLflow keeps a parameter's first value; the resumed one is a tag
            client.set_tag(self.run_id, "syncseg.resumed_with", ", ".join(f"{key}={params[key]}" for key in changed))
        config_file = self.run_dir / "config.yaml"
        if config_file.is_file():
            client.log_artifact(self.run_id, str(config_file))
        self.client = client
        logger.info("MLflow: run %s in experiment '%s' at %s", self.run_id, self.experiment, self.uri)

    def log(self, values: list[tuple[str, float]], step: int) -> None:
        stamp = int(time.time() * 1000)

        def send() -> None:
            from mlflow.entities import Metric

            metrics = [Metric(metric_key(key), value, stamp, step) for key, value in values]
            for index in range(0, len(metrics), 1000):
                self.client.log_batch(self.run_id, metrics=metrics[index:index + 1000])

        self.submit(send)

    def finish(self, *, status: str, files: Mapping[str, Path]) -> None:
        if self.upload_checkpoint:
            for name, path in files.items():
                if path.is_file():
                    self.client.log_artifact(self.run_id, str(path), artifact_path="checkpoints")
        self.client.set_terminated(self.run_id, status=status.upper())


class WandbTracker(Tracker):
    """A W&B run, offline unless WANDB_MODE is set: its files in <run dir>/wandb (`wandb sync` uploads them)."""

    name = "wandb"

    def __init__(self, *, run_dir: Path, log_cfg: Any, run_name: str, params: Mapping[str, str],
                 resume_id: str | None) -> None:
        super().__init__(timeout_s=log_cfg.timeout_s)
        self.run_dir = Path(run_dir).resolve()
        self.mode = os.environ.get("WANDB_MODE", "offline")
        self.run_id = resume_id or uuid.uuid4().hex[:8]  # known at once, so the first last.pt keeps it
        self.run: Any = None
        self.start_and_wait(lambda: self._start(run_name, params, log_cfg))

    def describe(self) -> str:
        return f"W&B ({self.mode}, {self.run_dir / 'wandb'})"

    def _start(self, run_name: str, params: Mapping[str, str], log_cfg: Any) -> None:
        import wandb

        settings = wandb.Settings(console="off", x_disable_stats=True, silent=True, init_timeout=self.timeout_s)
        self.run = wandb.init(project=log_cfg.wandb_project or "syncseg", entity=log_cfg.wandb_entity or None,
                              name=run_name, id=self.run_id, resume="allow", dir=str(self.run_dir),
                              mode=self.mode, config=dict(params), settings=settings, reinit="create_new")
        self.run.define_metric("iteration", hidden=True)
        self.run.define_metric("*", step_metric="iteration")
        logger.info("W&B: run %s (%s) in %s", self.run_id, self.mode, self.run_dir / "wandb")

    def log(self, values: list[tuple[str, float]], step: int) -> None:
        record = {"iteration": step, **dict(values)}
        self.submit(lambda: self.run.log(record))

    def finish(self, *, status: str, files: Mapping[str, Path]) -> None:
        self.run.finish(exit_code=0 if status == "finished" else 1)


TRACKERS = {"mlflow": MlflowTracker, "wandb": WandbTracker}


def start_trackers(log_cfg: Any, *, run_dir: Path, run_name: str, config_dict: Mapping[str, Any],
                   resume_ids: Mapping[str, str] | None) -> list[Tracker]:
    """The trackers log.loggers names (tensorboard is MetricsLog's own), started; one that cannot start is off
    with a warning (the list keeps it, disabled)."""
    params = flat_params(config_dict)
    trackers = []
    for name in log_cfg.loggers:
        if name in TRACKERS:
            trackers.append(TRACKERS[name](run_dir=run_dir, log_cfg=log_cfg, run_name=run_name, params=params,
                                           resume_id=(resume_ids or {}).get(name)))
    return trackers
