"""torch.compile: the synchronized layers compile into the model's graph (no graph break) and train as they
do eagerly; the eager path never takes the compiled one. A divergence under torch.compile:
test_compile_divergence.py; process groups: test_compile_groups.py. The gloo processes run functions of
compile_workers.py."""
from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch import nn

import sync_batchnorm
from sync_batchnorm import SynchronizedBatchNorm1d, SynchronizedBatchNorm2d, SynchronizedBatchNorm3d
from sync_batchnorm import compiled, execute_replication_callbacks
from sync_batchnorm.unittest import make_replicas

from compile_workers import LEARNING_RATE, STEPS, build, compile_worker, global_batch, loss_share
from gloo_workers import run_ranks
from layer_pairs import randomize_affine

LOSS_TOLERANCE = 1e-4  # compiled against eager (float32)


@pytest.mark.slow
def test_two_gloo_ranks_compile_without_a_graph_break_and_train_like_eager_and_batchnorm(tmp_path):
    results = run_ranks(compile_worker, tmp_path, timeout_s=900)
    for r in results:
        assert (r["graphs"], r["graph_breaks"]) == (1, 0), r["break_reasons"]

    # the global batch through nn.BatchNorm2d in one process, the same steps
    reference = build(nn.BatchNorm2d)
    optimizer = torch.optim.SGD(reference.parameters(), lr=LEARNING_RATE)
    differences = []
    for step in range(STEPS):
        x, upstream = global_batch(step)
        loss = loss_share(reference(x), upstream)
        loss.backward()
        for r in results:
            eager, compiled_run = float(r["eager"][f"loss{step}"]), float(r["compiled"][f"loss{step}"])
            differences.append(abs(compiled_run - eager))
            assert differences[-1] <= LOSS_TOLERANCE, (step, compiled_run, eager)
            assert compiled_run == pytest.approx(loss.item(), rel=1e-5, abs=1e-6), step
            for got, parameter in zip(r["compiled"][f"grads{step}"], reference.parameters()):
                torch.testing.assert_close(got, parameter.grad, rtol=1e-4, atol=1e-6)
        optimizer.step()
        optimizer.zero_grad()
    assert len({float(results[0]["eager"][f"loss{step}"]) for step in range(STEPS)}) == STEPS  # the steps do something
    for r in results:
        for name in ("bn1", "bn2"):
            layer = getattr(reference, name)
            expected = torch.stack([layer.running_mean, layer.running_var])
            torch.testing.assert_close(r["compiled"][f"{name}_running"], expected, rtol=1e-5, atol=1e-6)
            # the compiled path counts its calls on the layer as the eager path does
            assert r["compiled"][f"{name}_calls"] == r["eager"][f"{name}_calls"] == STEPS

    print(f"compiled against eager, largest loss difference over {STEPS} steps: {max(differences):.1e}")


@pytest.mark.slow
@pytest.mark.parametrize("cls,shape", [(SynchronizedBatchNorm1d, (12, 5)), (SynchronizedBatchNorm2d, (4, 5, 3, 3)),
                                       (SynchronizedBatchNorm3d, (2, 5, 2, 3, 3))])
def test_one_process_clamp_mode_compiles_without_a_graph_break_to_the_eager_values(eps_mode, cls, shape):
    """On one device the 'clamp' eps mode is the synchronized path with nothing to exchange."""
    eps_mode("clamp")
    eager = cls(5, eps=0.5)
    randomize_affine(eager)
    compiled_layer = copy.deepcopy(eager)
    scales = torch.tensor([0.1, 1, 2, 0.3, 3]).view(1, 5, *[1] * (len(shape) - 2))  # some variances below eps
    x = torch.randn(shape) * scales
    explained = torch._dynamo.explain(copy.deepcopy(eager))(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    outputs = []
    for layer, forward in ((eager, eager), (compiled_layer, torch.compile(compiled_layer, backend="aot_eager"))):
        inputs = x.clone().requires_grad_()
        output = forward(inputs)
        output.backward(torch.cos(output.detach()))
        outputs.append((output.detach(), inputs.grad, layer.weight.grad, layer.bias.grad, layer.running_var))
    for got, expected in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_the_eager_path_never_enters_the_compiled_one(monkeypatch, eps_mode):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled.forward called outside torch.compile")

    monkeypatch.setattr(compiled, "forward", refuse)
    for mode in ("plus", "clamp"):
        eps_mode(mode)
        SynchronizedBatchNorm2d(3)(torch.randn(2, 3, 4, 4)).sum().backward()


def test_every_layer_copy_is_registered_for_the_compiled_path():
    """The compiled path's custom ops find their layer by id: copies (an EMA model is a deepcopy) and unpickled
    layers register themselves, and a registry entry does not keep a layer alive."""
    layer = SynchronizedBatchNorm2d(3)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert compiled._LAYERS[id(twin)] is twin
    assert compiled._LAYERS[id(layer)] is layer
    key = id(layer)
    del layer
    gc.collect()  # a layer sits in a reference cycle (its SyncMaster holds a bound method)
    assert key not in compiled._LAYERS


@pytest.mark.parametrize("copies", ["deepcopy", "torch's replicate"])
def test_thread_replicas_under_torch_compile_raise_instead_of_waiting(copies):
    layer = SynchronizedBatchNorm2d(3)
    layer.sync_timeout = 10  # a replica that took the eager path would wait this long for the other
    if copies == "deepcopy":  # registered copies
        replicas = make_replicas(layer, 2)
    else:  # as torch.nn.parallel.replicate makes them: copies without __init__ (not registered), their
        replicas = [layer._replicate_for_data_parallel() for _ in range(2)]  # parameters set afterwards
        for replica in replicas:
            replica.weight, replica.bias = layer.weight * 1, layer.bias * 1
    execute_replication_callbacks(replicas)
    with pytest.raises(RuntimeError, match="thread replicas cannot run under torch.compile"):
        torch.compile(replicas[0], backend="eager")(torch.randn(2, 3, 4, 4))


def test_the_custom_ops_are_named_after_the_package_they_belong_to():
    """`sync_batchnorm` and an app's vendored copy (`model.sync_batchnorm`) can share a process."""
    namespace = sync_batchnorm.__name__.replace(".", "_") + "_compiled"
    assert hasattr(getattr(torch.ops, namespace), "next_label")
