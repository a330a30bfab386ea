"""No hangs (aborts, timeouts, uneven replica counts), clear errors; state dicts, copies and conversion."""
from __future__ import annotations

import contextlib
import copy
import io
import pickle
import queue
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sync_batchnorm import (
    convert_model,
    DataParallelWithCallback,
    execute_replication_callbacks,
    FutureResult,
    revert_model,
    SlavePipe,
    SyncAbortedError,
    SynchronizedBatchNorm1d,
    SynchronizedBatchNorm2d,
    SynchronizedBatchNorm3d,
)
from sync_batchnorm.unittest import make_replicas, run_replicas

from layer_pairs import assert_close, randomize_affine, pair


# --------------------------------------------------------------------------------------------------
# Failure handling: no hangs, uneven replica counts, clear errors.
# --------------------------------------------------------------------------------------------------
class FailOnFlag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise RuntimeError("replica failure injected by the test")
        return x


@pytest.mark.parametrize("failing_copy", [0, 2])
def test_failing_replica_makes_every_replica_raise_quickly_and_next_step_works(failing_copy):
    model = nn.Sequential(FailOnFlag(), SynchronizedBatchNorm2d(3), SynchronizedBatchNorm2d(3))
    model[1].sync_timeout = 120.0  # the abort must come long before this
    replicas = make_replicas(model, 3)
    replicas[failing_copy][0].fail = True
    start = time.monotonic()
    with pytest.raises((RuntimeError, SyncAbortedError)):
        run_replicas(replicas, [torch.randn(2, 3, 4, 4) for _ in range(3)], join_timeout=30)
    assert time.monotonic() - start < 10
    replicas[failing_copy][0].fail = False
    x = torch.randn(6, 3, 4, 4, dtype=torch.float32)
    outputs = run_replicas(replicas, list(x.split(2)))
    expected = nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3))(x)
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=1e-5, atol=1e-5)


def test_timeout_bounds_the_wait_when_a_replica_never_arrives():
    sync = SynchronizedBatchNorm2d(3)
    replicas = make_replicas(sync, 2)
    replicas[0].sync_timeout = 0.5
    from sync_batchnorm import execute_replication_callbacks

    execute_replication_callbacks(replicas)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        replicas[0](torch.randn(2, 3, 2, 2))  # the master alone: its slave never comes
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("bad_copy", [0, 1, 3])
def test_a_layer_error_in_one_thread_replica_aborts_the_round_for_the_others(bad_copy):
    """Without DataParallelWithCallback's guard: the layer itself fails the rendezvous."""
    sync = SynchronizedBatchNorm2d(3)
    sync.sync_timeout = 120.0
    replicas = make_replicas(sync, 4)
    inputs = [torch.randn(2, 3, 4, 4) for _ in range(4)]
    inputs[bad_copy] = torch.randn(2, 5, 4, 4)  # wrong channel count
    start = time.monotonic()
    with pytest.raises((ValueError, SyncAbortedError)) as error:
        run_replicas(replicas, inputs, join_timeout=30, guard=False)
    assert time.monotonic() - start < 10
    assert "expected 3 channels" in str(error.value) or "expected 3 channels" in str(error.value.__cause__)


def test_the_round_timeout_bounds_the_whole_wait_not_each_message():
    sync = SynchronizedBatchNorm2d(3)
    sync.sync_timeout = 1.0
    replicas = make_replicas(sync, 3)
    execute_replication_callbacks(replicas)
    def arrive_late():
        time.sleep(0.7)
        with contextlib.suppress(SyncAbortedError, TimeoutError):  # the master gave up on this round
            replicas[1](torch.randn(2, 3, 2, 2))

    late = threading.Thread(target=arrive_late, daemon=True)
    late.start()  # one slave comes late, the other never: the master gives up 1 s after it started
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="only 1 arrived"):
        replicas[0](torch.randn(2, 3, 2, 2))
    assert time.monotonic() - start < 1.6
    late.join(5)


def test_slave_pipe_keeps_the_original_call_shape():
    future = FutureResult()
    pipe = SlavePipe(1, queue.Queue(), future)
    assert pipe.timeout > 0
    future.put("result")
    assert pipe.run_slave("message") == "result" and pipe.queue.get_nowait() == (1, "message")


def test_fewer_replicas_than_previous_step():
    sync, reference = pair(SynchronizedBatchNorm2d, nn.BatchNorm2d, 3, torch.float64)
    replicas = make_replicas(sync, 4)
    for count, batch in [(4, 8), (2, 3), (1, 2), (3, 5)]:
        x = torch.randn(batch, 3, 3, 3, dtype=torch.float64)
        splits = [len(c) for c in x.tensor_split(count)]
        outputs = run_replicas(replicas[:count], list(x.split(splits)))
        assert_close(torch.cat(outputs), reference(x), torch.float64, f"{count} replicas")


def test_one_value_per_channel_raises_value_error():
    sync = SynchronizedBatchNorm1d(3)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(torch.randn(1, 3))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync._forward_synchronized(torch.randn(1, 3), None, 0.1, sync.running_mean, sync.running_var)
    # thread replicas where the total is a single value: one replica with one sample, one with none
    replicas = make_replicas(SynchronizedBatchNorm1d(3), 2)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        run_replicas(replicas, [torch.randn(1, 3), torch.randn(0, 3)])


