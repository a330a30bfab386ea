"""Procedural shapes: the embedded default dataset (no files, deterministic, any image size).

Each image is a textured background with 1-4 (possibly overlapping) shapes of random class, scale,
position and rotation. The background and every shape draw their color AND texture (flat, linear gradient or
low-frequency blotches) from one shared distribution, so a pixel's color says nothing about its class;
only shape does. A shape's base color is kept at least `_MIN_COLOR_DISTANCE` (RGB) away from the
colors already on the canvas so its outline stays visible, and per-pixel Gaussian noise covers the
whole image. Shapes may overlap but their centers keep apart, so no shape is mostly hidden.
Sample `index` of split `split` is a pure function of (seed, split, index); different
splits use different random streams.
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Callable

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from syncseg.data.label_tables import SHAPE_NAMES, SYNTHETIC_CLASSES, SYNTHETIC_DEFAULT_NUM_CLASSES
from syncseg.data.palettes import bit_palette
from syncseg.data.transforms import IGNORE_INDEX, to_tensors

DEFAULT_NUM_CLASSES = SYNTHETIC_DEFAULT_NUM_CLASSES
MAX_CLASSES = len(SYNTHETIC_CLASSES)
MIN_IMAGE_SIZE = 16  # smaller images leave shapes of a pixel or two

_MIN_SHAPES, _MAX_SHAPES = 1, 4
_RADIUS_RANGE = (0.14, 0.30)  # shape radius as a fraction of the image side
_MIN_CENTER_DISTANCE = 0.75  # x (r1 + r2): shapes may overlap, but never hide most of another
_PLACEMENT_TRIES = 10
_MIN_COLOR_DISTANCE = 90.0
_TEXTURE_AMPLITUDE = 30.0
_NOISE_SIGMA_RANGE = (3.0, 9.0)
_SUBPIXEL_SHIFT = 4  # cv2 fixed-point drawing: coordinates in 1/16 pixel

Transform = Callable[[np.ndarray, np.ndarray], tuple[torch.Tensor, torch.Tensor]]


def _unit_polygon(name: str, rng: np.random.Generator) -> np.ndarray:
    """Vertices (K x 2) of shape `name` with radius about 1, centered at the origin, unrotated."""
    if name == "rectangle":
        aspect = rng.uniform(0.45, 1.0)
        return np.array([[-1, -aspect], [1, -aspect], [1, aspect], [-1, aspect]], dtype=np.float64) * 0.85
    if name == "triangle":
        angles = np.array([0.0, 2.0, 4.0]) * math.pi / 3 + rng.uniform(-0.25, 0.25, 3) - math.pi / 2
        return np.stack([np.cos(angles), np.sin(angles)], axis=1) * 1.1
    if name == "cross":
        w = rng.uniform(0.25, 0.36)
        return np.array(
            [[-w, -1], [w, -1], [w, -w], [1, -w], [1, w], [w, w], [w, 1], [-w, 1], [-w, w], [-1, w], [-1, -w], [-w, -w]],
            dtype=np.float64,
        )
    if name == "star":
        angles = np.arange(10) * math.pi / 5 - math.pi / 2
        radii = np.where(np.arange(10) % 2 == 0, 1.1, rng.uniform(0.4, 0.5))
        return np.stack([np.cos(angles) * radii, np.sin(angles) * radii], axis=1)
    if name == "hexagon":
        angles = np.arange(6) * math.pi / 3
        return np.stack([np.cos(angles), np.sin(angles)], axis=1)
    raise AssertionError(f"no polygon for shape {name}")


def _draw_shape(layer: np.ndarray, name: str, center: np.ndarray, radius: float, angle: float,
                rng: np.random.Generator) -> None:
    """Fill the pixels of one shape with 1 in the uint8 `layer`."""
    scale = 1 << _SUBPIXEL_SHIFT
    if name in ("disc", "ring"):
        cx, cy = (int(round(v * scale)) for v in center)
        cv2.circle(layer, (cx, cy), int(round(radius * scale)), 1, -1, cv2.LINE_8, _SUBPIXEL_SHIFT)
        if name == "ring":
            inner = radius * rng.uniform(0.45, 0.62)
            cv2.circle(layer, (cx, cy), int(round(inner * scale)), 0, -1, cv2.LINE_8, _SUBPIXEL_SHIFT)
        return
    points = _unit_polygon(name, rng)
    cos, sin = math.cos(angle), math.sin(angle)
    rotated = points @ np.array([[cos, sin], [-sin, cos]]) * radius + center
    cv2.fillPoly(layer, [np.round(rotated * scale).astype(np.int32)], 1, cv2.LINE_8, _SUBPIXEL_SHIFT)


def _texture(rng: np.random.Generator, color: np.ndarray, size: int, ramp: np.ndarray,
             box: tuple[int, int, int, int]) -> np.ndarray:
    """`color` plus one of flat / gradient / blotchy variation (fields span the whole image), cut to
    box = (top, bottom, left, right): a (bottom - top) x (right - left) x 3 float32 array."""
    top, bottom, left, right = box
    kind = rng.integers(3)
    if kind == 0:
        return np.broadcast_to(color.astype(np.float32), (bottom - top, right - left, 3))
    amplitude = rng.uniform(-_TEXTURE_AMPLITUDE, _TEXTURE_AMPLITUDE, 3).astype(np.float32)
    if kind == 1:
        angle = rng.uniform(0, 2 * math.pi)
        field = math.cos(angle) * ramp[None, left:right] + math.sin(angle) * ramp[top:bottom, None]
        return color.astype(np.float32) + field[:, :, None] * amplitude
    coarse = rng.uniform(-1.0, 1.0, (4, 4, 3)).astype(np.float32)
    field = cv2.resize(coarse, (size, size), interpolation=cv2.INTER_CUBIC)[top:bottom, left:right]
    return color.astype(np.float32) + field * (np.abs(amplitude) + 10.0)


def _pick_color(rng: np.random.Generator, used: list[np.ndarray]) -> np.ndarray:
    color = rng.uniform(0, 255, 3)
    for _ in range(20):
        if all(np.linalg.norm(color - other) >= _MIN_COLOR_DISTANCE for other in used):
            break
        color = rng.uniform(0, 255, 3)
    return color


def render_shapes(
    rng: np.random.Generator, image_size: int, *, num_classes: int = DEFAULT_NUM_CLASSES
) -> tuple[np.ndarray, np.ndarray]:
    """One synthetic sample: (image HxWx3 uint8 RGB, mask HxW uint8 in [0, num_classes)), H = W = image_size.

    2 <= num_classes <= MAX_CLASSES and image_size >= MIN_IMAGE_SIZE (data.* limits the config checks).
    """
    size = image_size
    ramp = np.linspace(-1.0, 1.0, size, dtype=np.float32)
    background = _pick_color(rng, [])
    canvas = np.array(_texture(rng, background, size, ramp, (0, size, 0, size)), dtype=np.float32)
    mask = np.zeros((size, size), dtype=np.uint8)
    used = [background]
    layer = np.empty((size, size), dtype=np.uint8)
    placed: list[tuple[np.ndarray, float]] = []
    for _ in range(rng.integers(_MIN_SHAPES, _MAX_SHAPES + 1)):
        label = int(rng.integers(1, num_classes))
        radius = size * rng.uniform(*_RADIUS_RANGE)
        for _ in range(_PLACEMENT_TRIES):
            center = rng.uniform(0.15 * size, 0.85 * size, 2)
            if all(np.hypot(*(center - c)) >= _MIN_CENTER_DISTANCE * (radius + r) for c, r in placed):
                break
        else:
            continue  # no room left for this shape
        placed.append((center, radius))
        angle = rng.uniform(0, 2 * math.pi)
        layer.fill(0)
        _draw_shape(layer, SHAPE_NAMES[label - 1], center, radius, angle, rng)
        left, top, width, height = cv2.boundingRect(layer)  # only the shape's box is textured and copied
        box = (top, top + max(height, 1), left, left + max(width, 1))
        inside = layer[box[0]:box[1], box[2]:box[3]].view(bool)
        color = _pick_color(rng, used)
        used.append(color)
        texture = _texture(rng, color, size, ramp, box)
        mask[box[0]:box[1], box[2]:box[3]][inside] = label
        np.copyto(canvas[box[0]:box[1], box[2]:box[3]], texture, where=inside[:, :, None])
    sigma = rng.uniform(*_NOISE_SIGMA_RANGE)
    canvas += rng.standard_normal((size, size, 3), dtype=np.float32) * np.float32(sigma)
    image = np.clip(canvas, 0, 255, out=canvas).astype(np.uint8)
    return image, mask


def split_stream(split: str) -> int:
    """A stable random-stream id for a split name (train and val never share a stream)."""
    return zlib.crc32(split.encode("utf-8"))


CACHE_BYTES = 256 * 2**20  # per process: renders kept when the whole split fits (2000 x 96 px = 74 MB)


class SyntheticShapes(Dataset):
    """`length` procedurally generated samples of split `split`, each (uint8 3xHxW, int64 HxW) after `transform`.

    length >= 1, 2 <= num_classes <= MAX_CLASSES, image_size >= MIN_IMAGE_SIZE (the config checks them).

    Samples are rendered on first use. When the whole split fits in `cache_bytes`, each process
    (each persistent DataLoader worker) keeps its renders, read-only, so later epochs only augment.
    """

    def __init__(
        self,
        length: int,
        image_size: int,
        *,
        num_classes: int = DEFAULT_NUM_CLASSES,
        seed: int = 0,
        split: str = "train",
        ignore_index: int = IGNORE_INDEX,
        transform: Transform | None = None,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.ignore_index = ignore_index  # rendered masks hold no ignore pixels; crop padding does
        self.length = length
        self.side = image_size
        self.seed = seed
        self.split = split
        self.transform = transform
        self.classes = SYNTHETIC_CLASSES[:num_classes]
        self.palette = bit_palette(num_classes)
        sample_bytes = 4 * image_size * image_size  # RGB + mask, uint8
        self._renders: dict[int, tuple[np.ndarray, np.ndarray]] | None = (
            {} if length * sample_bytes <= cache_bytes else None)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return self.length

    def name_of(self, index: int) -> str:
        return f"synthetic_{index:05d}"

    def image_size(self, index: int) -> tuple[int, int]:
        return self.side, self.side

    def load(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The untransformed sample: (image HxWx3 uint8 RGB, mask HxW uint8)."""
        if not 0 <= index < self.length:
            raise IndexError(f"synthetic {self.split}: index {index} out of range for {self.length} samples")
        if self._renders is not None and index in self._renders:
            return self._renders[index]
        rng = np.random.default_rng([self.seed, split_stream(self.split), index])
        image, mask = render_shapes(rng, self.side, num_classes=self.num_classes)
        if self._renders is not None:
            image.setflags(write=False)  # shared by every later epoch: a transform must not write into it
            mask.setflags(write=False)
            self._renders[index] = (image, mask)
        return image, mask

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if -self.length <= index < 0:
            index += self.length
        image, mask = self.load(index)
        if self.transform is None:
            return to_tensors(image, mask)
        return self.transform(image, mask)


def build_synthetic(data_cfg: Any, split: str, transform: Transform) -> SyntheticShapes:
    """data.dataset=synthetic: `split` of a validated `data` config section (the training split has
    data.synthetic_train_size samples, any other data.synthetic_val_size), through `transform`."""
    is_train_split = split == data_cfg.train_split
    return SyntheticShapes(
        data_cfg.synthetic_train_size if is_train_split else data_cfg.synthetic_val_size,
        data_cfg.synthetic_image_size,
        num_classes=data_cfg.num_classes or DEFAULT_NUM_CLASSES,
        seed=data_cfg.seed,
        split=split,
        ignore_index=data_cfg.ignore_index,
        transform=transform,
    )
