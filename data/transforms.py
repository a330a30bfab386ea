"""Albumentations pipelines for (image, mask) pairs and the one device-side normalization.

Images stay integers (uint8, or uint16 for 16-bit data: syncseg.data.images) from decoding to the training
device: the host does geometry only, and `normalize_batch` turns a batch into float32 on whatever
device it lives on. Training, evaluation and prediction all call `normalize_batch`, so data.max_value,
mean and std live in one place. The geometry works on any channel count; the photometric steps are
for 8-bit RGB (syncseg.engine.config refuses data.photometric for other images).

Randomness: `PairTransform` draws one seed per sample from torch's global generator and gives every step
of the albumentations pipeline its own stream derived from it (`step_seeds`). Inside DataLoader workers
torch seeds that generator per worker (base seed + worker id), so workers never repeat each other, and a
run seeded with torch.manual_seed (or resumed with its torch RNG state restored) replays the same
augmentations. One seed for all steps (albumentations' Compose.set_random_seed) gives every step the same
stream: the flip then fired exactly when the scale drawn from the same first number was below the range's
middle, so upscaled crops were never flipped.
"""
from __future__ import annotations

import functools
import logging
import random as py_random_module
from typing import Any, Sequence

import albumentations as A
import cv2
import numpy as np
import torch
from albumentations.core.transforms_interface import DualTransform

from syncseg.data.constants import IGNORE_INDEX, MAX_8BIT, height_width

logger = logging.getLogger(__name__)

