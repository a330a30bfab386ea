"""CUDA checks: skipped without a GPU, run by scripts/gpu_check.sh on a GPU machine.

Real DataParallelWithCallback over the visible GPUs (torch's replicate, broadcast and parallel_apply)
against nn.BatchNorm2d on the concatenated batch.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from syncseg.model.sync_batchnorm import DataParallelWithCallback, SynchronizedBatchNorm2d, convert_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")


def make_pair(channels: int = 8):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()).cuda()
    with torch.no_grad():
        reference[1].weight.uniform_(0.5, 1.5)
        reference[1].bias.uniform_(-1, 1)
    sync = convert_model(nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()))
    sync.load_state_dict(reference.state_dict())
    return sync.cuda(), reference


def test_single_gpu_equals_nn_batchnorm_and_synchronized_path_matches():
    sync, reference = make_pair()
    x = torch.randn(6, 3, 17, 19, device="cuda")
    assert torch.equal(sync(x), reference(x))
    layer = sync[1]
    features = torch.randn(6, 8, 9, 9, device="cuda", requires_grad=True)
    plain = nn.BatchNorm2d(8).cuda()
    plain.load_state_dict(layer.state_dict())
    features_ref = features.detach().clone().requires_grad_()
    upstream = torch.randn_like(features)
    y = layer._forward_synchronized(features, None, 0.1, layer.running_mean, layer.running_var)
    y.backward(upstream)
    plain(features_ref).backward(upstream)
    torch.testing.assert_close(features.grad, features_ref.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_on_gpu(dtype):
    layer = SynchronizedBatchNorm2d(8).cuda()
    x = (torch.randn(4, 8, 9, 9, device="cuda") * 2 + 30).to(dtype).requires_grad_()
    y = layer._forward_synchronized(x, None, 0.1, layer.running_mean, layer.running_var)
    assert y.dtype == dtype and layer.running_mean.dtype == torch.float32
    y.backward(torch.randn_like(y))
    assert x.grad.dtype == dtype
    expected = nn.BatchNorm2d(8).double().cuda()
    expected(x.detach().double())
    torch.testing.assert_close(layer.running_mean.double(), expected.running_mean, rtol=1e-5, atol=1e-5)


@needs_two_gpus
@pytest.mark.parametrize("batch", [8, 5, 1])
def test_data_parallel_over_all_gpus_equals_batchnorm_on_concatenated_batch(batch):
    sync, reference = make_pair()
    devices = list(range(torch.cuda.device_count()))
    model = DataParallelWithCallback(sync, device_ids=devices)
    for step in range(3):
        x = torch.randn(batch, 3, 17, 19, device="cuda") * (step + 1)
        upstream = torch.randn(batch, 8, 17, 19, device="cuda")
        y = model(x)
        y.backward(upstream)
        y_ref = reference(x)
        y_ref.backward(upstream)
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
        for (name, p), p_ref in zip(sync.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-3, atol=1e-4, msg=name)
            p.grad = None
            p_ref.grad = None
    torch.testing.assert_close(sync[1].running_var, reference[1].running_var, rtol=1e-4, atol=1e-5)


@needs_two_gpus
def test_data_parallel_under_autocast():
    """bf16, not CUDA autocast's default fp16: torch's parallel_apply re-enters autocast in each replica
    thread, and a replica that lost the caller's dtype would compute in fp16, which an fp16 test cannot
    tell from the dtype asked for."""
    sync, reference = make_pair()
    model = DataParallelWithCallback(sync, device_ids=list(range(torch.cuda.device_count())))
    x = torch.randn(8, 3, 17, 19, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = model(x)
        y_ref = reference(x)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    # bf16 keeps 8 significant bits: one unit in the last place is 2**-7 of the value
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=3e-2, atol=3e-2)


def _thread_replica_step(inputs, upstream, channels, memory_format):
    """Thread replicas of one layer on GPU 0 (the CUDA fused backward), as syncseg.model.sync_batchnorm.unittest.run_replicas runs them."""
    from syncseg.model.sync_batchnorm.unittest import make_replicas, run_replicas

    sync = SynchronizedBatchNorm2d(channels).cuda()
    with torch.no_grad():
        sync.weight.uniform_(0.5, 1.5)
        sync.bias.uniform_(-1, 1)
    reference = nn.BatchNorm2d(channels).cuda()
    reference.load_state_dict(sync.state_dict())
    pieces = [piece.contiguous(memory_format=memory_format).detach().requires_grad_() for piece in inputs]
    outputs = run_replicas(make_replicas(sync, len(pieces)), pieces)
    torch.autograd.backward(outputs, [u.contiguous(memory_format=memory_format) for u in upstream])
    x = torch.cat([piece.detach() for piece in inputs]).float().requires_grad_()
    y = reference(x)
    y.backward(torch.cat(upstream).float())
    return pieces, outputs, x, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_fused_backward_thread_replicas_uneven_equal_batchnorm_on_concatenated_batch(dtype, memory_format):
    from syncseg.model.sync_batchnorm.functions import uses_fused_kernels

    splits = [1, 3, 4]
    x = torch.randn(sum(splits), 16, 9, 11, device="cuda") * 2 + 3
    upstream = torch.randn_like(x)
    assert uses_fused_kernels(x)
    pieces, outputs, x_ref, y_ref = _thread_replica_step(list(x.to(dtype).split(splits)),
                                                         list(upstream.to(dtype).split(splits)), 16, memory_format)
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    assert all(output.dtype == dtype for output in outputs)
    torch.testing.assert_close(torch.cat(outputs).float(), y_ref.detach(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(torch.cat([p.grad for p in pieces]).float(), x_ref.grad, rtol=tolerance,
                               atol=tolerance)


def test_divergence_labels_on_cuda_are_checked_from_an_asynchronous_copy_at_the_next_call(monkeypatch):
    """On CUDA the label sums are not read at the exchange (that would wait for the device queue): an
    asynchronous copy is checked at the layer's next synchronized call, which raises naming both layers."""
    from syncseg.model.sync_batchnorm import SyncDivergenceError, name_synchronized_layers
    from syncseg.model.sync_batchnorm import batchnorm as batchnorm_module
    from syncseg.model.sync_batchnorm.divergence import label_values

    model = name_synchronized_layers(nn.Sequential(SynchronizedBatchNorm2d(3), SynchronizedBatchNorm2d(3)))
    monkeypatch.setattr(batchnorm_module.dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(batchnorm_module.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(batchnorm_module.dist, "get_world_size", lambda group=None: 2)
    rows = [label_values(model[0]._sync_key, 1, 0, 2), label_values(model[1]._sync_key, 1, 1, 2)]
    sums = torch.tensor(rows, dtype=torch.float64, device="cuda").sum(0)
    reads = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append("tolist") or [])
    model[0]._check_labels(sums, None, (model[0]._sync_key, 1))
    monkeypatch.undo()
    monkeypatch.setattr(batchnorm_module.dist, "get_process_group_ranks", lambda group: [0, 1])
    assert reads == [] and len(model[0]._pending_label_checks) == 1
    torch.cuda.synchronize()
    with pytest.raises(SyncDivergenceError, match=r"rank 0 called '0' \(call 1\) but rank 1 called '1' \(call 1\)"):
        model[0]._check_pending_labels()


def test_compiled_synchronized_path_on_one_gpu_gives_the_eager_values():
    """torch.compile (inductor: Triton kernels) of the synchronized path with nothing to exchange (eps mode
    'clamp' on one device), without a graph break, against the eager path: output, gradients, running
    statistics. The exchange itself (functional collectives, the label ops) needs processes: gloo on CPU
    tests it (model/sync_batchnorm/tests/test_compile.py)."""
    import copy

    from syncseg.model.sync_batchnorm import get_sbn_eps_mode, set_sbn_eps_mode

    saved = get_sbn_eps_mode()
    set_sbn_eps_mode("clamp")
    try:
        eager = make_pair()[0]
        compiled_model = copy.deepcopy(eager)
        forward = torch.compile(compiled_model, fullgraph=True)
        x = torch.randn(6, 3, 17, 19, device="cuda")
        upstream = torch.randn(6, 8, 17, 19, device="cuda")
        for model, run in ((eager, eager), (compiled_model, forward)):
            run(x).backward(upstream)
        torch.testing.assert_close(forward(x), eager(x), rtol=1e-4, atol=1e-5)
        expected_grads = dict(eager.named_parameters())
        for name, got in compiled_model.named_parameters():
            if name != "0.bias":  # a bias before BatchNorm has no gradient but round-off (~1e-4 here)
                torch.testing.assert_close(got.grad, expected_grads[name].grad, rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(compiled_model[1].running_var, eager[1].running_var, rtol=1e-5, atol=1e-6)
    finally:
        set_sbn_eps_mode(saved)
