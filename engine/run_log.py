"""What a run reports: metrics.jsonl, TensorBoard scalars and image grids, throughput, progress lines.

Only rank 0 writes (`enabled`). metrics.jsonl holds one JSON object per logged step:
{"type": "train" | "val", "iteration": N, ...the scalars...}.
"""
from __future__ import annotations

import contextlib
import json
import logging
import resource
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from tqdm import tqdm

from data import palette_image
from data.transforms import normalize_batch
from engine.inference import predict

logger = logging.getLogger(__name__)


class MetricsLog:
    """TensorBoard scalars/images plus metrics.jsonl in `run_dir`.

    A fresh run (`resume_iteration` None) starts metrics.jsonl and the TensorBoard steps over; a
    resumed one keeps what was logged up to `resume_iteration` and drops the rest (what a killed run
    logged after the checkpoint it resumes from).
    """

    def __init__(self, run_dir: Path, *, enabled: bool, resume_iteration: int | None = None) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        self.run_dir = run_dir
        self._purge_step = resume_iteration + 1 if resume_iteration is not None else 0
        if not enabled:
            return
        if resume_iteration is None:
            self.path.write_text("")
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
            self.path.write_text("".join(line + "\n" for line in kept))
        self._open()

    def _open(self) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # heavy import, only where logs are written

            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=self._purge_step)
            self._purge_step = None
        return self.writer

    def scalars(self, record: dict[str, Any], *, step: int, prefix: str) -> None:
        if not self.enabled:
            return
        for key, value in flat_numbers(record):
            self._open().add_scalar(f"{prefix}/{key}", value, step)
        with self.path.open("a") as file:
            file.write(json.dumps({"type": prefix, "iteration": step, **record}) + "\n")

    def image(self, tag: str, image: np.ndarray, *, step: int) -> None:
        if self.enabled:
            self._open().add_image(tag, image, step, dataformats="HWC")

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


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


@contextlib.contextmanager
def progress_bar(*, enabled: bool, total: int, initial: int) -> Iterator[Any]:
    """A tqdm bar on stderr when `enabled` (rank 0 in a terminal), else None; closed on exit."""
    if not enabled:
        yield None
        return
    bar = tqdm(total=total, initial=initial, dynamic_ncols=True, desc="train")
    try:
        yield bar
    finally:
        bar.close()


@torch.no_grad()
def prediction_grid(model: torch.nn.Module, dataset: Any, indices: Sequence[int], *, num_classes: int,
                    device: torch.device, data_cfg: Any, eval_cfg: Any) -> np.ndarray:
    """image | truth | prediction, one row per dataset index, predicted as evaluation does (eval mode)."""
    palette = np.asarray(dataset.palette, dtype=np.uint8)
    rows = []
    for index in indices:
        image, mask = dataset[index]
        batch = normalize_batch(image.unsqueeze(0).to(device), data_cfg.mean, data_cfg.std)
        logits = predict(model, batch, num_classes=num_classes, mode=eval_cfg.mode, window_size=eval_cfg.window_size,
                         stride=eval_cfg.stride)
        prediction = logits.argmax(1)[0].cpu().numpy().astype(np.uint8)
        rows.append([image.permute(1, 2, 0).numpy()] + [
            np.asarray(palette_image(labels.astype(np.uint8), palette).convert("RGB"))
            for labels in (mask.numpy(), prediction)])
    return image_grid(rows)


def image_grid(rows: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """H x W x 3 uint8 panels side by side per row, rows stacked; shorter rows padded black on the right."""
    joined = [np.concatenate(list(panels), axis=1) for panels in rows]
    width = max(row.shape[1] for row in joined)
    joined = [np.pad(row, ((0, 0), (0, width - row.shape[1]), (0, 0))) for row in joined]
    return np.concatenate(joined, axis=0)
