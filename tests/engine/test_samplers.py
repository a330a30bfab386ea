"""Training batches, evaluation shards and the loaders built on them."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import Dataset

from syncseg.engine.samplers import (
    ResumableBatchSampler,
    ShardSampler,
    build_eval_loader,
    build_train_loader,
    shutdown_workers,
    split_batch,
    train_batches,
)
from tests.gloo import free_port, init_gloo, start_ranks


def test_sampler_shards_the_single_process_global_batches():
    single = ResumableBatchSampler(50, global_batch=8, seed=3)
    single.set_epoch(2)
    shards = []
    for rank in range(2):
        sampler = ResumableBatchSampler(50, global_batch=8, seed=3, rank=rank, world_size=2)
        sampler.set_epoch(2)
        shards.append(list(sampler))
    expected = list(single)
    assert len(expected) == 50 // 8
    for step, batch in enumerate(expected):
        assert shards[0][step] + shards[1][step] == batch


def test_sampler_epochs_differ_cover_distinct_samples_and_resume_skips():
    sampler = ResumableBatchSampler(40, global_batch=4, seed=0)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch0 != epoch1
    indices = [index for batch in epoch0 for index, _ in batch]
    assert sorted(indices) == list(range(40))
    sampler.set_epoch(0, start_batch=3)
    assert list(sampler) == epoch0[3:] and len(sampler) == len(epoch0) - 3
    again = ResumableBatchSampler(40, global_batch=4, seed=0)
    again.set_epoch(1)
    assert list(again) == epoch1
    other_seed = ResumableBatchSampler(40, global_batch=4, seed=1)
    assert list(other_seed) != epoch0


@pytest.mark.parametrize("world", [3, 5, 8])
def test_any_world_size_splits_the_same_global_batches_as_evenly_as_possible(world):
    single = ResumableBatchSampler(50, global_batch=8, seed=3)
    single.set_epoch(1, start_batch=2)
    shards = []
    for rank in range(world):
        sampler = ResumableBatchSampler(50, global_batch=8, seed=3, rank=rank, world_size=world)
        sampler.set_epoch(1, start_batch=2)
        shards.append(list(sampler))
    assert [len(shard[0]) for shard in shards] == split_batch(8, world)
    assert max(split_batch(8, world)) - min(split_batch(8, world)) <= 1 and sum(split_batch(8, world)) == 8
    for step, batch in enumerate(single):
        assert sum((shard[step] for shard in shards), []) == batch
    assert split_batch(8, 3) == [3, 3, 2]


@pytest.mark.parametrize("world,accumulate", [(1, 2), (2, 2), (3, 2), (2, 3), (1, 8), (4, 1)])
def test_accumulation_cuts_each_global_batch_into_micro_batches_split_over_the_processes(world, accumulate):
    single = ResumableBatchSampler(50, global_batch=16, seed=3)
    single.set_epoch(1, start_batch=1)
    expected = list(single)
    shards = []
    for rank in range(world):
        sampler = ResumableBatchSampler(50, global_batch=16, seed=3, rank=rank, world_size=world,
                                        accumulate=accumulate)
        sampler.set_epoch(1, start_batch=1)  # start_batch counts optimizer steps
        shards.append(list(sampler))
        assert len(sampler) == len(shards[-1]) == len(expected) * accumulate
        assert sampler.batch_size == sum(len(item) for item in shards[-1][:accumulate])
    micro_sizes = split_batch(16, accumulate)
    for step, batch in enumerate(expected):
        items = [shard[step * accumulate:(step + 1) * accumulate] for shard in shards]  # per rank, per micro
        micro_batches = [sum((items[rank][micro] for rank in range(world)), []) for micro in range(accumulate)]
        assert [len(micro) for micro in micro_batches] == micro_sizes
        for micro in range(accumulate):
            assert [len(items[rank][micro]) for rank in range(world)] == split_batch(micro_sizes[micro], world)
        assert sum(micro_batches, []) == batch  # consecutive slices of the same global batch


def test_sampler_rejects_micro_batches_smaller_than_the_process_count():
    ResumableBatchSampler(30, global_batch=8, seed=0, world_size=2, accumulate=4)
    with pytest.raises(ValueError, match="train.accumulate=3 micro-batches gives micro-batches of 2 samples, "
                                         "fewer than the 3 processes"):
        ResumableBatchSampler(30, global_batch=8, seed=0, world_size=3, accumulate=3)


def test_sampler_rejects_more_processes_than_samples_per_step():
    with pytest.raises(ValueError, match="train.batch_size=2 is smaller than the 3 processes"):
        ResumableBatchSampler(30, global_batch=2, seed=0, world_size=3)


@pytest.mark.parametrize("count,world", [(5, 2), (7, 3), (2, 4)])
def test_shard_sampler_is_a_disjoint_cover_without_padding(count, world):
    shards = [list(ShardSampler(count, rank=r, world_size=world)) for r in range(world)]
    assert sorted(i for shard in shards for i in shard) == list(range(count))
    assert [len(ShardSampler(count, rank=r, world_size=world)) for r in range(world)] == [len(s) for s in shards]
    with pytest.raises(ValueError):
        ShardSampler(count, rank=world, world_size=world)


def test_loaders_do_not_draw_on_the_global_rng():
    """A validation pass (or a new epoch) in the middle of training must not shift its random stream."""
    sampler = ResumableBatchSampler(8, global_batch=2, seed=0)
    loaders = [build_train_loader(list(zip(range(8), range(8))), sampler, num_workers=0, pin_memory=False, seed=0,
                                  num_classes=8, ignore_index=255),
               build_eval_loader(list(range(5)), batch_size=2)]
    for loader in loaders:
        torch.manual_seed(1)
        expected = torch.rand(3)
        torch.manual_seed(1)
        list(loader)
        assert torch.equal(torch.rand(3), expected)


def test_train_batches_resume_at_any_iteration_across_epochs():
    sampler = ResumableBatchSampler(10, global_batch=4, seed=2)  # 2 batches per epoch
    loader = build_train_loader(_Indexed(), sampler, num_workers=0, pin_memory=False, seed=0, num_classes=10,
                                ignore_index=255)
    straight = [batch.tolist() for _, (batch, _) in zip(range(5), train_batches(loader, 0))]
    assert straight[0] != straight[2]  # a new epoch draws a new order
    for start in range(4):
        resumed = [batch.tolist() for _, (batch, _) in zip(range(5 - start), train_batches(loader, start))]
        assert resumed == straight[start:]


class _Indexed(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, key):
        return torch.tensor(key), torch.tensor(key)  # SeededDataset passes the index; (image, mask) pairs


class _Loaded(Dataset):
    """(index, the pid and the parent pid of the process that loaded it) pairs as (image, mask)."""

    def __len__(self):
        return 6

    def __getitem__(self, key):
        return torch.tensor(key), torch.tensor([os.getpid(), os.getppid()])


def _loaders(rank: int, world_size: int) -> list:
    sampler = ResumableBatchSampler(6, global_batch=2, seed=0, rank=rank, world_size=world_size)
    return [build_train_loader(_Loaded(), sampler, num_workers=1, pin_memory=False, seed=0,
                               num_classes=2**31 - 1, ignore_index=255),
            build_eval_loader(_Loaded(), num_workers=1, rank=rank, world_size=world_size)]


def _loaded(loader) -> dict:
    try:
        batches = list(loader)
    finally:
        shutdown_workers(loader)  # persistent workers ignore SIGTERM: left alive, they would hold up the exit
    parents = {int(parent) for _, pids in batches for parent in pids.reshape(-1, 2)[:, 1]}
    return {"method": loader.multiprocessing_context.get_start_method() if loader.multiprocessing_context else None,
            "indices": [batch.tolist() for batch, _ in batches], "worker_parents": sorted(parents),
            "pid": os.getpid()}


def _distributed_loaders(rank: int, world_size: int, port: int, out_dir) -> None:
    init_gloo(rank, world_size, port)
    try:
        (out_dir / f"rank{rank}.json").write_text(json.dumps([_loaded(loader) for loader in _loaders(rank, 2)]))
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


@pytest.mark.skipif("forkserver" not in __import__("multiprocessing").get_all_start_methods(),
                    reason="no forkserver on this platform")
def test_workers_of_a_distributed_process_start_from_a_forkserver_not_from_a_fork_of_it(tmp_path):
    """A process group's threads make forking the process unsafe (syncseg.engine.samplers.worker_context):
    there, the workers of both loaders are not children of the process, and load the same batches."""
    start_ranks(_distributed_loaders, (2, free_port(), tmp_path), 2)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, loaders in enumerate(ranks):
        reference = _loaders(rank, 2)  # no process group here: forked workers, as a single process has them
        for distributed, single in zip(loaders, (_loaded(loader) for loader in reference)):
            assert (distributed["method"], single["method"]) == ("forkserver", None)
            assert single["worker_parents"] == [single["pid"]]  # forked from this process
            assert distributed["pid"] not in distributed["worker_parents"]  # the forkserver's children
            assert distributed["indices"] == single["indices"] and distributed["indices"]
