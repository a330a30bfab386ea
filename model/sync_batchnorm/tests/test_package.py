"""The installed distribution: its public API (the original package's, plus ours), what it imports, and the
original's eps modes."""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import sync_batchnorm
from sync_batchnorm import (
    SynchronizedBatchNorm2d,
    convert_model,
    name_synchronized_layers,
    patch_sync_batchnorm,
    set_sbn_eps_mode,
    synchronized_layers,
)
from sync_batchnorm.unittest import make_replicas, run_replicas

PACKAGE = Path(sync_batchnorm.__file__).parent
MODULES = sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")
ORIGINAL_API = ["set_sbn_eps_mode", "SynchronizedBatchNorm1d", "SynchronizedBatchNorm2d", "SynchronizedBatchNorm3d",
                "patch_sync_batchnorm", "convert_model", "DataParallelWithCallback", "patch_replication_callback"]


def test_the_original_packages_api_and_every_public_name_of_every_module_are_exported():
    for name in ORIGINAL_API:
        assert hasattr(sync_batchnorm, name), name
    assert {"DEFAULT_TIMEOUT", "abort_synchronization", "AbortingReplica"} <= set(sync_batchnorm.__all__)
    for module_name in MODULES:
        if module_name == "unittest":  # test support, imported as sync_batchnorm.unittest (as in the original)
            continue
        module = importlib.import_module(f"sync_batchnorm.{module_name}")
        missing = [name for name in getattr(module, "__all__", []) if name not in sync_batchnorm.__all__]
        assert not missing, f"sync_batchnorm.{module_name} lists {missing} in __all__; __init__ does not export them"
    assert all(getattr(sync_batchnorm, name) is not None for name in sync_batchnorm.__all__)
    assert len(sync_batchnorm.__all__) == len(set(sync_batchnorm.__all__))
    from sync_batchnorm.batchnorm_reimpl import BatchNorm2dReimpl  # noqa: F401  the original's test imports it
    from sync_batchnorm.unittest import TorchTestCase  # noqa: F401


def _imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_source_imports_only_itself_torch_and_the_standard_library():
    for module_name in MODULES + ["__init__"]:
        outside = {name for name in _imported_names(PACKAGE / f"{module_name}.py")
                   if name not in sys.stdlib_module_names and name not in ("torch", "__future__")}
        assert not outside, f"sync_batchnorm/{module_name}.py imports {sorted(outside)}"


def test_importing_the_package_loads_nothing_but_torch_and_the_standard_library(tmp_path):
    """At run time too: whatever `import sync_batchnorm` (and its every module) adds to sys.modules after
    `import torch` is the package's own or the standard library's."""
    code = ("import sys, torch; before = set(sys.modules); import sync_batchnorm; "
            + "".join(f"import sync_batchnorm.{name}; " for name in MODULES)
            + "print('\\n'.join(sorted(set(sys.modules) - before)))")
    done = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    added = done.stdout.split()
    assert "sync_batchnorm" in added
    allowed = (*sys.stdlib_module_names, "sync_batchnorm", "torch")
    outside = [name for name in added if name.split(".")[0] not in allowed]
    assert not outside, outside


# --------------------------------------------------------------------------------------------------
# set_sbn_eps_mode: 'plus' (default, nn.BatchNorm's) or 'clamp' (the original's), on every topology.
# --------------------------------------------------------------------------------------------------
def clamp_reference(x, weight, bias, eps):
    """1/sqrt(max(var, eps)) in plain autograd: the variance's gradient stops where the clamp holds."""
    mean = x.mean((0, 2, 3), keepdim=True)
    var = (x - mean).square().mean((0, 2, 3), keepdim=True)
    return (x - mean) / var.clamp_min(eps).sqrt() * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)


