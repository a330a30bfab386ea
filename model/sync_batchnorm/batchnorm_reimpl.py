"""A plain-autograd BatchNorm2d, used as an independent numeric reference in tests.

Every quantity is written out with elementary tensor operations, so its gradients come from autograd
itself rather than from any hand-written backward.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["BatchNorm2dReimpl"]


class BatchNorm2dReimpl(nn.Module):
    """BatchNorm2d semantics (biased variance to normalize, unbiased for the running estimate)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def reset_parameters(self) -> None:
        self.running_mean.zero_()
        self.running_var.fill_(1)
        nn.init.uniform_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = input.shape
        if channels != self.num_features:
            raise ValueError(f"expected {self.num_features} channels, got input of shape {tuple(input.shape)}")
        if not self.training:
            mean, var = self.running_mean, self.running_var
        else:
            columns = input.permute(1, 0, 2, 3).reshape(channels, -1)  # C x (N*H*W)
            count = columns.size(1)
            mean = columns.sum(1) / count
            centered = columns - mean.unsqueeze(1)
            var = (centered * centered).sum(1) / count
            with torch.no_grad():
                unbiased = var * count / (count - 1)
                self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean.detach())
                self.running_var.mul_(1 - self.momentum).add_(self.momentum * unbiased.detach())
        shape = (1, channels, 1, 1)
        normalized = (input - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return normalized * self.weight.view(shape) + self.bias.view(shape)
