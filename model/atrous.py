"""AtrousConv2d: a 3x3 convolution with dilation d and zero padding d that skips taps landing in the padding.

ASPP's rates (12/24/36 at output stride 8, 6/12/18 at 16) are large next to the feature maps they see: a
256 px crop at output stride 8 gives 32 x 32 features, where the rate-36 branch's eight outer taps read only
padding; a 375 x 500 VOC image gives 47 x 63, where most of the rate-24 and rate-36 taps do. The products
with padding zeros add nothing, so leaving them out computes the same function (summed in another order:
equal up to float rounding; tests/model/test_atrous.py checks it in float64, values and gradients):
- An axis no longer than the rate (every outer tap on it reads padding, at every position): the kernel
  keeps its middle row (or column) and that axis loses its padding. One smaller convolution, always
  cheaper: at 32 x 32, rate 36, a training step of the branch (forward and backward) took 100 ms instead of
  459 in float32 and 55 instead of 524 in bf16 on a 2-core AVX-512/AMX machine.
- Otherwise the output is cut into bands along each axis by which taps read real pixels there (rows with
  y >= d have the tap above, rows with y < H - d the tap below), and each region is one unpadded
  convolution of the input slice it reads with the sub-kernel of its valid taps. Used only for inference
  (no gradient) of bfloat16 convolutions on a CPU with AMX, where it was measured to pay: oneDNN's AMX bf16
  kernels multiply the padding in full (at 47 x 63, rates 12/24/36: 237/459/667 ms plain, 132/189/170 ms in
  regions). Its float32 kernels already skip most of it, and so do its AVX512_BF16 kernels without AMX
  (AMD's kind, rehearsed with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16: 194/132/85 ms plain, 202/157/104 in
  regions); the regions were slower there, and their backward (slices, concatenations) cost more than it
  saved.
The plain convolution runs under tracing, scripting, torch.compile and torch.export (their graphs must hold
for every input size) and wherever neither case applies.

Parameters and state dict are nn.Conv2d's (torchvision's ASPP keys load unchanged).
"""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor, nn
from torch.nn import functional as F

# regions only when the taps left out are at least this share of the plain convolution's multiply-adds:
# below it the extra calls, slices and concatenations cost about what the skipped work saves
MIN_SKIPPED_SHARE = 0.2


def axis_bands(length: int, dilation: int) -> list[tuple[int, int, int, int]]:
    """Bands (start, stop, first_tap, last_tap) tiling [0, length): on each band the taps in
    first_tap..last_tap (of -1, 0, 1) read pixels inside the axis, the others only padding."""
    edges = sorted({0, length, min(dilation, length), max(length - dilation, 0)})
    bands = []
    for start, stop in zip(edges, edges[1:]):
        first = -1 if start >= dilation else 0
        last = 1 if start < length - dilation else 0
        bands.append((start, stop, first, last))
    return bands


def skipped_share(height: int, width: int, dilation: tuple[int, int]) -> float:
    """The share of a padded 3x3 convolution's multiply-adds that fall on padding at this size."""
    kept = 1.0
    for length, rate in ((height, dilation[0]), (width, dilation[1])):
        kept *= sum((stop - start) * (last - first + 1) for start, stop, first, last in axis_bands(length, rate)) / (
            3 * length)
    return 1.0 - kept


def reduced_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: tuple[int, int]) -> Tensor | None:
    """conv2d(x, weight, bias, padding=dilation, dilation=dilation) for a 3x3 `weight` as one convolution
    without the outer taps of each axis no longer than its rate; None when no axis is."""
    (height, width), (rate_h, rate_w) = x.shape[-2:], dilation
    keep_h, keep_w = height > rate_h, width > rate_w
    if keep_h and keep_w:
        return None
    kernel = weight[:, :, slice(None) if keep_h else slice(1, 2), slice(None) if keep_w else slice(1, 2)]
    return F.conv2d(x, kernel, bias, padding=(rate_h if keep_h else 0, rate_w if keep_w else 0), dilation=dilation)


def atrous_conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, dilation: tuple[int, int]) -> Tensor:
    """conv2d(x, weight, bias, padding=dilation, dilation=dilation) for a 3x3 `weight`, region by region,
    without any product with the padding (see the module docstring)."""
    height, width = x.shape[-2:]
    rate_h, rate_w = dilation
    rows = []
    for top, bottom, first_row, last_row in axis_bands(height, rate_h):
        row = []
        for left, right, first_col, last_col in axis_bands(width, rate_w):
            region = x[:, :, top + first_row * rate_h:bottom + last_row * rate_h,
                       left + first_col * rate_w:right + last_col * rate_w]
            kernel = weight[:, :, first_row + 1:last_row + 2, first_col + 1:last_col + 2]
            row.append(F.conv2d(region, kernel, bias, dilation=dilation))
        rows.append(row[0] if len(row) == 1 else torch.cat(row, dim=3))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=2)


class AtrousConv2d(nn.Conv2d):
    """nn.Conv2d(in, out, 3, padding=dilation, dilation=dilation, bias=...) that leaves out taps reading
    only padding where that was measured to pay (module docstring)."""

    def __init__(self, in_channels: int, out_channels: int, *, dilation: int, bias: bool = False) -> None:
        super().__init__(in_channels, out_channels, 3, padding=dilation, dilation=dilation, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        if torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling() or x.dim() != 4:
            return super().forward(x)
        if (x.device.type == "cpu" and not torch.is_grad_enabled() and _bfloat16_on_cpu(x, self.weight)
                and amx_kernels() and skipped_share(x.shape[-2], x.shape[-1], self.dilation) >= MIN_SKIPPED_SHARE):
            return atrous_conv2d(x, self.weight, self.bias, self.dilation)
        reduced = reduced_conv2d(x, self.weight, self.bias, self.dilation)
        return super().forward(x) if reduced is None else reduced


def _bfloat16_on_cpu(x: Tensor, weight: Tensor) -> bool:
    """Whether this convolution computes in bfloat16 on the CPU: bf16 tensors or CPU autocast to bf16."""
    if torch.bfloat16 in (x.dtype, weight.dtype):
        return True
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


@functools.lru_cache(maxsize=None)
def amx_kernels() -> bool:
    """Whether oneDNN runs its AMX kernels here: the CPU has AMX tiles and ONEDNN_MAX_CPU_ISA (or its old
    name DNNL_MAX_CPU_ISA) does not cap the kernels below AMX."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    if cap and cap not in ("ALL", "DEFAULT") and "AMX" not in cap:
        return False
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False
