"""What a run reports: metrics.jsonl, TensorBoard scalars, text and images, the trackers' metrics (MLflow, W&B:
syncseg.engine.trackers), throughput, progress lines.

Only rank 0 writes (`enabled`). metrics.jsonl holds one JSON object per logged step:
{"type": "train" | "val", "iteration": N, ...the scalars...}. The TensorBoard event files sit in the
run dir itself, so `tensorboard --logdir runs/` lists each run by its folder name. Values that do not
change during a run (NOT_PLOTTED) stay in metrics.jsonl only: a card with a flat line says nothing.
Each validation also writes a `val/summary` text card, the exact numbers (TensorBoard's scalar
charts smooth by default; docs/training.md: open them with ?smoothing=0).

A failed write (a full disk) is an OSError naming the file: metrics.jsonl's, or the event files' folder
(TensorBoard writes from a thread of its own and hands its error to the next call here; its thread's
traceback is not printed). The resume's rewrite of metrics.jsonl is atomic, so a full disk there leaves
the old file whole.
"""
from __future__ import annotations

import contextlib
import json
import logging
import resource
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from syncseg.engine.atomic import write_atomically

logger = logging.getLogger(__name__)

NOT_PLOTTED = frozenset({"val/num_images"})  # constant over a run: metrics.jsonl only
LEGACY_TENSORBOARD_DIR = "tensorboard"  # where runs written before events moved to the run dir keep them
VAL_SCALARS = ("miou", "pixel_acc", "mean_acc", "fwiou", "num_images")


