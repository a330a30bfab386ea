"""What each process loads: resumable training batches and the training DataLoader; the evaluation
DataLoader over a non-padding shard.

Training order: epoch e is a permutation drawn from (train.seed, e); global batch t is its t-th slice
of `train.batch_size` samples, and each process loads its own part of that slice, so any number of
processes together see exactly the global batches of one process. With gradient accumulation
(`train.accumulate` = A) global batch t is cut into A consecutive micro-batches first, and each process
loads its part of each micro-batch; the union over the A micro-batches is the same global batch. Every sample carries a seed drawn
from the same generator (syncseg.engine.seeding.SeededDataset uses it for the augmentation), and DataLoaders
use their own generators, never the global RNG: a run stopped at iteration K and resumed computes the
same losses as an uninterrupted run.

A training split smaller than one global batch (a few images of one's own) is repeated: an epoch is then
R = ceil(batch_size / N) permutations of the N samples back to back, each drawn anew, so every step still
sees whole batches and a split of N >= batch_size samples is ordered exactly as without the rule.

Where torch.distributed is initialized, DataLoader workers start from a forkserver (worker_context), not by
forking the training process.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
from multiprocessing.context import BaseContext
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from syncseg.engine.distributed import get_rank, get_world_size, is_dist
from syncseg.engine.loss import check_mask_values
from syncseg.engine.seeding import SeededDataset, mix_seed, worker_init

logger = logging.getLogger(__name__)


def split_batch(global_batch: int, world_size: int) -> list[int]:
    """Per-process batch sizes, as even as possible: 8 over 3 processes is [3, 3, 2]."""
    base, extra = divmod(global_batch, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


class ResumableBatchSampler(Sampler):
    """Batches of (index, sample_seed) for one process, reproducible from (seed, epoch).

    Global batch t is permutation[t*G:(t+1)*G] with G = `global_batch`. It is split into `accumulate`
    micro-batches (`split_batch(G, accumulate)`, consecutive slices), and process `rank` gets its slice of
    each (`split_batch` again: sizes differ by at most one); one item per micro-batch is yielded, so an
    optimizer step takes `accumulate` consecutive items. The incomplete last global batch is dropped. A
    split of fewer than G samples is repeated within the epoch (`repeats` permutations back to back).
    `set_epoch(e, start_batch=k)` skips the first k global batches (resume: k counts optimizer steps).
    The order depends on neither the number of processes nor the rank, so a run resumed on another
    world size sees the same global batches.
    """

    def __init__(self, num_samples: int, *, global_batch: int, seed: int, rank: int = 0, world_size: int = 1,
                 accumulate: int = 1) -> None:
        if global_batch < world_size:
            raise ValueError(f"train.batch_size={global_batch} is smaller than the {world_size} processes; every "
                             "process needs at least one sample per step")
        micro_sizes = split_batch(global_batch, accumulate)
        if min(micro_sizes) < world_size:
            raise ValueError(f"train.batch_size={global_batch} in train.accumulate={accumulate} micro-batches gives "
                             f"micro-batches of {min(micro_sizes)} samples, fewer than the {world_size} processes; "
                             "every process needs at least one sample per micro-batch (lower train.accumulate)")
        if num_samples < 1:
            raise ValueError("the training split has no samples")
        # a split smaller than one global batch is repeated (few-shot folders); otherwise one permutation
        self.repeats = math.ceil(global_batch / num_samples) if num_samples < global_batch else 1
        if self.repeats > 1 and rank == 0:
            logger.info("the training split has %d sample(s), fewer than one global batch (train.batch_size=%d): "
                        "each epoch repeats it %d times, each time in a new order", num_samples, global_batch,
                        self.repeats)
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.accumulate = accumulate
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        # (first index within the global batch, size) of this process's part of each micro-batch
        self.parts = []
        for index, size in enumerate(micro_sizes):
            shares = split_batch(size, world_size)
            self.parts.append((sum(micro_sizes[:index]) + sum(shares[:rank]), shares[rank]))
        self.batch_size = sum(size for _, size in self.parts)  # this process's share of a global batch
        self.epoch = 0
        self.start_batch = 0

    @property
    def batches_per_epoch(self) -> int:
        """Global batches (optimizer steps) per epoch."""
        return self.num_samples * self.repeats // self.global_batch

    def set_epoch(self, epoch: int, *, start_batch: int = 0) -> None:
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch={start_batch} outside 0..{self.batches_per_epoch}")
        self.epoch = epoch
        self.start_batch = start_batch

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.accumulate

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        order = [index for _ in range(self.repeats)
                 for index in torch.randperm(self.num_samples, generator=generator).tolist()]
        seeds = torch.randint(0, 2**31 - 1, (len(order),), generator=generator).tolist()
        for batch in range(self.start_batch, self.batches_per_epoch):
            for offset, size in self.parts:
                first = batch * self.global_batch + offset
                yield [(order[j], seeds[j]) for j in range(first, first + size)]


class MaskCheckingCollate:
    """torch's default collate of (image, mask) samples, then the masks' values checked on the CPU
    (syncseg.engine.loss.check_mask_values: the loss's own one-line error), in the worker that made the batch.
    The loss checks them itself only where that costs no host synchronization; on CUDA a value outside
    0..num_classes-1 and ignore_index would reach cross-entropy as a device-side assert instead."""

    def __init__(self, *, num_classes: int, ignore_index: int) -> None:
        self.num_classes, self.ignore_index = num_classes, ignore_index

    def __call__(self, samples: list[Any]) -> Any:
        batch = default_collate(samples)
        check_mask_values(batch[1], num_classes=self.num_classes, ignore_index=self.ignore_index)
        return batch


# what the workers' forkserver imports once, before it forks any worker: torch and the data pipeline
WORKER_PRELOAD = ["torch", "syncseg.data", "syncseg.engine.seeding", "syncseg.engine.samplers"]


def worker_context(dataset: Any, num_workers: int) -> BaseContext | None:
    """The multiprocessing context of a DataLoader's `num_workers` workers: None (no workers, or no process group:
    torch's default, fork on Linux), a forkserver where a process group exists.

    A worker forked beside the process group's own threads (gloo's, NCCL's) can hang inside os.fork on CPython
    3.11 before its 2024 security releases; a forkserver has no threads, and every worker forks from it
    (docs/design.md, "Running on a cluster": why, and how often). The dataset is pickled to each worker, and a
    script that builds the loaders at its top level needs the `if __name__ == "__main__":` guard.
    """
    if num_workers == 0 or not is_dist() or "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    context = multiprocessing.get_context("forkserver")
    module = type(dataset).__module__
    preload = WORKER_PRELOAD + ([module] if module not in ("__main__", "builtins") else [])
    context.set_forkserver_preload(preload)  # no effect once this process's server is running
    return context


def build_train_loader(dataset: Dataset, sampler: ResumableBatchSampler, *, num_workers: int, pin_memory: bool,
                       seed: int, num_classes: int, ignore_index: int) -> DataLoader:
    """The training DataLoader: seeded samples in `sampler`'s order, persistent workers; each batch's mask
    values are checked against `num_classes` and `ignore_index` before it leaves the loader."""
    return DataLoader(
        SeededDataset(dataset), batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
        worker_init_fn=worker_init, persistent_workers=num_workers > 0, generator=torch.Generator().manual_seed(seed),
        collate_fn=MaskCheckingCollate(num_classes=num_classes, ignore_index=ignore_index),
        multiprocessing_context=worker_context(dataset, num_workers),
    )


def shutdown_workers(loader: DataLoader) -> None:
    """Stop `loader`'s persistent worker processes now.

    The workers ignore SIGINT/SIGTERM (a signal to the whole process group must reach only the main
    process, which finishes the step and saves), so multiprocessing's exit handler, which stops
    children with SIGTERM and then waits for them, would wait forever: they are told to exit here.
    torch has no public call for it; its iterator's own shutdown is what a garbage-collected iterator
    runs.
    """
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        loader._iterator = None


def train_batches(loader: DataLoader, start_iteration: int) -> Iterator[Any]:
    """The batches of `loader` (whose batch_sampler is a ResumableBatchSampler) from global step
    `start_iteration` on, epoch after epoch, forever: one item per micro-batch, `accumulate` per step."""
    sampler = loader.batch_sampler
    epoch, start = divmod(start_iteration, sampler.batches_per_epoch)
    while True:
        sampler.set_epoch(epoch, start_batch=start)
        yield from loader
        epoch, start = epoch + 1, 0


def train_steps(loader: DataLoader, start_iteration: int) -> Iterator[list[Any]]:
    """The optimizer steps of `loader` from global step `start_iteration` on: each a list of the
    sampler's `accumulate` micro-batches (train_batches grouped)."""
    batches = train_batches(loader, start_iteration)
    try:
        while True:
            yield [next(batches) for _ in range(loader.batch_sampler.accumulate)]
    finally:
        batches.close()


class ShardSampler(Sampler[int]):
    """Indices rank, rank + world_size, ... of range(num_samples), in order, without padding.

    Shards are disjoint and together cover every index once; their lengths differ by at most one.
    rank / world_size default to torch.distributed's (0 / 1 when it is not initialized).
    """

    def __init__(self, num_samples: int, *, rank: int | None = None, world_size: int | None = None):
        self.rank = get_rank() if rank is None else rank
        self.world_size = get_world_size() if world_size is None else world_size
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"ShardSampler: rank={self.rank} must lie in [0, world_size={self.world_size})")
        self.num_samples = num_samples

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_samples, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))


