"""A training split smaller than one global batch is repeated (issue 29 item 6): whole batches, each repeat a
new permutation, exact resume, one log line; a split of at least one batch is ordered as before."""
from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from syncseg.engine.samplers import ResumableBatchSampler
from syncseg.engine.seeding import mix_seed


def _indices(sampler: ResumableBatchSampler, epoch: int, start_batch: int = 0) -> list[list[int]]:
    sampler.set_epoch(epoch, start_batch=start_batch)
    return [[index for index, _ in batch] for batch in sampler]


def test_a_split_of_at_least_one_batch_keeps_the_order_it_had():
    """The rule changes nothing for N >= batch_size: the order is still one permutation drawn from (seed,
    epoch), recomputed here from the generator."""
    sampler = ResumableBatchSampler(10, global_batch=4, seed=5)
    assert sampler.repeats == 1 and sampler.batches_per_epoch == 2
    generator = torch.Generator().manual_seed(mix_seed(5, 3))
    order = torch.randperm(10, generator=generator).tolist()
    seeds = torch.randint(0, 2**31 - 1, (10,), generator=generator).tolist()
    sampler.set_epoch(3)
    assert list(sampler) == [list(zip(order[:4], seeds[:4])), list(zip(order[4:8], seeds[4:8]))]


@pytest.mark.parametrize("num_samples,global_batch", [(3, 4), (1, 4), (2, 8), (5, 16)])
def test_a_small_split_is_repeated_in_whole_batches_of_new_permutations(num_samples, global_batch):
    sampler = ResumableBatchSampler(num_samples, global_batch=global_batch, seed=1)
    repeats = -(-global_batch // num_samples)
    assert sampler.repeats == repeats and sampler.batches_per_epoch == num_samples * repeats // global_batch >= 1
    for epoch in range(3):
        batches = _indices(sampler, epoch)
        assert [len(batch) for batch in batches] == [global_batch] * sampler.batches_per_epoch
        flat = [index for batch in batches for index in batch]
        # each block of num_samples is a permutation: every sample once per repeat
        for block in range(len(flat) // num_samples):
            assert sorted(flat[block * num_samples:(block + 1) * num_samples]) == list(range(num_samples))
        assert max(Counter(flat).values()) <= repeats


def test_repeats_are_drawn_anew_and_epochs_differ():
    sampler = ResumableBatchSampler(3, global_batch=30, seed=0)
    flat = [index for batch in _indices(sampler, 0) for index in batch]
    blocks = {tuple(flat[start:start + 3]) for start in range(0, 30, 3)}
    assert len(blocks) > 1  # ten blocks of one fixed permutation would be a single block
    assert _indices(sampler, 0) != _indices(sampler, 1)


def test_a_small_split_resumes_exactly_and_shards_like_one_process():
    single = ResumableBatchSampler(3, global_batch=8, seed=2)
    single.set_epoch(4)
    whole = list(single)
    shards = []
    for rank in range(2):
        sampler = ResumableBatchSampler(3, global_batch=8, seed=2, rank=rank, world_size=2)
        sampler.set_epoch(4)
        shards.append(list(sampler))
    assert [first + second for first, second in zip(*shards)] == whole
    # one step per epoch here (N * repeats < batch_size + N): a resume at step 4 starts at epoch 4, which a new
    # sampler (a new process) draws exactly as the uninterrupted one did
    assert single.batches_per_epoch == 1
    assert _indices(ResumableBatchSampler(3, global_batch=8, seed=2), 4) == [[i for i, _ in b] for b in whole]


def test_the_repeat_is_logged_once_by_rank_zero(caplog):
    with caplog.at_level(logging.INFO, logger="syncseg.engine.samplers"):
        ResumableBatchSampler(3, global_batch=4, seed=0)
        ResumableBatchSampler(3, global_batch=4, seed=0, rank=1, world_size=2)
        ResumableBatchSampler(8, global_batch=4, seed=0)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and "3 sample(s), fewer than one global batch (train.batch_size=4)" in lines[0]
    assert "repeats it 2 times" in lines[0]


def test_an_empty_split_is_refused():
    with pytest.raises(ValueError, match="no samples"):
        ResumableBatchSampler(0, global_batch=4, seed=0)