class MetricsLog:
    """TensorBoard scalars/images (unless `tensorboard` is False) plus metrics.jsonl in `run_dir`, and every scalar
    handed to the `trackers` (syncseg.engine.trackers; they queue it, never blocking).

    A fresh run (`resume_iteration` None) starts metrics.jsonl and the TensorBoard steps over; a
    resumed one keeps what was logged up to `resume_iteration` and drops the rest (what a killed run
    logged after the checkpoint it resumes from).
    """

    def __init__(self, run_dir: Path, *, enabled: bool, resume_iteration: int | None = None, tensorboard: bool = True,
                 trackers: Sequence[Any] = ()) -> None:
        self.enabled = enabled
        self.tensorboard = tensorboard
        self.trackers = list(trackers)
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        self.run_dir = run_dir
        self._purge_step = resume_iteration + 1 if resume_iteration is not None else 0
        if not enabled:
            return
        if resume_iteration is None:
            write_atomically(self.path, lambda file: None, what="metrics log")
        elif self.path.is_file():
            kept = []
            for number, line in enumerate(self.path.read_text().splitlines(), 1):
                try:
                    record = json.loads(line) if line.strip() else None
                except json.JSONDecodeError:  # a write cut short when the process was killed
                    logger.warning("%s: line %d is not a JSON record (a write cut short?); dropped", self.path, number)
                    continue
                if record is not None and record.get("iteration", 0) <= resume_iteration:
                    kept.append(line)
            text = "".join(line + "\n" for line in kept).encode()
            write_atomically(self.path, lambda file: file.write(text), what="metrics log")
        if tensorboard:
            self._open()

    def _open(self) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # heavy import, only where logs are written

            _quiet_tensorboard_thread_errors()
            with self._naming_events_dir():
                self.writer = SummaryWriter(log_dir=str(self.events_dir()), purge_step=self._purge_step)
            self._purge_step = None
        return self.writer

    @contextlib.contextmanager
    def _events(self) -> Iterator[Any]:
        """The TensorBoard writer, its errors naming the event folder."""
        writer = self._open()
        with self._naming_events_dir():
            yield writer

    @contextlib.contextmanager
    def _naming_events_dir(self) -> Iterator[None]:
        """An OSError of TensorBoard's writer (raised here or handed over from its thread) as one naming
        the folder of the event files."""
        try:
            yield
        except OSError as error:
            if error.errno is None:
                raise
            raise OSError(error.errno, f"could not write TensorBoard events in '{self.events_dir()}': "
                          f"{error.strerror or error}") from None

    def events_dir(self) -> Path:
        """The run dir; for a resumed run whose earlier events are in run_dir/tensorboard, that folder
        (so its history stays one run in TensorBoard, and the resume purge applies to it)."""
        legacy = self.run_dir / LEGACY_TENSORBOARD_DIR
        if self._purge_step != 0 and legacy.is_dir() and any(legacy.glob("events.out.tfevents.*")):
            return legacy
        return self.run_dir

    def scalars(self, record: dict[str, Any], *, step: int, prefix: str) -> None:
        """Append `record` to metrics.jsonl and plot its numbers as `prefix/key` (NOT_PLOTTED left out)."""
        if not self.enabled:
            return
        line = json.dumps({"type": prefix, "iteration": step, **record}) + "\n"
        try:  # a line cut short by a full disk is dropped on resume like a killed process's
            with self.path.open("a") as file:
                file.write(line)
        except OSError as error:
            raise OSError(error.errno, f"could not append to '{self.path}': {error.strerror or error}") from None
        values = [(f"{prefix}/{key}", value) for key, value in flat_numbers(record)
                  if f"{prefix}/{key}" not in NOT_PLOTTED]
        for tracker in self.trackers:
            tracker.log(values, step)
        if self.tensorboard:
            with self._events() as writer:
                for key, value in values:
                    writer.add_scalar(key, value, step)

    def validation(self, metrics: Mapping[str, Any], *, classes: Sequence[str], step: int) -> None:
        """Log evaluate()'s `metrics` as `val` scalars (per-class IoU under val/iou/<class>) and the
        `val/summary` text card."""
        record = {key: metrics[key] for key in VAL_SCALARS if key in metrics}
        record["iou"] = {name: value for name, value in zip(classes, metrics["iou"]) if value is not None}
        self.scalars(record, step=step, prefix="val")
        if self.enabled and self.tensorboard:
            with self._events() as writer:
                writer.add_text("val/summary", validation_markdown(metrics, classes=classes, step=step), step)

    def image(self, tag: str, image: np.ndarray, *, step: int) -> None:
        if self.enabled and self.tensorboard:
            with self._events() as writer:
                writer.add_image(tag, image, step, dataformats="HWC")

    def flush(self) -> None:
        if self.writer is not None:
            with self._naming_events_dir():
                self.writer.flush()

    @contextlib.contextmanager
    def flushed_at_exit(self) -> Iterator[None]:
        """Flush the TensorBoard events when the block ends; after an error, without letting a failed
        flush (the same full disk, say) replace the error that ended it."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(OSError):
                self.flush()
            raise
        self.flush()

    def tracker_ids(self) -> dict[str, str]:
        """Each started tracker's run id by its name (last.pt's `trackers`: a resume continues those runs)."""
        return {tracker.name: tracker.run_id for tracker in self.trackers if tracker.run_id}

    def close(self, *, status: str = "finished", files: Mapping[str, Path] | None = None) -> None:
        """End the trackers' runs with `status` (finished, failed, killed; `files`: artifacts such as best.pt,
        name -> path) and close the event files. Never raises an OSError: it runs however training ended, also
        after the error that stopped it; a failure to write the last events is a warning."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close(status=status, files=files or {})
        if self.writer is None:
            return
        writer, self.writer = self.writer, None
        try:
            with self._naming_events_dir():
                writer.close()
        except OSError as error:
            logger.warning("%s; the last TensorBoard points may be missing (metrics.jsonl has them)",
                           error.strerror or error)


