"""model/atrous.py: ASPP's 3x3 dilated convolution without the taps that read only padding computes the padded
convolution's function (float64 values and gradients), takes each path where it should, and its traced graph
stays right at other sizes."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn import functional as F

from syncseg.model import atrous
from syncseg.model.atrous import AtrousConv2d, atrous_conv2d, axis_bands, reduced_conv2d, skipped_share

SIZES = [1, 2, 5, 6, 7, 12, 13, 24, 25, 32, 47]
RATES = [1, 6, 12, 36]


def _reference_and_inputs(height, width, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, height, width, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(4, 3, 3, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, generator=generator, requires_grad=True)
    return x, weight, bias


def _values_and_gradients(function, x, weight, bias, grad_seed=1):
    output = function(x, weight, bias)
    grad = torch.randn(output.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(grad_seed))
    return (output, *torch.autograd.grad(output, (x, weight, bias), grad))


@pytest.mark.parametrize("height", SIZES)
def test_regions_and_reduced_kernels_equal_the_padded_convolution_in_float64(height):
    for width, rate_h, rate_w in itertools.product(SIZES, RATES, RATES):
        x, weight, bias = _reference_and_inputs(height, width)
        dilation = (rate_h, rate_w)
        expected = _values_and_gradients(lambda a, w, b: F.conv2d(a, w, b, padding=dilation, dilation=dilation),
                                          x, weight, bias)
        candidates = {"regions": lambda a, w, b: atrous_conv2d(a, w, b, dilation)}
        if height <= rate_h or width <= rate_w:
            candidates["reduced"] = lambda a, w, b: reduced_conv2d(a, w, b, dilation)
        else:
            assert reduced_conv2d(x, weight, bias, dilation) is None
        for name, function in candidates.items():
            actual = _values_and_gradients(function, x, weight, bias)
            for what, got, want in zip(("output", "input grad", "weight grad", "bias grad"), actual, expected):
                assert got.shape == want.shape
                assert torch.allclose(got, want, rtol=0, atol=1e-11), (name, what, height, width, dilation)


def test_bands_tile_the_axis_and_name_the_taps_that_read_pixels():
    for length, rate in itertools.product(range(1, 40), range(1, 40)):
        bands = axis_bands(length, rate)
        assert bands[0][0] == 0 and bands[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(bands, bands[1:]))
        for start, stop, first, last in bands:
            for position in range(start, stop):
                inside = [tap for tap in (-1, 0, 1) if 0 <= position + tap * rate < length]
                assert inside == list(range(first, last + 1)), (length, rate, position)
    # the share of multiply-adds on padding: none at rate 1 on a big map, 8/9 where only the centre tap reads
    assert skipped_share(1000, 1000, (1, 1)) == pytest.approx(1 - (2998 / 3000) ** 2)
    assert skipped_share(32, 32, (36, 36)) == pytest.approx(8 / 9)


def _count_paths(monkeypatch):
    calls = {"regions": 0, "reduced": 0}

    def spy(name, function):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(atrous, "atrous_conv2d", spy("regions", atrous.atrous_conv2d))
    monkeypatch.setattr(atrous, "reduced_conv2d", spy("reduced", atrous.reduced_conv2d))
    return calls


def test_the_module_takes_regions_only_for_bfloat16_inference_on_an_amx_cpu(monkeypatch):
    calls = _count_paths(monkeypatch)
    monkeypatch.setattr(atrous, "amx_kernels", lambda: True)
    torch.manual_seed(0)
    conv = AtrousConv2d(8, 4, dilation=12)
    x = torch.randn(1, 8, 20, 30)
    expected = F.conv2d(x.double(), conv.weight.double(), None, padding=12, dilation=12)
    with torch.no_grad():
        assert torch.allclose(conv(x).double(), expected, atol=1e-5)  # float32 inference: the plain convolution
    assert calls == {"regions": 0, "reduced": 1}  # asked, and no axis is short enough: None
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = conv(x)
    assert calls["regions"] == 1 and bf16.dtype == torch.bfloat16
    assert (bf16.double() - expected).abs().max() < 0.05 * expected.abs().max()  # bf16's rounding
    with torch.autocast("cpu", dtype=torch.bfloat16):
        conv(x.requires_grad_())  # training: no regions (their backward costs more than they save)
    assert calls["regions"] == 1
    small = torch.randn(2, 8, 10, 30, requires_grad=True)  # height 10 <= rate 12: the outer rows go
    output = conv(small)
    assert calls["reduced"] == 3
    torch.testing.assert_close(output, F.conv2d(small, conv.weight, None, padding=12, dilation=12), atol=1e-5, rtol=0)


def test_a_traced_module_is_right_at_sizes_other_than_the_traced_one():
    """Tracing records one path; traced at a size where the outer taps are dropped, the graph must still
    compute the padded convolution at a size where they are not."""
    torch.manual_seed(0)
    conv = AtrousConv2d(3, 4, dilation=6).eval()
    traced = torch.jit.trace(conv, torch.randn(1, 3, 5, 5), check_trace=False)
    x = torch.randn(1, 3, 20, 17)
    torch.testing.assert_close(traced(x), F.conv2d(x, conv.weight, None, padding=6, dilation=6))


def test_the_state_dict_is_a_conv2d_state_dict():
    conv = AtrousConv2d(3, 4, dilation=6)
    plain = torch.nn.Conv2d(3, 4, 3, padding=6, dilation=6, bias=False)
    assert list(conv.state_dict()) == list(plain.state_dict()) == ["weight"]
    plain.load_state_dict(conv.state_dict())
    x = torch.randn(1, 3, 16, 16)
    torch.testing.assert_close(conv(x), plain(x), atol=1e-5, rtol=0)


def test_no_regions_where_onednn_runs_no_amx_kernels(monkeypatch):
    probe = atrous.amx_kernels  # the real one (cached), before the stand-in below
    calls = _count_paths(monkeypatch)
    monkeypatch.setattr(atrous, "amx_kernels", lambda: False)
    conv = AtrousConv2d(8, 4, dilation=12)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        conv(torch.randn(1, 8, 20, 30))
    assert calls == {"regions": 0, "reduced": 1}
    for cap, expected in (("AVX512_CORE_BF16", False), ("AVX2", False)):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        probe.cache_clear()
        try:
            assert probe() is expected
        finally:
            probe.cache_clear()
