"""The run directory: who owns it, whether a run starts fresh or resumes, and that all ranks agree.

Rank 0 holds an exclusive lock on `<run dir>/.lock` for the whole run (flock: the OS releases it when
the process dies, so a killed run never leaves a stale lock). Rank 0 alone decides what is resumed and
broadcasts the decision; every other rank then loads that checkpoint from the shared run dir and
checks it holds the same run and iteration, so a run dir that is not on shared storage stops the run
with one line instead of letting the replicas drift apart.

Fresh or resumed:
- `--resume PATH` resumes PATH; `--resume auto` resumes <run dir>/last.pt when it exists.
- Under torchelastic (torchrun sets TORCHELASTIC_RUN_ID) a run dir holding last.pt is resumed without
  being asked: that is how a restarted worker, or a requeued job, continues.
- Otherwise a run dir that holds checkpoints is refused (nothing is silently replaced) unless
  `--overwrite` is given, which deletes them first.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from syncseg.engine.checkpoint_file import RESUME_KEYS, load_checkpoint, peek_checkpoint
from syncseg.engine.config import Config, DistConfig
from syncseg.engine.config import build_config, from_dict, load_config, parse_overrides, to_dict
from syncseg.engine.distributed import DistInfo, broadcast_object, is_dist
from syncseg.engine.trackers import require_trackers
from syncseg.engine.atomic import TEMPORARY_SUFFIX
from syncseg.engine.object_store import join, local_copy
from syncseg.engine.remote_run_dir import RemoteRunDir

logger = logging.getLogger(__name__)

CHECKPOINT_NAMES = ("last.pt", "best.pt")
LOCK_NAME = ".lock"


class RunDirBusyError(ValueError):
    """Another training holds the run directory."""


class RunDirLock:
    """An exclusive, non-blocking flock on run_dir/.lock, recording who holds it."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._file: Any = None

    def acquire(self) -> "RunDirLock":
        for folder in (self.run_dir, *self.run_dir.parents):  # a file in the way is bad input, not a failure
            if folder.exists():
                if not folder.is_dir():
                    raise ValueError(f"run dir '{self.run_dir}': '{folder}' is a file, not a folder; set output_dir= "
                                     "to a folder (it is created if missing)")
                break
        self.run_dir.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "unknown process"
            file.close()
            raise RunDirBusyError(f"run dir '{self.run_dir}' is in use by another training ({holder}); wait for it "
                                  "to finish, stop it, or set output_dir= to another folder") from None
        file.seek(0)
        file.truncate()
        started = datetime.datetime.now().isoformat(timespec="seconds")
        file.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {started}\n")
        file.flush()
        self._file = file
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None


@dataclass
class RunPlan:
    """What train.py runs: the config, the checkpoint payload to resume (None: fresh), the run's id, its
    command-line overrides and, on rank 0, the held lock."""

    config: Config
    resume: dict[str, Any] | None
    run_id: str
    overrides: dict[str, str]  # every KEY=VALUE this run was given, first launch and resumes (saved with it)
    lock: RunDirLock | None = None
    remote: RemoteRunDir | None = None  # rank 0 of a run dir on object storage: its uploader and lease

    def release(self) -> None:
        """Wait for the last upload (a run dir on object storage), then give the run dir up."""
        try:
            if self.remote is not None:
                self.remote.close()
        finally:
            if self.lock is not None:
                self.lock.release()


def _config_differences(file_config: Config, resumed: Config, limit: int = 3) -> list[str]:
    ours, theirs = to_dict(file_config), to_dict(resumed)
    found = []
    for section, values in ours.items():
        if isinstance(values, dict):
            found += [f"{section}.{key} ({values[key]!r} in the file, {theirs[section][key]!r} in the checkpoint)"
                      for key in values if values[key] != theirs[section][key]]
        elif values != theirs[section]:
            found.append(f"{section} ({values!r} in the file, {theirs[section]!r} in the checkpoint)")
    return found[:limit]


def remove_orphaned_temporaries(run_dir: Path) -> list[Path]:
    """Delete the temporary files of saves that were killed before their rename (call with the lock held)."""
    removed = []
    for name in CHECKPOINT_NAMES:
        for path in run_dir.glob(f".{name}.*{TEMPORARY_SUFFIX}"):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        logger.warning("removed %d temporary file(s) of interrupted saves in %s", len(removed), run_dir)
    return removed