@pytest.mark.parametrize(
    "module, shape, expected",
    [
        (SynchronizedBatchNorm2d(3), (2, 3, 4), r"expected 4D input of shape \(N, 3, H, W\), got 3D input of shape \(2, 3, 4\)"),
        (SynchronizedBatchNorm2d(3), (2, 5, 4, 4), r"expected 3 channels .* got shape \(2, 5, 4, 4\)"),
        (SynchronizedBatchNorm1d(3), (2, 3, 4, 4), r"expected 2D or 3D input"),
        (SynchronizedBatchNorm3d(3), (2, 3, 4, 4), r"expected 5D input"),
    ],
)
def test_wrong_shape_raises_value_error_with_expected_and_actual(module, shape, expected):
    with pytest.raises(ValueError, match=expected):
        module(torch.randn(shape))


# --------------------------------------------------------------------------------------------------
# State dict, copies, conversion.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sync_class, plain_class",
    [(SynchronizedBatchNorm1d, nn.BatchNorm1d), (SynchronizedBatchNorm2d, nn.BatchNorm2d),
     (SynchronizedBatchNorm3d, nn.BatchNorm3d)],
)
def test_state_dict_keys_equal_nn_batchnorm_and_load_strictly_both_ways(sync_class, plain_class):
    sync, plain = sync_class(5), plain_class(5)
    assert list(sync.state_dict()) == list(plain.state_dict())
    randomize_affine(plain)
    plain.running_mean.uniform_()
    plain.num_batches_tracked.fill_(7)
    sync.load_state_dict(plain.state_dict(), strict=True)
    back = plain_class(5)
    back.load_state_dict(sync.state_dict(), strict=True)
    for key, value in plain.state_dict().items():
        assert torch.equal(back.state_dict()[key], value)


def test_deepcopy_pickle_and_torch_save_of_module_and_wrapped_model(tmp_path, no_accelerator):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), SynchronizedBatchNorm2d(4))
    # run one synchronized round first so runtime rendezvous state exists
    run_replicas(make_replicas(model, 2), [torch.randn(2, 3, 3, 3), torch.randn(2, 3, 3, 3)])
    model(torch.randn(2, 3, 3, 3))
    model.eval()
    x = torch.randn(2, 3, 3, 3)
    expected = model(x)
    wrapped = DataParallelWithCallback(model, device_ids=[])
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model)), copy.deepcopy(wrapped).module,
              pickle.loads(pickle.dumps(wrapped)).module]
    for obj in (model, wrapped):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        copies.append(loaded.module if isinstance(loaded, nn.DataParallel) else loaded)
    for loaded in copies:
        assert torch.equal(loaded(x), expected)
        loaded.train()
        loaded(torch.randn(2, 3, 3, 3))  # still trains on one device
    # a copy trains as replicas too
    run_replicas(make_replicas(copies[1], 2), [torch.randn(2, 3, 3, 3), torch.randn(2, 3, 3, 3)])


def test_state_dict_of_wrapped_model_loads_into_plain_batchnorm(tmp_path, no_accelerator):
    model = DataParallelWithCallback(nn.Sequential(nn.Conv2d(3, 4, 1), SynchronizedBatchNorm2d(4)), device_ids=[])
    path = tmp_path / "weights.pt"
    torch.save(model.module.state_dict(), path)
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    plain.load_state_dict(torch.load(path, weights_only=True), strict=True)


def test_convert_and_revert_share_tensors_and_keep_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.Flatten(), nn.BatchNorm1d(36)))
    model(torch.randn(4, 3, 3, 3))  # non-trivial running stats
    model.eval()
    x = torch.randn(2, 3, 3, 3)
    expected = model(x)
    weight = model[1].weight
    converted = convert_model(model)
    assert isinstance(converted[1], SynchronizedBatchNorm2d)
    assert isinstance(converted[2][1], SynchronizedBatchNorm1d)
    assert converted[1].weight is weight and not converted[1].training
    assert torch.equal(converted(x), expected)
    reverted = revert_model(converted)
    assert type(reverted[1]) is nn.BatchNorm2d and type(reverted[2][1]) is nn.BatchNorm1d
    assert torch.equal(reverted(x), expected)


def test_convert_data_parallel_keeps_device_ids(no_accelerator):
    wrapped = nn.DataParallel(nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)), device_ids=[])
    converted = convert_model(wrapped)
    assert isinstance(converted, DataParallelWithCallback)
    # without an accelerator DataParallel keeps only device_ids (no dim or output_device attributes)
    assert converted.device_ids == wrapped.device_ids
    assert getattr(converted, "dim", 0) == getattr(wrapped, "dim", 0)
    assert isinstance(converted.module[1], SynchronizedBatchNorm2d)
    reverted = revert_model(converted)
    assert type(reverted) is nn.DataParallel and type(reverted.module[1]) is nn.BatchNorm2d


def test_reverted_model_traces_for_export():
    model = convert_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    model(torch.randn(4, 3, 8, 8))
    model.eval()
    traced = torch.jit.trace(revert_model(model), torch.randn(1, 3, 8, 8))
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(traced(x), model(x))


def test_no_distributed_means_plain_batch_norm_even_with_group_attribute():
    sync = SynchronizedBatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2)
    assert torch.equal(sync(x), F.batch_norm(x, None, None, sync.weight, sync.bias, True, 0.1, sync.eps))


def test_synchronizes_tells_whether_replicas_will_reduce_together():
    from sync_batchnorm import execute_replication_callbacks

    alone = SynchronizedBatchNorm2d(3)
    assert not alone.synchronizes()
    replicas = make_replicas(alone, 2)
    execute_replication_callbacks(replicas)
    assert all(r.synchronizes() for r in replicas)
    single = make_replicas(alone, 1)
    execute_replication_callbacks(single)  # one replica (e.g. the last, smallest batch): nothing to wait for
    assert not single[0].synchronizes()
