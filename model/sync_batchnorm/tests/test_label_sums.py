"""The divergence label carried in the all-reduced sums (divergence.label_values / check_label_sums): the group's
sums are exact integers in float64 at any world size, agreement is never a false alarm, and a split into two
labels names the same ranks, layers and call counts on every rank. Simulated without processes: each rank's
values are summed in float64 in random orders, as an all-reduce may."""
from __future__ import annotations

import random

import pytest
import torch

from sync_batchnorm import SyncDivergenceError, check_label_sums, layer_key
from sync_batchnorm.divergence import label_bits, label_values

NAMES = {layer_key(repr(name)): name for name in ("stem", "head", "extra", "backbone.layer4.2.bn3")}


def describe(bits_value: int, bits: int) -> str:
    mask = (1 << bits) - 1
    return next(repr(name) for key, name in NAMES.items() if key & mask == bits_value)


def group_sums(labels: list[tuple[int, int]], seed: int = 0) -> list[float]:
    """The all-reduce of every rank's label values in float64, in a random order of ranks."""
    world = len(labels)
    rows = [label_values(key, call, index, world) for index, (key, call) in enumerate(labels)]
    random.Random(seed).shuffle(rows)
    return torch.tensor(rows, dtype=torch.float64).sum(0).tolist()


def messages(labels: list[tuple[int, int]], ranks=None) -> list[str | None]:
    """What each rank raises (None: nothing) from the group's sums."""
    world = len(labels)
    sums = group_sums(labels)
    out = []
    for index, (key, call) in enumerate(labels):
        try:
            check_label_sums(sums, key, call, index, world, lambda: ranks or list(range(world)), describe)
            out.append(None)
        except SyncDivergenceError as error:
            out.append(str(error))
    return out


KEY = {name: key for key, name in NAMES.items()}


@pytest.mark.parametrize("world", [2, 3, 16, 64, 512, 4096, 2**16])
def test_the_sums_are_exact_integers_in_float64_at_any_world_size(world):
    bits = label_bits(world)
    assert bits >= 16  # low bits of a 48-bit key: two layers' keys collide with probability 2**-bits at most
    largest = (1 << bits) - 1
    assert world * largest**2 < 2**53 and world * world * largest < 2**53
    # every rank at the largest value, the worst case for rounding: the float64 sum is exact
    rows = torch.tensor([label_values(2**48 - 1, 2**40 - 1, index, world) for index in range(world)],
                        dtype=torch.float64)
    exact = [sum(label_values(2**48 - 1, 2**40 - 1, index, world)[i] for index in range(world)) for i in range(6)]
    assert [int(v) for v in rows.sum(0).tolist()] == exact


@pytest.mark.parametrize("world", [2, 16, 4096])
def test_agreement_is_never_a_divergence(world):
    labels = [(KEY["backbone.layer4.2.bn3"], 123_456_789)] * world
    assert messages(labels) == [None] * world


@pytest.mark.parametrize("world", [2, 5, 16])
def test_one_rank_calling_another_layer_is_named_in_one_message_on_every_rank(world):
    odd = world - 2
    labels = [(KEY["head"], 7)] * world
    labels[odd] = (KEY["extra"], 7)
    got = messages(labels)
    assert len(set(got)) == 1 and got[0] is not None, got
    others = [rank for rank in range(world) if rank != odd]
    assert f"rank {odd} called 'extra' (call 7)" in got[0], got[0]
    if world <= 9:
        listed = ", ".join(map(str, others))
        assert f"rank{'s' if len(others) > 1 else ''} {listed} called 'head' (call 7)" in got[0], got[0]
    else:
        assert f"the {world - 1} ranks other than rank {odd} called 'head' (call 7)" in got[0], got[0]
    assert "same order and the same number of times" in got[0]


def test_a_second_call_on_one_rank_names_both_calls_even_past_the_label_bits():
    """Call counts grow for ever (one per step): beyond 2**bits the low bits still give the exact counts."""
    world = 16
    call = 3 * 2 ** label_bits(world) + 5  # wraps in the low bits
    labels = [(KEY["head"], call)] * world
    labels[0] = (KEY["stem"], call + 1)
    got = messages(labels)
    assert len(set(got)) == 1
    assert got[0].startswith("synchronized BatchNorm exchange diverged across processes: rank 0 called 'stem' "
                             f"(call {call + 1}) but the 15 ranks other than rank 0 called 'head' (call {call})"), got[0]


def test_global_ranks_of_a_subgroup_are_named():
    labels = [(KEY["head"], 1), (KEY["head"], 1), (KEY["extra"], 1), (KEY["head"], 1)]
    got = messages(labels, ranks=[4, 5, 6, 7])
    assert len(set(got)) == 1 and "rank 6 called 'extra' (call 1)" in got[0] and "ranks 4, 5, 7 called" in got[0]


def test_two_groups_of_two_or_more_are_counted_and_three_labels_name_this_rank():
    two_by_two = messages([(KEY["head"], 1), (KEY["extra"], 1), (KEY["head"], 1), (KEY["extra"], 1)])
    assert all(message is not None for message in two_by_two)
    assert all("2 ranks called 'head' (call 1)" in m and "2 ranks called 'extra' (call 1)" in m for m in two_by_two)
    three = messages([(KEY["head"], 1), (KEY["extra"], 1), (KEY["stem"], 1), (KEY["head"], 1)])
    assert all(message is not None for message in three)
    assert "rank 1 called 'extra' (call 1) but not all 4 ranks of its group" in three[1], three[1]
