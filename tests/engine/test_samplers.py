"""Training batches, evaluation shards and the loaders built on them."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from syncseg.engine.samplers import (
    ResumableBatchSampler,
    ShardSampler,
    build_eval_loader,
    build_train_loader,
    split_batch,
    train_batches,
)


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