class ConfigSource:
    """Where a run's config comes from: a --config file (a shipped config's name or a path) or a Config
    built in Python (syncseg.train); None when a resume takes the checkpoint's. `load(overrides)` reads and
    validates it once per list of overrides, however many steps of the plan ask."""

    def __init__(self, given: str | Path | Config | None) -> None:
        self.given = given
        self._loaded: dict[tuple[str, ...], Config] = {}

    def __bool__(self) -> bool:
        return self.given is not None

    def __str__(self) -> str:
        return "the given config" if isinstance(self.given, Config) else f"--config {self.given}"

    def load(self, overrides: list[str] | tuple[str, ...]) -> Config:
        key = tuple(overrides)
        if key not in self._loaded:
            if isinstance(self.given, Config):
                self._loaded[key] = build_config(parse_overrides(overrides), source="command line", base=self.given)
            else:
                self._loaded[key] = load_config(self.given, overrides)
        return self._loaded[key]


ConfigGiven = ConfigSource | Config | str | Path | None


def _as_source(given: ConfigGiven) -> ConfigSource:
    return given if isinstance(given, ConfigSource) else ConfigSource(given)


def _require_config(source: ConfigSource, resume: str | None) -> None:
    if not source and resume in (None, "auto"):
        raise ValueError("--config is required (or --resume PATH to continue a run from its checkpoint)")


def _on_checkpoint(overrides: dict[str, str], saved_config: dict[str, Any], path: Path | str) -> Config:
    """What a resume runs: the checkpoint's config with the command line's KEY=VALUE overrides on top."""
    return build_config(overrides, source="command line", base=from_dict(saved_config, source=str(path)))


@dataclass
class _Decision:
    """What rank 0 decided: the config, the run's command-line overrides so far, the checkpoint to resume
    (None: fresh) and its payload, the held lock, and the run dir's store side."""

    config: Config
    overrides: dict[str, str]
    path: Path | None
    payload: dict[str, Any] | None
    lock: RunDirLock
    remote: RemoteRunDir | None


def _decide(source: ConfigSource, resume: str | None, overrides: list[str], *, overwrite: bool,
            elastic: bool) -> _Decision:
    """Rank 0: lock (and for a URL lease and download) the run dir, then decide fresh or resume."""
    _require_config(source, resume)
    current = parse_overrides(overrides)
    file_config = source.load(overrides) if source else None
    path = local_copy(resume) if resume not in (None, "auto") else None
    payload = None
    if path is not None:
        payload = load_checkpoint(path, required_keys=RESUME_KEYS)
        where = _on_checkpoint(current, payload["config"], resume)
    else:
        where = file_config
    run_dir = where.run_dir
    remote = RemoteRunDir(where.run_url, run_dir, timeout_s=where.log.timeout_s) if where.run_url else None
    if remote is not None:
        remote.check_writable()  # a missing bucket or bad credentials: refused before anything else
    lock = RunDirLock(run_dir).acquire()
    try:
        if remote is not None:
            remote.acquire_lease()
            remote.pull()
        found = _resume_or_fresh(source, resume, current=current, file_config=file_config, path=path,
                                 payload=payload, overwrite=overwrite, elastic=elastic, run_dir=run_dir, remote=remote)
        return _Decision(*found, lock=lock, remote=remote)
    except BaseException:
        if remote is not None:
            remote.release_lease()
        lock.release()
        raise


