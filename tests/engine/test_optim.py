"""The poly schedule with warmup against torch's own schedulers; optimizer construction."""
from __future__ import annotations

import pytest
import torch

from syncseg.engine.optim import PolyWarmupLR, build_optimizer, fused_supported, load_optimizer_state, poly_warmup_factor


def test_poly_schedule_matches_torch_polynomial_lr():
    params = [torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD([{"params": params, "lr": 0.1}], lr=0.1)
    reference_opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1}], lr=0.1)
    scheduler = PolyWarmupLR(optimizer, total_iters=20, power=0.9)
    reference = torch.optim.lr_scheduler.PolynomialLR(reference_opt, total_iters=20, power=0.9)
    for _ in range(20):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(reference_opt.param_groups[0]["lr"], rel=1e-9)
        optimizer.step(), reference_opt.step()
        scheduler.step(), reference.step()


def test_warmup_matches_torch_linear_then_polynomial_chain():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    reference_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    warmup = 5
    scheduler = PolyWarmupLR(optimizer, total_iters=30, power=0.9, warmup_iters=warmup)
    reference = torch.optim.lr_scheduler.ChainedScheduler([
        torch.optim.lr_scheduler.LinearLR(reference_opt, start_factor=1 / warmup, total_iters=warmup - 1),
        torch.optim.lr_scheduler.PolynomialLR(reference_opt, total_iters=30, power=0.9),
    ])
    for _ in range(30):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(reference_opt.param_groups[0]["lr"], rel=1e-9)
        optimizer.step(), reference_opt.step()
        scheduler.step(), reference.step()


def test_schedule_state_restores_lr_and_keeps_group_ratio():
    head, backbone = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    groups = [{"name": "backbone", "params": [backbone], "lr": 0.01, "weight_decay": 0.0},
              {"name": "head", "params": [head], "lr": 0.1, "weight_decay": 0.0}]
    optimizer = build_optimizer(groups, _TrainCfg())
    scheduler = PolyWarmupLR(optimizer, total_iters=10, power=1.0)
    for _ in range(4):
        scheduler.step()
    lrs = scheduler.get_last_lr()
    assert lrs[1] / lrs[0] == pytest.approx(10.0)
    assert lrs[0] == pytest.approx(0.01 * poly_warmup_factor(4, total_iters=10, power=1.0, warmup_iters=0))
    fresh = PolyWarmupLR(build_optimizer([dict(g) for g in groups], _TrainCfg()), total_iters=10, power=1.0)
    fresh.load_state_dict(scheduler.state_dict())
    assert fresh.get_last_lr() == pytest.approx(lrs)


class _TrainCfg:
    optimizer = "sgd"
    lr = 0.01
    momentum = 0.9
    weight_decay = 0.0


def test_build_optimizer_takes_the_configured_kind_and_settings():
    params = [torch.nn.Parameter(torch.zeros(1))]
    cfg = _TrainCfg()
    sgd = build_optimizer([{"params": params}], cfg)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    cfg.optimizer = "adamw"
    assert isinstance(build_optimizer([{"params": params}], cfg), torch.optim.AdamW)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_cpu_optimizer_is_fused_and_updates_as_the_per_tensor_loop(kind):
    """The fused kernels are torch's same update in one pass: float64 keeps rounding out of the comparison."""
    torch.manual_seed(0)
    shapes = [(64, 3, 3, 3), (64,), (10, 64)]
    initial = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
    grads = [[torch.randn(shape, dtype=torch.float64) for shape in shapes] for _ in range(4)]
    cfg = _TrainCfg()
    cfg.optimizer, cfg.weight_decay = kind, 0.01
    runs = []
    for fused in (True, False):
        params = [torch.nn.Parameter(value.clone()) for value in initial]
        optimizer = build_optimizer([{"params": params}], cfg)
        assert optimizer.param_groups[0]["fused"] is True
        if not fused:  # torch's default on a CPU: the loop over tensors
            optimizer.param_groups[0]["fused"], optimizer.param_groups[0]["foreach"] = False, False
        for step_grads in grads:
            for param, grad in zip(params, step_grads):
                param.grad = grad.clone()
            optimizer.step()
        runs.append([param.detach() for param in params])
    assert not torch.equal(runs[0][0], initial[0])
    for fused_param, loop_param in zip(*runs):
        torch.testing.assert_close(fused_param, loop_param, rtol=1e-12, atol=1e-14)


def test_fused_only_where_torch_has_the_kernels():
    assert fused_supported([{"params": [torch.nn.Parameter(torch.zeros(2))]}])
    assert not fused_supported([{"params": [torch.nn.Parameter(torch.zeros(2, device="meta"))]}])
    assert not fused_supported([{"params": []}])


def test_a_checkpoint_from_the_unfused_optimizer_resumes_fused_with_the_configured_lr():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5))]
    old = torch.optim.AdamW([{"params": params, "initial_lr": 0.5, "weight_decay": 0.5}], lr=0.5)  # fused=None
    params[0].grad = torch.randn(5)
    old.step()
    cfg = _TrainCfg()
    cfg.optimizer = "adamw"
    new = build_optimizer([{"params": params, "initial_lr": 0.01, "weight_decay": 0.0}], cfg)
    load_optimizer_state(new, old.state_dict())
    group = new.param_groups[0]
    assert (group["fused"], group["initial_lr"], group["weight_decay"]) == (True, 0.01, 0.0)
    torch.testing.assert_close(new.state[params[0]]["exp_avg"], old.state[params[0]]["exp_avg"])
    new.step()  # the restored moments and step count go through the fused kernel
    assert int(new.state[params[0]]["step"]) == 2


def test_an_unfused_checkpoint_resumed_fused_moves_each_step_to_its_parameter():
    """torch moves a loaded `step` to the parameter's device only when the *saved* group was fused or
    capturable, so an unfused (host-step) checkpoint loaded into the fused CUDA optimizer left host steps
    for the fused kernel (with a GradScaler: `_foreach_sub_(steps, found_inf)` across devices). Parameters
    on the meta device stand in for CUDA: the fused group must hold its steps where its parameters are.
    (SGD keeps no step tensor: AdamW is the case.)"""
    torch.manual_seed(0)
    cpu_params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
    old = torch.optim.AdamW(cpu_params, lr=0.1)  # fused=None: torch's loop, steps on the host
    for param in cpu_params:
        param.grad = torch.randn_like(param)
    old.step()
    meta_params = [torch.nn.Parameter(torch.empty_like(p, device="meta")) for p in cpu_params]
    new = torch.optim.AdamW(meta_params, lr=0.1)
    new.param_groups[0]["fused"] = True  # as build_optimizer configures it on CUDA (torch refuses meta here)
    load_optimizer_state(new, old.state_dict())
    for param in meta_params:
        state = new.state[param]
        assert state["step"].device == param.device, f"step on {state['step'].device}, parameter on {param.device}"
        assert state["step"].dtype == torch.float32
        assert state["exp_avg"].device == param.device  # the moments already followed their parameter