@pytest.mark.parametrize("splits", [[6], [2, 4]])
def test_clamp_mode_divides_by_the_clamped_variance_with_its_gradient(eps_mode, splits):
    eps_mode("clamp")
    dtype, eps = torch.float64, 1e-2
    x = torch.randn(6, 3, 3, 3, dtype=dtype) * 2 + 1
    x[:, 0] = 1 + 0.05 * x[:, 0] / x[:, 0].std()  # variance ~eps / 4: clamped, and far from var + eps
    upstream = torch.randn_like(x)
    sync = SynchronizedBatchNorm2d(3, eps=eps).to(dtype)
    with torch.no_grad():
        sync.weight.uniform_(0.5, 1.5)
        sync.bias.normal_()
    weight, bias = sync.weight.detach().clone().requires_grad_(), sync.bias.detach().clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    expected = clamp_reference(x_ref, weight, bias, eps)
    expected.backward(upstream)
    plain = nn.BatchNorm2d(3, eps=eps).to(dtype)
    plain.load_state_dict(sync.state_dict())
    plain_output = plain(x)
    replicas = make_replicas(sync, len(splits))
    chunks = [c.clone().requires_grad_() for c in x.split(splits)]
    outputs = run_replicas(replicas, chunks) if len(splits) > 1 else [replicas[0](chunks[0])]
    torch.autograd.backward(outputs, list(upstream.split(splits)))
    tol = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat(outputs), expected.detach(), **tol)
    assert (torch.cat(outputs) - plain_output).abs().max() > 1e-2  # 'plus' would give another answer
    torch.testing.assert_close(torch.cat([c.grad for c in chunks]), x_ref.grad, **tol)
    torch.testing.assert_close(sum(r.weight.grad for r in replicas), weight.grad, **tol)
    torch.testing.assert_close(sum(r.bias.grad for r in replicas), bias.grad, **tol)
    torch.testing.assert_close(replicas[0].running_var, plain.running_var, **tol)  # running statistics as before


def test_plus_is_the_default_and_other_modes_are_refused(eps_mode):
    assert sync_batchnorm.get_sbn_eps_mode() == "plus"
    with pytest.raises(ValueError, match=r"set_sbn_eps_mode\('clip'\).*'plus', 'clamp'"):
        set_sbn_eps_mode("clip")
    eps_mode("clamp")
    layer = SynchronizedBatchNorm2d(3).eval()
    x = torch.randn(2, 3, 2, 2)
    torch.testing.assert_close(layer(x), nn.BatchNorm2d(3).eval()(x))  # eval: running statistics, eps added


# --------------------------------------------------------------------------------------------------
# patch_sync_batchnorm, naming, process groups.
# --------------------------------------------------------------------------------------------------
def test_patch_sync_batchnorm_swaps_the_classes_within_the_block_only():
    with pytest.raises(RuntimeError), patch_sync_batchnorm():
        assert isinstance(nn.BatchNorm2d(3), SynchronizedBatchNorm2d)
        raise RuntimeError("restored on errors too")
    assert nn.BatchNorm2d is torch.nn.modules.batchnorm.BatchNorm2d


def test_convert_model_names_layers_by_path_and_sets_the_process_group():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4)))
    group = object()  # any object: the layer only hands it to torch.distributed
    converted = convert_model(model, process_group=group)
    assert [(path, layer.sync_name, layer.process_group) for path, layer in synchronized_layers(converted)] == [
        ("1", "1", group), ("2.1", "2.1", group)]
    assert converted[1].sync_names == {converted[1]._sync_key: "1", converted[2][1]._sync_key: "2.1"}
    assert convert_model(nn.Sequential(nn.BatchNorm2d(2)))[0].process_group is None
    assert SynchronizedBatchNorm2d(2, process_group=group).process_group is group


def test_replication_names_unnamed_layers_by_their_path():
    replicas = make_replicas(nn.Sequential(nn.Conv2d(3, 3, 1), SynchronizedBatchNorm2d(3)), 2)
    assert replicas[0][1].sync_name is None
    run_replicas(replicas, [torch.randn(2, 3, 2, 2), torch.randn(2, 3, 2, 2)])
    assert [r[1].sync_name for r in replicas] == ["1", "1"]
    named = name_synchronized_layers(nn.Sequential(SynchronizedBatchNorm2d(3)))
    assert named[0].sync_name == "0"