def _resume_or_fresh(source: ConfigSource, resume: str | None, *, current: dict[str, str],
                     file_config: Config | None, path: Path | None, payload: dict[str, Any] | None, overwrite: bool,
                     elastic: bool, run_dir: Path, remote: RemoteRunDir | None) -> tuple[Config, dict[str, str], Path | None, dict[str, Any] | None]:
    """(config, overrides, checkpoint path or None, payload), with the run dir held."""
    last = run_dir / "last.pt"
    if path is None and last.is_file() and (resume == "auto" or elastic):
        path, payload = last, load_checkpoint(last, required_keys=RESUME_KEYS)
    if path is None:
        require_trackers(file_config.log.loggers)  # before --overwrite deletes anything
        existing = [name for name in CHECKPOINT_NAMES if (run_dir / name).is_file()]
        if existing and not overwrite:
            held = peek_checkpoint(run_dir / existing[0]) or {}
            where = remote.url if remote is not None else run_dir
            raise ValueError(
                f"run dir '{where}' already holds a run ({', '.join(existing)}, iteration "
                f"{held.get('iteration', '?')}); continue it with --resume auto, write elsewhere with "
                "output_dir=..., or replace it with --overwrite")
        for name in existing:
            (run_dir / name).unlink()
            logger.warning("--overwrite: deleted %s", run_dir / name)
            if remote is not None:
                remote.remove(name)
        remove_orphaned_temporaries(run_dir)
        return file_config, current, None, None
    config = _on_checkpoint(current, payload["config"], path)
    run_overrides = {**dict(payload.get("overrides") or {}), **current}
    if file_config is not None and "overrides" in payload:
        # the file with every override this run was given must still give the saved config
        from_file = source.load([f"{key}={value}" for key, value in run_overrides.items()])
        if from_file != config:
            raise ValueError(
                f"{source} has changed since '{path}' was saved: "
                f"{'; '.join(_config_differences(from_file, config))}; to change a setting of a resumed run "
                "give it as KEY=VALUE on the command line (or resume with --resume PATH alone)")
    remove_orphaned_temporaries(run_dir)
    require_trackers(config.log.loggers)
    return config, run_overrides, path, payload


def _best_so_far(run_dir: Path, payload: dict[str, Any]) -> float:
    """The run's best mIoU: last.pt's, or best.pt's when best.pt was saved after last.pt at the same
    iteration (the checkpoint is written before the validation that may improve on it)."""
    best = peek_checkpoint(run_dir / "best.pt") or {}
    value = float(payload["best_miou"])
    if best.get("run_id") == payload.get("run_id") and int(best.get("iteration", -1)) <= int(payload["iteration"]):
        value = max(value, float(best.get("best_miou", value)))
    return value


def resolved_config(given: ConfigGiven, resume: str | None, overrides: list[str]) -> tuple[Config, str]:
    """(the config a train.py command line would run, where it comes from), without locking or
    loading tensors: `--resume PATH` or `--resume auto` with an existing last.pt give that
    checkpoint's config with the overrides on top, as a resume does; else the --config file with its
    base chain and the overrides, every other key at its default. Raises ValueError /
    FileNotFoundError as train.py would."""
    source = _as_source(given)
    _require_config(source, resume)
    path = local_copy(resume) if resume not in (None, "auto") else None
    if path is None:
        config = source.load(overrides)
        last = config.run_dir / "last.pt"
        if config.run_url and resume == "auto":  # the store holds the run; the staging folder may be stale
            try:
                last = local_copy(join(config.run_url, "last.pt"))
            except FileNotFoundError:
                last = Path("/nonexistent")
        if resume != "auto" or not last.is_file():
            return config, f"{source}" + (f" with {' '.join(overrides)}" if overrides else "")
        path = last
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' not found (expected a .pt file written by train.py)")
    saved = peek_checkpoint(path)
    if not saved or "config" not in saved:
        raise ValueError(f"checkpoint '{path}' could not be read (truncated, corrupt, or not a syncseg checkpoint)")
    config = _on_checkpoint(parse_overrides(overrides), saved["config"], path)
    return config, f"resuming {path} (iteration {saved.get('iteration', '?')})" + (
        f" with {' '.join(overrides)}" if overrides else "")


def dist_timeout(given: ConfigGiven, resume: str | None, overrides: list[str]) -> float:
    """dist.timeout_s of the run about to start, read before the process group exists (errors in the
    files are reported later, by plan_run, on rank 0). Pass plan_run the same ConfigSource: it is read once."""
    source = _as_source(given)
    try:
        if source:
            return source.load(overrides).dist.timeout_s
        saved = peek_checkpoint(resume) if resume not in (None, "auto") else None
        if saved and "config" in saved:
            return _on_checkpoint(parse_overrides(overrides), saved["config"], resume).dist.timeout_s
    except (ValueError, FileNotFoundError):
        pass
    return DistConfig().timeout_s