def _quiet_tensorboard_thread_errors() -> None:
    """Leave out the traceback TensorBoard's writer thread prints when a write fails: the thread hands the
    error to the next add_*/flush call, which reports it as one line (MetricsLog._naming_events_dir)."""
    previous = threading.excepthook
    if getattr(previous, "_syncseg_quiet_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        module = type(args.thread).__module__ if args.thread is not None else ""
        if module.startswith("tensorboard.") and args.exc_type is not None and issubclass(args.exc_type, OSError):
            return
        previous(args)

    hook._syncseg_quiet_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def flat_numbers(record: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """("a/b", value) for every number in a nested record (None, bools and strings left out)."""
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flat_numbers(value, f"{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
            yield name, float(value)


class Throughput:
    """Images per second and the share of wall time spent waiting for data, over one logging window,
    plus the time per iteration since the run (this fit) started, for the ETA."""

    def __init__(self, iteration: int) -> None:
        self.run_start = self.window_start = time.perf_counter()
        self.run_start_iteration = iteration
        self.images = 0
        self.data_seconds = 0.0

    def add(self, *, images: int, data_seconds: float) -> None:
        self.images += images
        self.data_seconds += data_seconds

    def window(self) -> tuple[float, float]:
        """(images per second, data-wait fraction) since the last call; starts the next window."""
        now = time.perf_counter()
        elapsed = max(now - self.window_start, 1e-9)
        rates = self.images / elapsed, self.data_seconds / elapsed
        self.window_start, self.images, self.data_seconds = now, 0, 0.0
        return rates

    def eta_seconds(self, iteration: int, stop_at: int) -> float:
        done = max(1, iteration - self.run_start_iteration)
        return (time.perf_counter() - self.run_start) / done * (stop_at - iteration)


class Stopwatch:
    """Context manager that adds the seconds spent inside it to `seconds`, however the block ends."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> "Stopwatch":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds += time.perf_counter() - self._start


def training_record(losses: Mapping[int, float], *, iteration: int, interval: int, scheduler: Any, optimizer: Any,
                    throughput: Throughput, device: torch.device) -> dict[str, Any]:
    """The `train` record logged after step `iteration`: the mean loss of the last `interval` steps (those in
    `losses`), each parameter group's rate the step used, images/s and data wait (throughput.window(), which
    starts the next window), peak memory."""
    recent = [losses[i] for i in range(iteration - interval + 1, iteration + 1) if i in losses]
    factor = scheduler.factor(iteration - 1)  # the rate the last step used
    images_per_s, data_wait = throughput.window()
    return {
        "loss": sum(recent) / max(1, len(recent)),
        "lr": {group["name"]: group["initial_lr"] * factor for group in optimizer.param_groups},
        "images_per_s": images_per_s,
        "data_wait_fraction": data_wait,
        "peak_memory_mb": peak_memory_mb(device),
    }


def log_training(log: MetricsLog, record: dict[str, Any], *, iteration: int, stop_at: int, eta: float, bar: Any,
                 line_logger: logging.Logger | None) -> None:
    """Log a `train` record (training_record) at `iteration`: metrics.jsonl and TensorBoard, and the progress bar's
    loss and rate, or without a bar one progress_line to `line_logger` (the loop's; None on the other ranks)."""
    log.scalars(record, step=iteration, prefix="train")
    if bar is not None:
        bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{next(iter(record['lr'].values()), 0.0):.2e}")
    elif line_logger is not None:
        line_logger.info("%s", progress_line(record, iteration=iteration, stop_at=stop_at, eta=eta))


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def format_seconds(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def progress_line(record: Mapping[str, Any], *, iteration: int, stop_at: int, eta: float) -> str:
    """One log line for a `train` record (loss, first group's lr, images/s, data wait, ETA)."""
    first_lr = next(iter(record["lr"].values()), 0.0)
    return (f"iter {iteration}/{stop_at}  loss {record['loss']:.4f}  lr {first_lr:.2e}  "
            f"{record['images_per_s']:.1f} img/s  data wait {100 * record['data_wait_fraction']:.0f}%  "
            f"eta {format_seconds(eta)}")


def validation_markdown(metrics: Mapping[str, Any], *, classes: Sequence[str], step: int) -> str:
    """The summary numbers and the per-class IoU of one validation as Markdown tables (n/a: a class
    absent from truth and prediction)."""
    def cell(value: Any) -> str:
        return f"{100 * value:.2f}" if isinstance(value, (int, float)) and value == value else "n/a"

    lines = [f"**iteration {step}**, {metrics.get('num_images', '?')} images", "", "| metric | % |", "|---|---:|"]
    lines += [f"| {label} | {cell(metrics.get(key))} |" for label, key in
              (("mIoU", "miou"), ("pixel accuracy", "pixel_acc"), ("mean accuracy", "mean_acc"),
               ("frequency-weighted IoU", "fwiou"))]
    lines += ["", "| class | IoU % |", "|---|---:|"]
    lines += [f"| {name} | {cell(value)} |" for name, value in zip(classes, metrics.get("iou", []))]
    return "\n".join(lines)


@contextlib.contextmanager
def progress_bar(*, enabled: bool, total: int, initial: int, desc: str = "train") -> Iterator[Any]:
    """A tqdm bar on stderr when `enabled` (rank 0 in a terminal), else None; closed on exit. While
    the bar is shown, log records go through tqdm.write (logging_redirect_tqdm), so a log line is
    printed above the bar instead of being written into it."""
    if not enabled:
        yield None
        return
    with logging_redirect_tqdm():
        bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc=desc)
        try:
            yield bar
        finally:
            bar.close()