def build_eval_loader(
    dataset: Dataset, *, batch_size: int = 1, num_workers: int = 0, pin_memory: bool = False,
    rank: int | None = None, world_size: int | None = None, seed: int = 0,
) -> DataLoader:
    """A DataLoader over this process's ShardSampler shard, in dataset order, no shuffling or padding.

    batch_size > 1 needs images of one size (the default collate stacks them). Its own generator keeps
    it from drawing on the global RNG (a validation must not shift training's random stream).
    """
    sampler = ShardSampler(len(dataset), rank=rank, world_size=world_size)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, drop_last=False, persistent_workers=False, worker_init_fn=worker_init,
                      generator=torch.Generator().manual_seed(seed),
                      multiprocessing_context=worker_context(dataset, num_workers))


def check_batching(dataset: Any, batch_size: int, *, key: str) -> None:
    """ValueError when batches of `batch_size` images cannot be stacked: the images of `dataset`, after
    its evaluation transform, differ in size. Reads image headers only (datasets with `image_size`)."""
    if batch_size <= 1 or not hasattr(dataset, "image_size"):
        return
    sizes: dict[tuple[int, int], int] = {}
    for index in range(len(dataset)):
        sizes.setdefault(tuple(dataset.image_size(index)), index)
    if len(sizes) > 1 and getattr(dataset, "transform", None) is not None:
        resized: dict[tuple[int, int], int] = {}
        for (height, width), index in sizes.items():  # one blank image per distinct size
            image, _ = dataset.transform(np.zeros((height, width, 3), np.uint8), np.zeros((height, width), np.uint8))
            resized.setdefault(tuple(image.shape[-2:]), index)
        sizes = resized
    if len(sizes) > 1:
        (first, first_index), (second, second_index) = list(sizes.items())[:2]
        raise ValueError(
            f"{key}={batch_size} stacks several images per batch, but the images differ in size (e.g. "
            f"{dataset.name_of(first_index)} is {first[1]}x{first[0]}, {dataset.name_of(second_index)} is "
            f"{second[1]}x{second[0]}, width x height); set {key}=1")
