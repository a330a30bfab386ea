"""Helpers shared by the layer tests: a synchronized layer and nn.BatchNorm with the same affine parameters, and
the tolerances per dtype."""
from __future__ import annotations

import torch
from torch import nn

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def randomize_affine(module: nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
        module.bias.copy_(torch.randn(module.bias.shape, generator=generator))


def pair(sync_class, plain_class, channels: int, dtype: torch.dtype, **kwargs):
    reference = plain_class(channels, **kwargs).to(dtype)
    sync = sync_class(channels, **kwargs).to(dtype)
    if reference.affine:
        randomize_affine(reference)
        sync.load_state_dict(reference.state_dict())
    return sync, reference