class RandomScaleCrop(DualTransform):
    """Random rescale by s ~ U(scale_range), pad to `crop_size` (bottom/right), random `crop_size` crop.

    `crop_size` is (height, width), or one integer for a square.
    The result equals RandomScale -> PadIfNeeded(top_left) -> RandomCrop up to sub-pixel rounding,
    but only the source pixels that land in the crop are resized: at scale 2 on a 500x375 image that
    is a quarter of the work. Padding is `fill` in the image and `fill_mask` (ignore) in the mask.
    Image and mask share the exact same geometry (linear vs nearest interpolation).
    """

    class InitSchema(DualTransform.InitSchema):
        crop_size: int | tuple[int, int]
        scale_range: tuple[float, float]
        fill: float
        fill_mask: float

    def __init__(
        self,
        crop_size: int | tuple[int, int],
        scale_range: tuple[float, float] = (0.5, 2.0),
        *,
        fill: float = 0.0,
        fill_mask: float = IGNORE_INDEX,
        p: float = 1.0,
    ) -> None:
        super().__init__(p=p)
        self.crop_size = height_width(crop_size)
        self.scale_range = (float(scale_range[0]), float(scale_range[1]))
        self.fill = fill
        self.fill_mask = fill_mask

    def get_params_dependent_on_data(self, params: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        height, width = params["shape"][:2]
        scale = self.py_random.uniform(*self.scale_range)
        scaled_height, scaled_width = max(1, round(height * scale)), max(1, round(width * scale))
        crop_height, crop_width = self.crop_size
        top = self.py_random.randint(0, max(scaled_height, crop_height) - crop_height)
        left = self.py_random.randint(0, max(scaled_width, crop_width) - crop_width)
        return {"scale": scale, "top": top, "left": left, "scaled_shape": (scaled_height, scaled_width)}

    def _apply(self, array: np.ndarray, scale: float, top: int, left: int, scaled_shape: tuple[int, int],
               interpolation: int, fill: float, flip: bool = False, view: bool = False) -> np.ndarray:
        """The crop of `array`; `flip` mirrors it left-right in the same pass (PairTransform folds a
        HorizontalFlip that follows into this step); `view` may return a view into the resized window
        when the source fills the whole crop (no copy: PairTransform's own path, whose next consumer copies)."""
        height, width = array.shape[:2]
        crop_height, crop_width = self.crop_size
        visible_h = min(crop_height, scaled_shape[0] - top)
        visible_w = min(crop_width, scaled_shape[1] - left)
        # source window (plus one pixel of context) that covers the visible part of the crop
        src_top, src_left = int(top / scale), int(left / scale)
        src_bottom = min(height, int(np.ceil((top + visible_h) / scale)) + 1)
        src_right = min(width, int(np.ceil((left + visible_w) / scale)) + 1)
        window = array[src_top:src_bottom, src_left:src_right]  # cv2 reads the strided view as it is
        resized = cv2.resize(window, (0, 0), fx=scale, fy=scale, interpolation=interpolation)
        if resized.ndim < array.ndim:  # cv2 returns a one-channel image as H x W
            resized = resized[..., None]
        offset_y, offset_x = top - round(src_top * scale), left - round(src_left * scale)
        piece = resized[offset_y:offset_y + visible_h, offset_x:offset_x + visible_w]
        piece_h, piece_w = piece.shape[:2]
        if piece_h == 0 or piece_w == 0:  # rounding at a tiny scale left nothing of the source in view
            return np.full((crop_height, crop_width) + array.shape[2:], fill, dtype=array.dtype)
        fills_crop = (piece_h, piece_w) == (crop_height, crop_width)  # nothing to pad
        if fills_crop and view and not flip:
            return piece
        out = np.empty((crop_height, crop_width) + array.shape[2:], dtype=array.dtype)
        if fills_crop:
            if flip:
                return cv2.flip(piece, 1, dst=out)
            out[:] = piece
            return out
        # every pixel is written once: the piece, the edge sliver rounding may leave, then the padding
        out[:piece_h, :piece_w] = piece
        if (piece_h, piece_w) != (visible_h, visible_w):  # rounding left a sliver: repeat the edge
            out[piece_h:visible_h, :piece_w] = out[piece_h - 1, :piece_w]  # piece_h, piece_w >= 1 here
            out[:visible_h, piece_w:visible_w] = out[:visible_h, piece_w - 1, None]
        out[visible_h:] = fill
        out[:visible_h, visible_w:] = fill
        return cv2.flip(out, 1, dst=out) if flip else out  # in place, while the crop is in cache

    def apply(self, img: np.ndarray, **params: Any) -> np.ndarray:
        return self._apply(img, params["scale"], params["top"], params["left"], params["scaled_shape"],
                           cv2.INTER_LINEAR, self.fill, params.get("flip", False), params.get("view", False))

    def apply_to_mask(self, mask: np.ndarray, **params: Any) -> np.ndarray:
        return self._apply(mask, params["scale"], params["top"], params["left"], params["scaled_shape"],
                           cv2.INTER_NEAREST, self.fill_mask, params.get("flip", False), params.get("view", False))

    def get_transform_init_args_names(self) -> tuple[str, ...]:
        return ("crop_size", "scale_range", "fill", "fill_mask")


def window_starts(length: int, window: int, stride: int) -> list[int]:
    """Start offsets of windows of size min(window, length) covering [0, length) with the given stride;
    the last window is shifted back to end at the border, so no window extends past the image."""
    if window >= length:
        return [0]
    count = (length - window + stride - 1) // stride + 1
    return [min(index * stride, length - window) for index in range(count)]


def build_train_augmentation(
    crop_size: int | tuple[int, int],
    scale_range: tuple[float, float] = (0.5, 2.0),
    *,
    hflip: bool = True,
    photometric: bool = False,
    ignore_index: int = IGNORE_INDEX,
    rot90: bool = False,
) -> A.Compose:
    """Random scale -> pad to `crop_size` (H,W or one int for a square; image 0, mask `ignore_index`)
    -> random crop -> flip -> with `rot90`, a rotation by 0, 90, 180 or 270 degrees (images with no "up":
    overhead, microscope; with the horizontal flip, every one of the square's 8 symmetries). A rotation by
    90 degrees swaps height and width, so `rot90` needs a square crop (the config checks it).

    The first three steps are one RandomScaleCrop (resizes only what lands in the crop). Geometric ops use
    cv2 interpolation (linear for the image, nearest for the mask). Optional
    photometric jitter and blur touch the image only (8-bit RGB). Output arrays keep the input's type and
    channels.
    """
    low, high = float(scale_range[0]), float(scale_range[1])
    steps: list[Any] = [RandomScaleCrop(crop_size, (low, high), fill=0, fill_mask=ignore_index)]
    if hflip:
        steps.append(A.HorizontalFlip(p=0.5))
    if rot90:
        height, width = height_width(crop_size)
        if height != width:
            raise ValueError(f"rot90 needs a square crop, got crop_size {height},{width}")
        steps.append(A.RandomRotate90(p=1.0))
    if photometric:
        steps += [
            A.ColorJitter(brightness=0.25, contrast=0.25, saturation=0.25, hue=0.02, p=0.5),
            A.GaussianBlur(blur_limit=(3, 5), sigma_limit=(0.1, 1.5), p=0.2),
        ]
    return A.Compose(steps)


def build_eval_augmentation(base_size: int = 0) -> A.Compose | None:
    """Eval geometry: None (the full image) or the long side resized to `base_size` when > 0."""
    if base_size == 0:
        return None
    return A.Compose(
        [
            A.LongestMaxSize(
                max_size=base_size, interpolation=cv2.INTER_LINEAR, mask_interpolation=cv2.INTER_NEAREST
            )
        ]
    )


def step_seeds(seed: int, count: int) -> list[int]:
    """`count` seeds for the steps of one sample's pipeline, all different, from the sample's `seed`."""
    return [(seed + index * 0x9E3779B9) % 2**32 for index in range(count)]


# Steps PairTransform runs itself, without Compose's per-call machinery (its checks and dictionaries cost
# as much as the resize): the geometry of the training pipeline. Photometric steps go through Compose.
_DIRECT_STEPS = (RandomScaleCrop, A.HorizontalFlip, A.RandomRotate90)


class PairTransform:
    """Callable (image HxWxC uint8 / uint16, mask HxW uint8/int) -> (tensor CxHxW of the image's type,
    int64 tensor HxW; with `compact_masks`, a uint8 mask stays a uint8 tensor: see to_tensors).

    `augmentation` None means no geometry change (tensor conversion only). With `random`, each call draws one
    seed from torch's global generator and each step gets its own stream from it (`step_seeds`). A pipeline of
    only RandomScaleCrop, HorizontalFlip and RandomRotate90 steps is run step by step here, with the same
    draws and the same result as the Compose (tests/data/test_transforms.py checks it), in less time.
    """

    def __init__(self, augmentation: A.Compose | None, *, random: bool, compact_masks: bool = False) -> None:
        self.augmentation = augmentation
        self.random = random
        self.compact_masks = compact_masks
        self._direct = (type(augmentation) is A.Compose and augmentation.p >= 1.0
                        and all(type(step) in _DIRECT_STEPS for step in augmentation.transforms))

    def __call__(self, image: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        augmentation = self.augmentation
        if augmentation is not None:
            steps = augmentation.transforms
            # one seed per step, and the last for Compose's own draws (its p), so no two share a stream
            seeds = step_seeds(int(torch.randint(0, 2**31 - 1, ()).item()), len(steps) + 1) if self.random else None
            if self._direct:
                image, mask = self._run_direct(steps, seeds, image, mask)
            else:
                if seeds is not None:
                    augmentation.set_random_seed(seeds[-1])  # seeds the steps too; each is reseeded next
                    for step, seed in zip(steps, seeds):
                        step.set_random_seed(seed)
                out = augmentation(image=image, mask=mask)
                image, mask = out["image"], out["mask"]
        return to_tensors(image, mask, compact_mask=self.compact_masks)

    @staticmethod
    def _run_direct(steps: Sequence[Any], seeds: list[int] | None, image: np.ndarray,
                    mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What Compose does with these steps: per step, the probability draw (p < 1), its parameters from its
        own stream, then its own apply / apply_to_mask functions."""
        streams = [step.py_random if seeds is None else py_random_module.Random(seeds[index])
                   for index, step in enumerate(steps)]

        def fires(index: int) -> bool:
            step = steps[index]
            return step.p > 0.0 and (step.p >= 1.0 or streams[index].random() < step.p)

        index = 0
        while index < len(steps):
            step = steps[index]
            if not fires(index):
                index += 1
                continue
            if isinstance(step, RandomScaleCrop):
                step.py_random = streams[index]
                params = step.get_params_dependent_on_data({"shape": image.shape}, {})
                # a flip right after the crop is written by the crop itself (its own draw, from its own stream)
                if index + 1 < len(steps) and type(steps[index + 1]) is A.HorizontalFlip:
                    params["flip"] = fires(index + 1)
                    index += 1
                params["view"] = True  # to_tensors and collation copy it once
            elif isinstance(step, A.RandomRotate90):
                params = {"factor": streams[index].randint(0, 3)}
            else:
                params = {}
            image, mask = step.apply(image, **params), step.apply_to_mask(mask, **params)
            index += 1
        return image, mask

    def __repr__(self) -> str:
        return (f"PairTransform(random={self.random}, compact_masks={self.compact_masks}, "
                f"augmentation={self.augmentation!r})")


def build_train_transform(data_cfg: Any, *, compact_masks: bool = False) -> PairTransform:
    """The training pipeline configured by a DataConfig section (crop_size, scale_range, hflip, rot90, ...);
    `compact_masks`: uint8 masks come out as uint8 tensors (to_tensors)."""
    return PairTransform(
        build_train_augmentation(
            height_width(data_cfg.crop_size),
            tuple(data_cfg.scale_range),
            hflip=bool(data_cfg.hflip),
            photometric=bool(data_cfg.photometric),
            ignore_index=int(data_cfg.ignore_index),
            rot90=bool(data_cfg.rot90),
        ),
        random=True,
        compact_masks=compact_masks,
    )


def build_eval_transform(data_cfg: Any, *, compact_masks: bool = False) -> PairTransform:
    """The evaluation pipeline: full image, or long side resized to data_cfg.base_size when > 0.
    `compact_masks`: uint8 masks come out as uint8 tensors (to_tensors)."""
    return PairTransform(build_eval_augmentation(int(data_cfg.base_size)), random=False, compact_masks=compact_masks)


_IMAGE_TYPES = (np.uint8, np.uint16)
_BATCH_TYPES = (torch.uint8, torch.uint16)


def to_tensors(image: np.ndarray, mask: np.ndarray, *, compact_mask: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """HxWxC uint8 / uint16 -> CxHxW tensor of that type (a strided view; collation makes it contiguous),
    mask -> int64, or with `compact_mask` a uint8 mask -> uint8 (other types still int64).

    The trainer's loader keeps masks compact (syncseg.engine.build): the labels fit in 8 bits (255 is the
    ignore label), and widening them on the training device instead of in the worker saves a 2 MB write
    per 513x513 sample, 8x the batch's shared memory and 8x its transfer. cross_entropy and everything
    a user's own loop does with a dataset expect int64: that stays the default."""
    if image.dtype not in _IMAGE_TYPES:
        raise ValueError(f"expected a uint8 or uint16 image, got {image.dtype}")
    image_tensor = torch.from_numpy(_sharable(image)).permute(2, 0, 1)
    mask = np.asarray(mask)
    if not (compact_mask and mask.dtype == np.uint8):
        return image_tensor, torch.from_numpy(mask.astype(np.int64))
    return image_tensor, torch.from_numpy(_sharable(mask))


def _sharable(array: np.ndarray) -> np.ndarray:
    """`array`, or a copy where torch.from_numpy cannot share it: read-only or negative strides (np.rot90's
    views); other strided views stay views."""
    return array.copy() if not array.flags.writeable or any(stride < 0 for stride in array.strides) else array


def normalize_batch(
    images: torch.Tensor, mean: Sequence[float], std: Sequence[float], *, max_value: float = MAX_8BIT
) -> torch.Tensor:
    """uint8 / uint16 N x C x H x W (any device) -> float32 ((x / max_value - mean) / std): mean/std per
    channel in units of the full scale `max_value` (data.max_value, data.mean, data.std; by default 255
    and IMAGENET_MEAN / IMAGENET_STD; std > 0 is the config's check).

    Raises ValueError for a float tensor (normalizing twice is a silent accuracy bug) or a shape that
    is not N x C x H x W with C == len(mean) == len(std).
    """
    if images.dtype not in _BATCH_TYPES:
        raise ValueError(f"normalize_batch expects a uint8 or uint16 image batch, got dtype {images.dtype}")
    if images.dim() != 4:
        raise ValueError(f"normalize_batch expects N x C x H x W, got shape {tuple(images.shape)}")
    channels = images.shape[1]
    if len(mean) != channels or len(std) != channels:
        raise ValueError(
            f"normalize_batch: mean {tuple(mean)} and std {tuple(std)} must have one value per channel "
            f"({channels})"
        )
    scale, negative_shift = _normalization_constants(tuple(map(float, mean)), tuple(map(float, std)),
                                                     float(max_value), images.device)
    return torch.addcmul(negative_shift, images.to(torch.float32), scale)


@functools.lru_cache(maxsize=32)
def _normalization_constants(mean: tuple[float, ...], std: tuple[float, ...], max_value: float,
                             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 / (max_value std), -mean / std) as float32 1 x C x 1 x 1 on `device`, computed in float64.

    Cached per device and constants: made on the host, they reach a GPU by a blocking copy that drains the
    stream, which every batch would otherwise pay twice (tests/engine/test_host_syncs.py counts them). The
    tensors are read only (addcmul writes a new one)."""
    mean64 = torch.tensor(mean, dtype=torch.float64)
    std64 = torch.tensor(std, dtype=torch.float64)
    scale = (1.0 / (max_value * std64)).to(device=device, dtype=torch.float32).view(1, -1, 1, 1)
    shift = (mean64 / std64).to(device=device, dtype=torch.float32).view(1, -1, 1, 1)
    return scale, -shift
