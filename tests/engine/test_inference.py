"""syncseg.engine.inference.predict: whole / sliding window / multi-scale / flip."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from syncseg.engine.config import DataConfig, EvalConfig
from syncseg.engine.inference import eval_settings, predict, predict_batch, window_starts


def run(model, images, *, num_classes, **options):
    """predict() with the eval section's defaults (syncseg.engine.config.EvalConfig) and `options` on top."""
    return predict(model, images, num_classes=num_classes, **eval_settings(EvalConfig(**options)))


class ConvNet(nn.Module):
    """A tiny segmentation stand-in: 3x3 conv -> ReLU -> 1x1 conv, logits at half resolution, then
    upsampled; returns {"out": ...} like the real models."""

    def __init__(self, num_classes: int = 4, *, symmetric: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.features = nn.Conv2d(3, 8, 3, padding=1, stride=2)
        self.classifier = nn.Conv2d(8, num_classes, 1)
        if symmetric:  # kernels equal to their mirror image -> the model commutes with hflip
            with torch.no_grad():
                self.features.weight.copy_((self.features.weight + self.features.weight.flip(-1)) / 2)

    def forward(self, x):
        logits = self.classifier(torch.relu(self.features(x)))
        return {"out": F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)}


class PixelNet(nn.Module):
    """Per-pixel model (1x1 convs): its logits at a pixel do not depend on the window around it."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Sequential(nn.Conv2d(3, 6, 1), nn.ReLU(), nn.Conv2d(6, num_classes, 1))

    def forward(self, x):
        return {"out": self.body(x)}


def _images(n=2, h=21, w=30, seed=0):
    return torch.randn(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def test_whole_is_the_model_output():
    model = ConvNet().eval()
    images = _images()
    assert torch.equal(run(model, images, num_classes=4), model(images)["out"])


def test_slide_with_window_larger_than_image_equals_whole():
    model = ConvNet().eval()
    images = _images()
    whole = run(model, images, num_classes=4, mode="whole")
    assert torch.equal(run(model, images, num_classes=4, mode="slide", window_size=64, stride=40), whole)
    assert torch.equal(run(model, images, num_classes=4, mode="slide", window_size=30, stride=7), whole)


@pytest.mark.parametrize("window,stride", [(16, 11), ((9, 20), (5, 13)), ((40, 12), (40, 7))])
def test_slide_of_a_per_pixel_model_equals_whole(window, stride):
    model = PixelNet().eval()
    images = _images(h=37, w=50)
    whole = run(model, images, num_classes=3)
    slide = run(model, images, num_classes=3, mode="slide", window_size=window, stride=stride)
    torch.testing.assert_close(slide, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("crop,stride", [((16, 16), (10, 10)), ((12, 20), (5, 9)), ((30, 8), (30, 6))])
def test_slide_averages_overlapping_windows_like_a_float64_reference(crop, stride):
    """Windows of crop = (height, width) every stride = (down, across) pixels, as in mmseg's slide_inference."""
    model = ConvNet().eval()
    images = _images(n=1, h=26, w=35)
    (crop_h, crop_w), (stride_h, stride_w) = crop, stride
    got = run(model, images, num_classes=4, mode="slide", window_size=crop, stride=stride)
    model64 = ConvNet().double().eval()
    total = torch.zeros(1, 4, 26, 35, dtype=torch.float64)
    count = torch.zeros(26, 35, dtype=torch.float64)
    crop_h, crop_w = min(crop_h, 26), min(crop_w, 35)
    rows = max(26 - crop_h + stride_h - 1, 0) // stride_h + 1
    columns = max(35 - crop_w + stride_w - 1, 0) // stride_w + 1
    for row in range(rows):
        for column in range(columns):
            top, left = min(row * stride_h, 26 - crop_h), min(column * stride_w, 35 - crop_w)
            window = images.double()[:, :, top:top + crop_h, left:left + crop_w]
            total[:, :, top:top + crop_h, left:left + crop_w] += model64(window)["out"]
            count[top:top + crop_h, left:left + crop_w] += 1
    assert (count > 0).all()
    torch.testing.assert_close(got.double(), total / count, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length,crop,stride", [(10, 4, 3), (100, 33, 21), (513, 513, 341), (20, 7, 7), (8, 3, 1)])
def test_window_starts_cover_every_pixel_inside_the_image(length, crop, stride):
    starts = window_starts(length, crop, stride)
    covered = set()
    for start in starts:
        assert 0 <= start and start + min(crop, length) <= length
        covered.update(range(start, start + min(crop, length)))
    assert covered == set(range(length))
    assert all(b - a <= stride for a, b in zip(starts, starts[1:]))


def test_flip_on_flip_equivariant_model_equals_no_flip():
    model = ConvNet(symmetric=True).eval()
    images = _images(w=33)  # odd width: the stride-2 sampling grid is symmetric too
    plain = run(model, images, num_classes=4)
    torch.testing.assert_close(model(images.flip(-1))["out"].flip(-1), plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(run(model, images, num_classes=4, flip=True), plain, rtol=1e-5, atol=1e-6)
    asymmetric = ConvNet().eval()
    assert not torch.allclose(run(asymmetric, images, num_classes=4, flip=True),
                              run(asymmetric, images, num_classes=4), atol=1e-4)


def test_scale_one_is_plain_inference_and_scales_average_resized_logits():
    model = ConvNet().eval()
    images = _images(h=24, w=28)
    plain = run(model, images, num_classes=4)
    assert torch.equal(run(model, images, num_classes=4, scales=(1.0,)), plain)
    expected = plain.clone()
    for scale in (0.5, 1.5):
        size = (round(24 * scale), round(28 * scale))
        resized = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
        expected += F.interpolate(model(resized)["out"], size=(24, 28), mode="bilinear", align_corners=False)
    torch.testing.assert_close(run(model, images, num_classes=4, scales=(0.5, 1.0, 1.5)), expected / 3)


def test_errors():
    model = ConvNet().eval()
    images = _images()
    with pytest.raises(ValueError, match="num_classes=5"):
        run(model, images, num_classes=5)
    with pytest.raises(ValueError, match="normalize_batch"):
        run(model, images.to(torch.uint8), num_classes=4)


class _Counting(nn.Module):
    """Counts forward passes and the images in each."""

    def __init__(self, model):
        super().__init__()
        self.model, self.batches = model, []

    def forward(self, x):
        self.batches.append(x.shape[0])
        return self.model(x)


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("window_batch", [2, 5, 64])
def test_batched_windows_equal_one_window_at_a_time(flip, window_batch):
    model = _Counting(ConvNet().eval())
    images = _images(n=2, h=40, w=53)
    options = dict(num_classes=4, mode="slide", window_size=(16, 20), stride=(11, 13), flip=flip, scales=(1.0, 0.8))
    one_by_one = run(model, images, window_batch=1, **options)
    unbatched_passes = len(model.batches)
    model.batches.clear()
    batched = run(model, images, window_batch=window_batch, **options)
    torch.testing.assert_close(batched, one_by_one, rtol=1e-5, atol=1e-5)
    assert max(model.batches) <= max(window_batch, 2) and sum(model.batches) == 2 * unbatched_passes
    if window_batch >= 2 * len(images):  # room for two windows of the 2 images: fewer, larger passes
        assert len(model.batches) < unbatched_passes


def test_predict_batch_normalizes_autocasts_and_resizes_as_the_config_says():
    """The one entry point: uint8 in, data.mean/std normalization, eval settings, logits at output_size."""
    torch.manual_seed(0)
    model = ConvNet().eval()
    images = torch.randint(0, 256, (2, 3, 24, 30), dtype=torch.uint8)
    data_cfg, eval_cfg = DataConfig(mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3)), EvalConfig(flip=True, amp="off")
    mean, std = torch.tensor(data_cfg.mean).view(1, 3, 1, 1), torch.tensor(data_cfg.std).view(1, 3, 1, 1)
    expected = run(model, (images / 255.0 - mean) / std, num_classes=4, flip=True)
    got = predict_batch(model, images, num_classes=4, data_cfg=data_cfg, eval_cfg=eval_cfg)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    resized = predict_batch(model, images, num_classes=4, data_cfg=data_cfg, eval_cfg=eval_cfg, output_size=(12, 15))
    assert resized.shape == (2, 4, 12, 15)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        bf16 = predict_batch(model, images, num_classes=4, data_cfg=data_cfg, eval_cfg=EvalConfig(flip=True, amp="bf16"))
    assert not torch.equal(bf16, got)  # eval.amp reaches the autocast
    torch.testing.assert_close(bf16, got, rtol=0.1, atol=0.1)