def plan_run(given: ConfigGiven, resume: str | None, overrides: list[str], *, dist_info: DistInfo,
             overwrite: bool = False) -> RunPlan:
    """Decide (rank 0) and agree (every rank) on the config and the checkpoint to resume.

    Raises ValueError / FileNotFoundError with one line on every rank when the run cannot start: the run
    dir is busy or holds another run, the --config disagrees with the resumed checkpoint, or a rank
    cannot see the checkpoint rank 0 resumes ("storage must be shared").
    """
    decision: dict[str, Any] = {}
    lock = remote = None
    if dist_info.is_main:
        try:
            decided = _decide(_as_source(given), resume, overrides, overwrite=overwrite,
                              elastic=dist_info.launch.elastic)
            config, path, payload, lock, remote = (decided.config, decided.path, decided.payload, decided.lock,
                                                   decided.remote)
            decision = {"config": to_dict(config), "overrides": decided.overrides, "path": str(path) if path else None}
            if remote is not None and path == config.run_dir / "last.pt":
                decision["stored"] = join(remote.url, "last.pt")  # where a rank on another machine finds it
            if payload is not None:
                payload["best_miou"] = _best_so_far(config.run_dir, payload)
                decision.update(iteration=int(payload["iteration"]), run_id=payload.get("run_id", ""),
                                best_miou=payload["best_miou"])
            decision["new_run_id"] = uuid.uuid4().hex
        except (ValueError, FileNotFoundError) as error:
            decision = {"error": str(error), "error_type": type(error).__name__}
    decision = broadcast_object(decision)
    if "error" in decision:
        raise (FileNotFoundError if decision["error_type"] == "FileNotFoundError" else ValueError)(decision["error"])
    config = from_dict(decision["config"])
    if dist_info.is_main:
        resumed = payload
    else:
        resumed = _load_on_this_rank(decision, config, dist_info.rank)
    if is_dist():
        problems = [None] * dist_info.world_size
        dist.all_gather_object(problems, resumed if isinstance(resumed, str) else None)
        failure = next((problem for problem in problems if problem), None)
        if failure:
            RunPlan(config=config, resume=None, run_id="", overrides={}, lock=lock, remote=remote).release()
            raise ValueError(failure)
    if resumed is not None:
        resumed["best_miou"] = decision["best_miou"]
        resumed["path"] = decision["path"]  # for messages; a checkpoint's own keys are rebuilt at each save
        logger.info("resuming %s at iteration %d", decision["path"], decision["iteration"])
    run_id = decision.get("run_id") or decision["new_run_id"]
    return RunPlan(config=config, resume=resumed, run_id=run_id, overrides=decision["overrides"], lock=lock,
                   remote=remote)


def _load_on_this_rank(decision: dict[str, Any], config: Config, rank: int) -> dict[str, Any] | str | None:
    """The payload rank 0 chose, from this rank's view of the run dir; an error line when it differs."""
    if decision["path"] is None:
        return None
    def mismatch(problem: str) -> str:
        return (f"rank 0 resumes '{decision['path']}' at iteration {decision['iteration']}, but rank {rank} {problem}; "
                f"the run dir ({config.run_dir}) must be on storage shared by all nodes")

    def matches(payload: dict[str, Any]) -> bool:
        return int(payload["iteration"]) == decision["iteration"] and payload.get("run_id", "") == decision["run_id"]

    if "stored" in decision:  # a run dir on object storage: this machine's staged copy (rank 0's when they share
        with contextlib.suppress(ValueError, FileNotFoundError):  # the cache) when it is that one, else the store's
            payload = load_checkpoint(config.run_dir / "last.pt", required_keys=RESUME_KEYS)
            if matches(payload):
                return payload
        path = decision["stored"]
    else:
        path = decision["path"]
    try:
        payload = load_checkpoint(local_copy(path), required_keys=RESUME_KEYS)
    except (ValueError, FileNotFoundError) as error:
        return mismatch(f"cannot read it ({error})")
    if not matches(payload):
        return mismatch(f"finds a checkpoint of iteration {payload['iteration']} there")
    return payload
