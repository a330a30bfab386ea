"""Thread replicas that call the synchronized layers differently raise SyncDivergenceError at once, in every
replica, with one message naming the layers, their call counts and the replicas (2 gloo ranks:
test_distributed.py)."""
from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

from sync_batchnorm import ExchangeLedger, SyncDivergenceError, SynchronizedBatchNorm2d, layer_key
from sync_batchnorm.unittest import make_replicas, run_replicas


class Branchy(nn.Module):
    """stem -> [extra, if self.take_extra] -> head -> [tail, if self.take_tail]; stem twice if self.stem_twice.
    The extra branch's layer is 5 channels wide, the others 3 (threads exchange no rows: any widths are named)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = SynchronizedBatchNorm2d(3)
        self.extra = nn.Sequential(nn.Conv2d(3, 5, 1), SynchronizedBatchNorm2d(5), nn.Conv2d(5, 3, 1))
        self.head = SynchronizedBatchNorm2d(3)
        self.tail = SynchronizedBatchNorm2d(3)
        self.take_extra = self.take_tail = self.stem_twice = False
        for layer in (self.stem, self.extra[1], self.head, self.tail):
            layer.sync_timeout = 120.0  # the divergence must be named long before any timeout

    def forward(self, x):
        x = self.stem(x)
        if self.stem_twice:
            x = self.stem(x)
        if self.take_extra:
            x = self.extra(x)
        x = self.head(x)
        return self.tail(x) if self.take_tail else x


def diverging_step(replicas):
    """One step of replicas that diverge: (the error raised, [(replica, message) for each replica that raised]),
    within 5 s."""
    errors = []

    def call(replica, index, x):
        try:
            return replica(x)
        except SyncDivergenceError as error:
            errors.append((index, str(error)))
            raise

    start = time.monotonic()
    with pytest.raises(SyncDivergenceError) as raised:
        run_replicas(replicas, [torch.randn(2, 3, 4, 4) for _ in replicas], join_timeout=30, call=call)
    assert time.monotonic() - start < 5
    return raised.value, sorted(errors)


@pytest.mark.parametrize("count", [2, 3])
def test_an_extra_branch_in_one_replica_names_both_layers_in_every_replica(count):
    replicas = make_replicas(Branchy(), count)
    replicas[1].take_extra = True
    error, errors = diverging_step(replicas)
    assert [index for index, _ in errors] == list(range(count))  # every replica raised ...
    assert len({message for _, message in errors}) == 1  # ... the same message
    # the first replicas at exchange #2 set what it is; the first that differs names itself beside them
    message = str(error)
    assert "exchange #2 diverged" in message and "replica 1 called 'extra.1' (call 1)" in message, message
    assert re.search(r"replicas? [0-9, ]+ called 'head' \(call 1\)", message), message
    assert "same order and the same number of times" in message


def test_a_layer_called_twice_in_one_replica_names_the_call_counts():
    replicas = make_replicas(Branchy(), 2)
    replicas[0].stem_twice = True
    error, _ = diverging_step(replicas)
    assert "'stem' (call 2)" in str(error) and "'head' (call 1)" in str(error)


@pytest.mark.parametrize("ending", [0, 1])
def test_a_forward_that_ends_while_another_replica_waits_names_the_waiting_layer(ending):
    replicas = make_replicas(Branchy(), 2)
    replicas[1 - ending].take_tail = True
    error, errors = diverging_step(replicas)
    # the waiting replica raises in its layer; the one whose forward ended raises in its guard, after the forward
    assert [index for index, _ in errors] == [1 - ending]
    assert f"replica {1 - ending} called 'tail' (call 1) but replica {ending} ended the forward after 2 exchange(s)" \
        in str(error), str(error)


def test_the_next_step_after_a_divergence_works_and_matches_batchnorm():
    replicas = make_replicas(Branchy(), 2)
    replicas[1].take_extra = True
    diverging_step(replicas)
    replicas[1].take_extra = False
    x = torch.randn(6, 3, 4, 4, dtype=torch.float32)
    outputs = run_replicas(replicas, list(x.split([2, 4])))
    expected = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3))(x)
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=1e-5, atol=1e-5)


def test_ledger_compares_layer_and_call_and_aborts_once():
    aborted = []
    ledger = ExchangeLedger(aborted.append)
    ledger.record(0, "'a'", 1)
    ledger.record(1, "'a'", 1)
    ledger.record(1, "'b'", 1)
    with pytest.raises(SyncDivergenceError, match=r"exchange #2 diverged: replica 1 called 'b' \(call 1\) but "
                                                  r"replica 0 called 'a' \(call 2\)"):
        ledger.record(0, "'a'", 2)
    assert len(aborted) == 1 and isinstance(aborted[0], SyncDivergenceError)


def test_layer_key_is_stable_and_exact_in_float64():
    key = layer_key("'backbone.layer1.0.bn1'")
    assert key == layer_key("'backbone.layer1.0.bn1'") != layer_key("'backbone.layer1.0.bn2'")
    assert 0 <= key < 2**48 and int(torch.tensor(float(key), dtype=torch.float64)) == key
