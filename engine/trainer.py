"""The training loop: loss, optimizer, poly LR with warmup, AMP, data order, checkpoints, logging.

`Trainer(config, dist_info).fit()` trains `config.train.iters` optimizer steps. Exact resume: the data
order of an epoch is a permutation drawn from (train.seed, epoch), every sample's augmentation is
seeded from that same draw (independent of the worker or process that loads it), DataLoaders use their
own generators (never the global RNG), and the checkpoint holds the model, optimizer, scheduler, scaler,
iteration and every RNG state. A run stopped at iteration K and resumed therefore computes the same
losses as an uninterrupted run.

Under DDP the loss is normalized by the number of valid pixels of the *global* batch, so N processes
compute the gradient of the same objective as one process on the same global batch.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import random
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from engine.checkpoint import FORMAT_VERSION, RESUME_KEYS, load_checkpoint, save_checkpoint
from engine.config import Config, save_config, to_dict
from engine.distributed import DistInfo, all_reduce_sum, barrier, is_dist
from engine.evaluate import ShardSampler, autocast_for, evaluate  # validation = eval.py's loop and non-padding shards

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- loss
class SegmentationLoss(nn.Module):
    """Pixel-wise cross-entropy with ignore_index, optional class weights, OHEM and an aux head.

    `terms(outputs, target)` returns, per head ("out", "aux"), the pair (sum of per-pixel losses,
    sum of per-pixel weights); dividing the first by the second gives the weighted mean that
    `F.cross_entropy(..., weight=w, ignore_index=i)` computes. The split lets the trainer normalize by
    the global batch under DDP. `forward` returns the local scalar loss: out + aux_weight * aux.
    OHEM keeps the pixels whose true-class probability is below `ohem_thresh`, and at least the
    `ohem_min_kept` hardest ones.
    """

    def __init__(
        self,
        *,
        ignore_index: int = 255,
        class_weights: Sequence[float] | None = None,
        ohem: bool = False,
        ohem_thresh: float = 0.7,
        ohem_min_kept: int = 100000,
        aux_weight: float = 0.4,
    ) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        weights = torch.tensor(list(class_weights), dtype=torch.float32) if class_weights else None
        self.register_buffer("class_weights", weights, persistent=False)
        self.ohem = ohem
        self.ohem_thresh = ohem_thresh
        self.ohem_min_kept = ohem_min_kept
        self.aux_weight = aux_weight

    def head_terms(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, weight sum) for logits N x C x H x W (any float dtype) and target N x H x W."""
        logits = logits.float()
        num_classes = logits.shape[1]
        weights = self.class_weights
        if weights is not None:
            if weights.numel() != num_classes:
                raise ValueError(f"train.class_weights has {weights.numel()} values but the model predicts "
                                 f"{num_classes} classes")
            weights = weights.to(logits.device)
        valid = target != self.ignore_index
        safe_target = torch.where(valid, target, torch.zeros_like(target))
        if target.device.type == "cpu":  # on CUDA this check would synchronize every step
            low, high = torch.aminmax(safe_target)
            if low < 0 or high >= num_classes:
                bad = low.item() if low < 0 else high.item()
                raise ValueError(f"mask value {bad} is not a class index in 0..{num_classes - 1} "
                                 f"nor ignore_index={self.ignore_index}")
        losses = F.cross_entropy(logits, target, weight=weights, ignore_index=self.ignore_index, reduction="none")
        pixel_weight = weights[safe_target] * valid if weights is not None else valid.to(losses.dtype)
        if self.ohem:
            keep = self._ohem_keep(logits.detach(), safe_target, valid)
            losses = losses * keep
            pixel_weight = pixel_weight * keep
        return losses.sum(), pixel_weight.sum()

    def _ohem_keep(self, logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        probability = logits.softmax(dim=1).gather(1, target.unsqueeze(1)).squeeze(1)
        probability = torch.where(valid, probability, torch.full_like(probability, 2.0))
        threshold = torch.tensor(self.ohem_thresh, device=logits.device)
        num_valid = int(valid.sum())
        if self.ohem_min_kept > 0 and num_valid > 0:
            kth = min(self.ohem_min_kept, num_valid)
            kth_value = probability.flatten().kthvalue(kth).values
            threshold = torch.maximum(threshold, kth_value)
        # `<=` keeps the min_kept-th pixel itself; ties at the threshold are kept too.
        return (valid & (probability <= threshold)).to(logits.dtype)

    def terms(self, outputs: Mapping[str, torch.Tensor], target: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        heads = {"out": outputs["out"]}
        if "aux" in outputs:  # even at weight 0: DDP expects a gradient for every parameter
            heads["aux"] = outputs["aux"]
        return {name: self.head_terms(logits, target) for name, logits in heads.items()}

    def head_factor(self, name: str) -> float:
        return 1.0 if name == "out" else self.aux_weight

    def forward(self, outputs: Mapping[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=target.device)
        for name, (loss_sum, weight_sum) in self.terms(outputs, target).items():
            total = total + self.head_factor(name) * _safe_divide(loss_sum, weight_sum)
        return total


def _safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, 0 where nothing was counted (a batch of ignored pixels only)."""
    return torch.where(denominator > 0, numerator / denominator.clamp_min(1e-12), numerator * 0)


def build_loss(train_cfg: Any, *, ignore_index: int = 255) -> SegmentationLoss:
    return SegmentationLoss(
        ignore_index=ignore_index,
        class_weights=tuple(train_cfg.class_weights) or None,
        ohem=train_cfg.ohem,
        ohem_thresh=train_cfg.ohem_thresh,
        ohem_min_kept=train_cfg.ohem_min_kept,
        aux_weight=train_cfg.aux_weight,
    )


# ---------------------------------------------------------------------------------- optimizer + LR
def build_optimizer(param_groups: list[dict], train_cfg: Any) -> torch.optim.Optimizer:
    """SGD (momentum, no Nesterov) or AdamW over `param_groups` (from model.builder.build_param_groups)."""
    if train_cfg.optimizer == "sgd":
        return torch.optim.SGD(param_groups, lr=train_cfg.lr, momentum=train_cfg.momentum,
                               weight_decay=train_cfg.weight_decay)
    if train_cfg.optimizer == "adamw":
        return torch.optim.AdamW(param_groups, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    raise ValueError(f"train.optimizer={train_cfg.optimizer!r} is not one of sgd, adamw")


def poly_warmup_factor(iteration: int, *, total_iters: int, power: float, warmup_iters: int) -> float:
    """LR multiplier for 0-based step `iteration`: (1 - it/total)^power, times a linear warmup
    (it+1)/warmup_iters over the first warmup_iters steps; 0 from total_iters on."""
    if iteration >= total_iters:
        return 0.0
    factor = (1.0 - iteration / total_iters) ** power
    if warmup_iters > 0 and iteration < warmup_iters:
        factor *= (iteration + 1) / warmup_iters
    return factor


class PolyWarmupLR:
    """Per-iteration poly schedule with linear warmup, applied to each group's `initial_lr`.

    The state is the iteration only; the total comes from the config, so resuming with a larger
    train.iters stretches the remaining schedule.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, total_iters: int, power: float = 0.9,
                 warmup_iters: int = 0) -> None:
        self.optimizer = optimizer
        self.total_iters = total_iters
        self.power = power
        self.warmup_iters = warmup_iters
        self.iteration = 0
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self._apply()

    def factor(self) -> float:
        return poly_warmup_factor(self.iteration, total_iters=self.total_iters, power=self.power,
                                  warmup_iters=self.warmup_iters)

    def _apply(self) -> None:
        factor = self.factor()
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    def step(self) -> None:
        self.iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, int]:
        return {"iteration": self.iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.iteration = int(state["iteration"])
        self._apply()


# ------------------------------------------------------------------------------------- data order
def _mix_seed(*values: int) -> int:
    digest = hashlib.sha256(":".join(map(str, values)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ResumableBatchSampler(Sampler):
    """Batches of (index, sample_seed) for one process, reproducible from (seed, epoch).

    Epoch e is a permutation drawn from a generator seeded with (seed, e); global batch t is
    permutation[t*G:(t+1)*G] with G = batch_size * world_size, and process `rank` gets the rank-th slice
    of it, so any number of processes together see exactly the global batches of one process. The
    incomplete last global batch is dropped. `set_epoch(e, start_batch=k)` skips the first k batches
    (resume). Each sample carries a seed drawn from the same generator, used for its augmentation.
    """

    def __init__(self, num_samples: int, *, batch_size: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        global_batch = batch_size * world_size
        if num_samples < global_batch:
            raise ValueError(f"the training split has {num_samples} samples, fewer than one global batch "
                             f"(train.batch_size={global_batch}); lower train.batch_size")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start_batch = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // (self.batch_size * self.world_size)

    def set_epoch(self, epoch: int, *, start_batch: int = 0) -> None:
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch={start_batch} outside 0..{self.batches_per_epoch}")
        self.epoch = epoch
        self.start_batch = start_batch

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        generator = torch.Generator().manual_seed(_mix_seed(self.seed, self.epoch))
        order = torch.randperm(self.num_samples, generator=generator).tolist()
        seeds = torch.randint(0, 2**31 - 1, (self.num_samples,), generator=generator).tolist()
        global_batch = self.batch_size * self.world_size
        for batch in range(self.start_batch, self.batches_per_epoch):
            first = batch * global_batch + self.rank * self.batch_size
            yield [(order[j], seeds[j]) for j in range(first, first + self.batch_size)]


def _find_seedable(obj: Any, depth: int = 3, seen: set[int] | None = None) -> list[Any]:
    """Objects reachable from `obj` through attributes/lists that own a random state to reseed
    (albumentations pipelines keep one, independent of numpy's global seed)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0 or isinstance(obj, (str, bytes, int, float, np.ndarray, torch.Tensor)):
        return []
    if isinstance(obj, (list, tuple, dict)) and len(obj) > 64:  # a list of samples, not of transforms
        return []
    seen.add(id(obj))
    if callable(getattr(obj, "set_random_seed", None)) and not isinstance(obj, type):
        return [obj]  # a Compose seeds its children itself
    found: list[Any] = []
    children: list[Any] = []
    if isinstance(obj, (list, tuple)):
        children = list(obj)
    elif isinstance(obj, dict):
        children = list(obj.values())
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        children = list(vars(obj).values())
    for child in children:
        found += _find_seedable(child, depth - 1, seen)
    return found


class SeededDataset(Dataset):
    """Wraps a dataset so that item (index, seed) is produced with every RNG seeded from `seed`:
    python random, numpy, torch and the dataset's augmentation pipelines. The caller's global RNG
    states are restored afterwards, so loading in the main process (num_workers=0) does not perturb
    training's random stream."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._seedable = _find_seedable(dataset)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, seed = key
        if get_worker_info() is not None:  # a worker's global RNG streams serve nothing else
            return self._seeded_item(index, seed)
        python_state, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            return self._seeded_item(index, seed)
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
            torch.set_rng_state(torch_state)

    def _seeded_item(self, index: int, seed: int) -> Any:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        for pipeline in self._seedable:
            pipeline.set_random_seed(seed)
        return self.dataset[index]


class _WorkerInit:
    """Worker init: ignore SIGINT (the main process handles it and stops cleanly), then the data
    package's own worker seeding."""

    def __init__(self, seed_worker: Any) -> None:
        self.seed_worker = seed_worker

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if self.seed_worker is not None:
            self.seed_worker(worker_id)


# ------------------------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict[str, Any]:
    """Every RNG state of this process as tensors and primitives (loads with weights_only=True)."""
    python_version, python_state, python_gauss = random.getstate()
    _, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python_version": int(python_version),
        "python_state": torch.tensor(python_state, dtype=torch.int64),
        "python_gauss": python_gauss,
        "numpy_keys": torch.from_numpy(np.asarray(numpy_keys, dtype=np.int64)),
        "numpy_pos": int(numpy_pos),
        "numpy_has_gauss": int(numpy_has_gauss),
        "numpy_gauss": float(numpy_gauss),
        "torch": torch.get_rng_state(),
        "cuda": [s for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
    }
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of capture_rng_state."""
    random.setstate((state["python_version"], tuple(int(v) for v in state["python_state"].tolist()),
                     state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), state["numpy_pos"],
                         state["numpy_has_gauss"], state["numpy_gauss"]))
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda") or []
    if cuda_states and torch.cuda.is_available():
        for index, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, index)


# ------------------------------------------------------------------------------------------ logging
class MetricsLog:
    """TensorBoard scalars/images plus one JSON object per line in metrics.jsonl (rank 0 only)."""

    def __init__(self, run_dir: Path, *, enabled: bool, resume_iteration: int | None = None) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        self.run_dir = run_dir
        # TensorBoard drops earlier events from this step on: what a killed run logged after the
        # checkpoint it resumes from, or everything when a fresh run reuses the directory
        self._purge_step = resume_iteration + 1 if resume_iteration is not None else 0
        if not enabled:
            return
        if resume_iteration is None:
            self.path.write_text("")
        elif self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("iteration", 0) <= resume_iteration]
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
        for key, value in _flat_numbers(record):
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


def _flat_numbers(record: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flat_numbers(value, f"{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
            yield name, float(value)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _format_seconds(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


# -------------------------------------------------------------------------------------- the trainer
@dataclass
class TrainResult:
    """What `Trainer.fit` returns: per-step losses (iteration -> global mean loss of that step), the
    last validation metrics, the best mIoU and why the loop ended ("finished", "stopped", "signal")."""

    losses: dict[int, float] = field(default_factory=dict)
    last_val: dict[str, Any] | None = None
    best_miou: float = -1.0
    iteration: int = 0
    reason: str = "finished"


class _StopSignal:
    """SIGINT/SIGTERM -> a flag checked after each step; a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        logger.warning("received %s: finishing the current step, then saving last.pt",
                       signal.Signals(signum).name)

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class Trainer:
    """Builds everything from a Config and trains. Only rank 0 writes files.

    `resume`: a checkpoint payload (from load_checkpoint) to continue from, or None.
    `stop_at`: stop (saving last.pt, as on a signal) once this iteration is reached; None = train.iters.
    """

    def __init__(self, config: Config, dist_info: DistInfo, *, resume: Mapping[str, Any] | None = None,
                 stop_at: int | None = None, progress: bool | None = None) -> None:
        from data import build_dataset, seed_worker
        from model.builder import build_model, build_param_groups, load_segmentation_weights

        self.config = config
        self.dist = dist_info
        self.device = dist_info.device
        self.is_main = dist_info.is_main
        self.stop_at = stop_at
        self.progress = (sys.stderr.isatty() if progress is None else progress) and self.is_main
        train_cfg, data_cfg = config.train, config.data
        self.run_dir = config.run_dir

        num_replicas = dist_info.world_size if dist_info.mode == "ddp" else 1
        if train_cfg.batch_size % num_replicas:
            raise ValueError(f"train.batch_size={train_cfg.batch_size} is not divisible by the {num_replicas} "
                             "torchrun processes; use a multiple")
        self.local_batch = train_cfg.batch_size // num_replicas

        # Seeds: the model initializes identically on every process; each process then gets its own
        # stream (dropout) derived from (seed, rank).
        torch.manual_seed(_mix_seed(train_cfg.seed, "init") % 2**63)
        self.train_set = build_dataset(data_cfg, data_cfg.train_split, train=True)
        self.val_set = build_dataset(data_cfg, data_cfg.val_split, train=False)
        self.classes = tuple(self.train_set.classes)
        self.num_classes = int(self.train_set.num_classes)
        self.ignore_index = int(getattr(self.train_set, "ignore_index", data_cfg.ignore_index))

        model = build_model(config.model, self.num_classes)
        if config.model.init_checkpoint and resume is None:
            payload = load_checkpoint(config.model.init_checkpoint)
            skipped = load_segmentation_weights(model, payload["model"])
            logger.info("initialized from %s%s", config.model.init_checkpoint,
                        f" (skipped {', '.join(skipped)}: shape differs)" if skipped else "")
        model.to(self.device)
        if config.model.channels_last:
            model.to(memory_format=torch.channels_last)
        self.model = model  # unwrapped; checkpoints and validation use it
        self.train_model = self._wrap(model)

        groups = build_param_groups(model, lr=train_cfg.lr, head_lr_mult=train_cfg.head_lr_mult,
                                    weight_decay=train_cfg.weight_decay)
        self.group_names = [group.get("name", f"group{i}") for i, group in enumerate(groups)]
        self.optimizer = build_optimizer(groups, train_cfg)
        self.scheduler = PolyWarmupLR(self.optimizer, total_iters=train_cfg.iters, power=train_cfg.poly_power,
                                      warmup_iters=train_cfg.warmup_iters)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=train_cfg.amp == "fp16")
        self.criterion = build_loss(train_cfg, ignore_index=self.ignore_index).to(self.device)

        self.iteration = 0
        self.best_miou = -1.0
        rng_state = None
        if resume is not None:
            missing = [key for key in RESUME_KEYS if key not in resume]
            if missing:
                raise ValueError(f"cannot resume: the checkpoint lacks {', '.join(missing)} (a best.pt/last.pt "
                                 "from train.py has them)")
            model.load_state_dict(resume["model"])
            configured = [(group["initial_lr"], group["weight_decay"]) for group in self.optimizer.param_groups]
            self.optimizer.load_state_dict(resume["optimizer"])
            # the (possibly overridden) config decides the base LR and weight decay from here on
            for group, (initial_lr, weight_decay) in zip(self.optimizer.param_groups, configured):
                group["initial_lr"], group["weight_decay"] = initial_lr, weight_decay
            self.scheduler.load_state_dict(resume["scheduler"])
            if resume["scaler"]:
                self.scaler.load_state_dict(resume["scaler"])
            self.iteration = int(resume["iteration"])
            self.best_miou = float(resume["best_miou"])
            rng_state = resume["rng"]

        self.sampler = ResumableBatchSampler(len(self.train_set), batch_size=self.local_batch, seed=train_cfg.seed,
                                             rank=dist_info.rank if dist_info.mode == "ddp" else 0,
                                             world_size=num_replicas)
        worker_init = _WorkerInit(seed_worker)
        workers = data_cfg.num_workers
        self.train_loader = DataLoader(
            SeededDataset(self.train_set), batch_sampler=self.sampler, num_workers=workers,
            pin_memory=self.device.type == "cuda", worker_init_fn=worker_init, persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(train_cfg.seed),
        )
        val_sampler = ShardSampler(len(self.val_set), rank=dist_info.rank if dist_info.mode == "ddp" else 0,
                                   world_size=num_replicas)
        self.val_loader = DataLoader(
            self.val_set, batch_size=config.eval.batch_size, sampler=val_sampler, num_workers=min(workers, 2),
            pin_memory=self.device.type == "cuda", worker_init_fn=worker_init,
            generator=torch.Generator().manual_seed(train_cfg.seed),
        )
        self.vis_indices = list(range(min(train_cfg.num_vis_images, len(self.val_set))))
        self._batch_stream: Iterator[tuple[int, Any]] | None = None

        if rng_state is not None:
            self._restore_rng(rng_state)
        else:
            torch.manual_seed(_mix_seed(train_cfg.seed, "train", dist_info.rank))
            random.seed(_mix_seed(train_cfg.seed, "python", dist_info.rank))
            np.random.seed(_mix_seed(train_cfg.seed, "numpy", dist_info.rank) % 2**32)

        if self.is_main:
            if resume is None and (self.run_dir / "last.pt").is_file():
                logger.warning("%s already holds a run; starting over (its checkpoints are overwritten as this run "
                               "saves; pass --resume auto to continue it instead)", self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, self.run_dir / "config.yaml")
        self.log = MetricsLog(self.run_dir, enabled=self.is_main,
                              resume_iteration=self.iteration if resume is not None else None)
        self._describe()

    # --------------------------------------------------------------------------------- setup bits
    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.dist.mode == "dp" and len(self.dist.device_ids) > 1:
            from model.sync_batchnorm import DataParallelWithCallback

            return DataParallelWithCallback(model, device_ids=list(self.dist.device_ids))
        if self.dist.mode == "ddp":
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)
        return model

    def _describe(self) -> None:
        has_sync_bn = any(type(m).__name__.startswith("SynchronizedBatchNorm") for m in self.model.modules())
        mode = self.dist.mode
        if mode == "ddp":
            sync = "across the processes through torch.distributed" if has_sync_bn else "not synchronized (per process)"
            where = f"DDP over {self.dist.world_size} processes"
        elif mode == "dp" and len(self.dist.device_ids) > 1:
            sync = "across the GPUs (DataParallelWithCallback)" if has_sync_bn else "not synchronized (per GPU)"
            where = f"DataParallel over GPUs {','.join(map(str, self.dist.device_ids))}"
        else:
            sync = "single device (plain batch norm)"
            where = f"one device ({self.device})"
        per_device = self.local_batch if mode == "ddp" else self.local_batch / max(1, len(self.dist.device_ids))
        logger.info("%s; global batch %d, per-device batch %s; BN statistics %s; amp=%s", where,
                    self.config.train.batch_size, f"{per_device:g}", sync, self.config.train.amp)
        logger.info("%d training / %d validation images, %d classes, %d batches per epoch; run dir %s",
                    len(self.train_set), len(self.val_set), self.num_classes, self.sampler.batches_per_epoch,
                    self.run_dir)

    def _restore_rng(self, rng: Mapping[str, Any]) -> None:
        states = rng.get("per_rank") or []
        rank = self.dist.rank
        if rank < len(states) and len(states) == self.dist.world_size:
            restore_rng_state(states[rank])
        else:
            logger.warning("checkpoint RNG states are for %d process(es), this run has %d: reseeding",
                           len(states), self.dist.world_size)
            torch.manual_seed(_mix_seed(self.config.train.seed, "train", rank, self.iteration))

    def _gather_rng(self) -> dict[str, Any]:
        state = capture_rng_state()
        if is_dist():
            states: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(states, state)
        else:
            states = [state]
        return {"per_rank": states}

    # ------------------------------------------------------------------------------ checkpoints
    def _payload(self, rng: dict[str, Any]) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model": self.model.state_dict(),
            "config": to_dict(self.config),
            "classes": list(self.classes),
            "iteration": self.iteration,
            "epoch": self.iteration // self.sampler.batches_per_epoch,
            "best_miou": self.best_miou,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rng,
        }

    def save(self, names: Sequence[str]) -> None:
        """Write run_dir/<name> for each name (rank 0); every process must call it (RNG gathering)."""
        rng = self._gather_rng()
        if self.is_main:
            payload = self._payload(rng)
            for name in names:
                save_checkpoint(self.run_dir / name, payload)
            logger.info("saved %s at iteration %d", " and ".join(names), self.iteration)
        barrier()

    # ------------------------------------------------------------------------------- validation
    def validate(self) -> dict[str, Any]:
        self.model.eval()
        data_cfg = self.config.data
        metrics = evaluate(self.model, self.val_loader, num_classes=self.num_classes, device=self.device,
                           mean=data_cfg.mean, std=data_cfg.std, eval_cfg=self.config.eval,
                           ignore_index=self.ignore_index, classes=self.classes, progress=False,
                           amp=self.config.train.amp)  # eval.py's default too: the logged mIoU is reproducible
        if self.is_main:
            per_class = {name: value for name, value in zip(self.classes, metrics.get("iou", []))
                         if value is not None}
            record = {k: metrics[k] for k in ("miou", "pixel_acc", "mean_acc", "fwiou", "num_images") if k in metrics}
            record["iou"] = per_class
            self.log.scalars(record, step=self.iteration, prefix="val")
            self._log_images()
            logger.info("iteration %d: val mIoU %.4f, pixel acc %.4f (%d images)", self.iteration,
                        metrics["miou"], metrics.get("pixel_acc", float("nan")), metrics.get("num_images", -1))
        self.model.train()
        return metrics

    @torch.no_grad()
    def _log_images(self) -> None:
        if not self.vis_indices:
            return
        from data import palette_image
        from data.transforms import normalize_batch
        from engine.inference import predict

        palette = np.asarray(self.train_set.palette, dtype=np.uint8)
        eval_cfg = self.config.eval
        rows = []
        for index in self.vis_indices:
            image, mask = self.val_set[index]
            batch = normalize_batch(image.unsqueeze(0).to(self.device), self.config.data.mean, self.config.data.std)
            logits = predict(self.model, batch, num_classes=self.num_classes, mode=eval_cfg.mode,
                             crop_size=eval_cfg.crop_size, stride=eval_cfg.stride)
            prediction = logits.argmax(1)[0].cpu().numpy().astype(np.uint8)
            panels = [image.permute(1, 2, 0).numpy()]
            for labels in (mask.numpy(), prediction):
                panels.append(np.asarray(palette_image(labels.astype(np.uint8), palette).convert("RGB")))
            rows.append(np.concatenate(panels, axis=1))
        width = max(row.shape[1] for row in rows)
        rows = [np.pad(row, ((0, 0), (0, width - row.shape[1]), (0, 0))) for row in rows]
        self.log.image("val/image_truth_prediction", np.concatenate(rows, axis=0), step=self.iteration)

    # ------------------------------------------------------------------------------------ the loop
    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast_for(self.device, self.config.train.amp)

    def _batches(self) -> Iterator[tuple[int, Any]]:
        """(epoch, batch) from the current iteration on, forever, with the resume position skipped."""
        per_epoch = self.sampler.batches_per_epoch
        epoch, start = divmod(self.iteration, per_epoch)
        while True:
            self.sampler.set_epoch(epoch, start_batch=start)
            for batch in self.train_loader:
                yield epoch, batch
            epoch, start = epoch + 1, 0

    def train_step(self, images: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """One optimizer step on a uint8 image batch; returns the detached global-mean loss
        contribution of this process (sum over processes = the global loss)."""
        from data.transforms import normalize_batch

        data_cfg = self.config.data
        images = images.to(self.device, non_blocking=True)
        masks = masks.to(self.device, non_blocking=True)
        inputs = normalize_batch(images, data_cfg.mean, data_cfg.std)
        if self.config.model.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        with self._autocast():
            outputs = self.train_model(inputs)
        terms = self.criterion.terms(outputs, masks)
        world = self.dist.world_size if self.dist.mode == "ddp" else 1
        weights = torch.stack([weight.detach() for _, weight in terms.values()])
        all_reduce_sum(weights)
        loss = torch.zeros((), device=self.device)
        for (name, (loss_sum, _)), weight in zip(terms.items(), weights):
            loss = loss + self.criterion.head_factor(name) * _safe_divide(loss_sum, weight)
        # DDP averages gradients over processes; scaling by the world size makes that a sum of
        # per-process shares of the global mean.
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss * world).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        return loss.detach()

    def fit(self, *, stop_at: int | None = None, save_at_stop: bool = True) -> TrainResult:
        """Train up to `stop_at` (default: the constructor's, else train.iters); may be called again
        with a later `stop_at` to continue the same data stream. last.pt is written every
        train.ckpt_interval, at train.iters, on a signal, and at `stop_at` unless save_at_stop=False."""
        train_cfg = self.config.train
        total = train_cfg.iters
        stop_at = stop_at if stop_at is not None else self.stop_at
        stop_at = min(total, stop_at) if stop_at is not None else total
        result = TrainResult(best_miou=self.best_miou, iteration=self.iteration)
        if self.iteration >= stop_at:
            logger.info("nothing to do: iteration %d already >= %d", self.iteration, stop_at)
            self.log.close()
            return result
        logger.info("training from iteration %d to %d", self.iteration, stop_at)
        self.model.train()
        pending: list[tuple[int, torch.Tensor]] = []
        window = {"images": 0, "data_s": 0.0, "step_s": 0.0}
        window_start = time.perf_counter()
        run_start, run_start_iter = window_start, self.iteration
        use_stop_all_reduce = is_dist()
        stop_flag_prev: torch.Tensor | None = None
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=stop_at, initial=self.iteration, dynamic_ncols=True, desc="train")
        if self._batch_stream is None:
            self._batch_stream = self._batches()
        batches = self._batch_stream
        reason = "finished"
        with _StopSignal() as stop_signal:
            try:
                while self.iteration < stop_at:
                    wait_start = time.perf_counter()
                    epoch, (images, masks) = next(batches)
                    step_start = time.perf_counter()
                    window["data_s"] += step_start - wait_start
                    loss = self.train_step(images, masks)
                    self.iteration += 1
                    window["images"] += images.shape[0] * (self.dist.world_size if self.dist.mode == "ddp" else 1)
                    pending.append((self.iteration, loss))
                    it = self.iteration
                    want_val = it % train_cfg.val_interval == 0 or it == total
                    want_ckpt = it % train_cfg.ckpt_interval == 0 or it == total or (it == stop_at and save_at_stop)
                    if it % train_cfg.log_interval == 0 or want_val or want_ckpt or it == stop_at:
                        self._flush_losses(pending, result)
                        pending = []
                    if it % train_cfg.log_interval == 0:
                        now = time.perf_counter()
                        self._log_train(result, window, now - window_start, run_start, run_start_iter, stop_at, bar)
                        window = {"images": 0, "data_s": 0.0, "step_s": 0.0}
                        window_start = now
                    if bar is not None:
                        bar.update(1)
                    names = []
                    if want_val:
                        metrics = self.validate()
                        result.last_val = metrics
                        if metrics["miou"] > self.best_miou:
                            self.best_miou = float(metrics["miou"])
                            names.append("best.pt")
                    if want_ckpt:
                        names.append("last.pt")
                    # A stop request is acted on by every process at the same iteration: under DDP
                    # the flag is all-reduced one step late so that reading it never waits.
                    if use_stop_all_reduce:
                        flag = torch.tensor([1.0 if stop_signal.received else 0.0], device=self.device)
                        all_reduce_sum(flag)
                        stop_now = stop_flag_prev is not None and stop_flag_prev.item() > 0
                        stop_flag_prev = flag
                    else:
                        stop_now = stop_signal.received is not None
                    if stop_now and it < stop_at:
                        self._flush_losses(pending, result)
                        pending = []
                        if "last.pt" not in names:
                            names.append("last.pt")
                        reason = "signal"
                    if names:
                        self.save(names)
                    if reason == "signal":
                        logger.warning("stopped by signal at iteration %d; last.pt saved, resume with "
                                       "--resume auto", it)
                        break
            except BaseException:
                self.log.close()
                raise
            finally:
                if bar is not None:
                    bar.close()
                self.log.flush()
        if reason != "signal" and self.iteration < total:
            reason = "stopped"
        if reason != "stopped":
            self.log.close()
        result.reason = reason
        result.iteration = self.iteration
        result.best_miou = self.best_miou
        return result

    def close(self) -> None:
        """Close the TensorBoard writer (fit closes it itself when training ends or fails)."""
        self.log.close()

    def _flush_losses(self, pending: list[tuple[int, torch.Tensor]], result: TrainResult) -> None:
        if not pending:
            return
        values = torch.stack([loss for _, loss in pending]).float()
        all_reduce_sum(values)
        values = values.cpu().tolist()
        for (iteration, _), value in zip(pending, values):
            if not math.isfinite(value):
                raise FloatingPointError(
                    f"non-finite loss ({value}) at iteration {iteration}; stopping. The last good checkpoint "
                    f"({self.run_dir / 'last.pt'}) was left untouched; lower train.lr, try train.amp=off, or "
                    "check the data")
            result.losses[iteration] = value

    def _log_train(self, result: TrainResult, window: dict[str, Any], elapsed: float, run_start: float,
                   run_start_iter: int, stop_at: int, bar: Any) -> None:
        interval = self.config.train.log_interval
        recent = [result.losses[i] for i in range(self.iteration - interval + 1, self.iteration + 1)
                  if i in result.losses]
        loss = sum(recent) / max(1, len(recent))
        # the rate the last step used (the optimizer already holds the next one)
        factor = poly_warmup_factor(self.iteration - 1, total_iters=self.scheduler.total_iters,
                                    power=self.scheduler.power, warmup_iters=self.scheduler.warmup_iters)
        lrs = {name: group["initial_lr"] * factor for name, group in zip(self.group_names, self.optimizer.param_groups)}
        record = {
            "loss": loss,
            "lr": lrs,
            "images_per_s": window["images"] / max(elapsed, 1e-9),
            "data_wait_fraction": window["data_s"] / max(elapsed, 1e-9),
            "peak_memory_mb": _peak_memory_mb(self.device),
        }
        self.log.scalars(record, step=self.iteration, prefix="train")
        done = self.iteration - run_start_iter
        seconds_per_iter = (time.perf_counter() - run_start) / max(1, done)
        eta = seconds_per_iter * (stop_at - self.iteration)
        first_lr = next(iter(lrs.values()), 0.0)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{first_lr:.2e}")
        elif self.is_main:
            logger.info("iter %d/%d  loss %.4f  lr %.2e  %.1f img/s  data wait %.0f%%  eta %s", self.iteration,
                        stop_at, loss, first_lr, record["images_per_s"], 100 * record["data_wait_fraction"],
                        _format_seconds(eta))


def load_resume_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint with everything a resume needs (FileNotFoundError / ValueError naming the file)."""
    return load_checkpoint(path, required_keys=RESUME_KEYS)
