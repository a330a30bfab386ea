import cv2
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from syncseg.data.transforms import (
    PairTransform,
    build_eval_augmentation,
    build_eval_transform,
    build_train_augmentation,
    build_train_transform,
    normalize_batch,
)
from syncseg.data.constants import MAX_CHANNELS
from syncseg.engine.config import DataConfig
from syncseg.engine.seeding import worker_init

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def test_normalize_batch_matches_float64_reference():
    images = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    out = normalize_batch(images, MEAN, STD)
    mean = torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float64).view(1, 3, 1, 1)
    reference = (images.double() / 255.0 - mean) / std
    assert out.dtype == torch.float32 and out.shape == images.shape
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=2e-6)


def test_normalize_batch_rejects_float_and_wrong_shapes():
    with pytest.raises(ValueError, match="uint8"):
        normalize_batch(torch.zeros(1, 3, 4, 4), MEAN, STD)
    with pytest.raises(ValueError, match="N x C x H x W"):
        normalize_batch(torch.zeros(3, 4, 4, dtype=torch.uint8), MEAN, STD)
    with pytest.raises(ValueError, match="one value per channel"):
        normalize_batch(torch.zeros(1, 1, 4, 4, dtype=torch.uint8), MEAN, STD)


def test_normalize_batch_divides_16_bit_images_by_max_value():
    images = torch.randint(0, 4096, (2, 4, 5, 7), dtype=torch.int32)
    images[0, 0, 0, 0] = 4095
    mean, std = (0.5, 0.4, 0.3, 0.2), (0.25, 0.2, 0.15, 0.1)
    out = normalize_batch(images.to(torch.uint16), mean, std, max_value=4095)
    reference = (images.double() / 4095 - torch.tensor(mean, dtype=torch.float64).view(1, 4, 1, 1)) / torch.tensor(
        std, dtype=torch.float64).view(1, 4, 1, 1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=4e-6)
    assert out[0, 0, 0, 0].item() == pytest.approx((1 - 0.5) / 0.25, abs=1e-6)  # 4095 is full scale


def _run(transform, image, mask):
    out_image, out_mask = transform(image, mask)
    return out_image.numpy(), out_mask.numpy()


@pytest.mark.parametrize("scale_range", [(1.0, 1.0), (0.5, 2.0)])
def test_padding_is_ignore_in_mask_and_zero_in_image(scale_range):
    # A small all-background image (mask 0 everywhere, image never 0) must be padded: every padded
    # mask pixel must be 255, never 0, and the same pixels are 0 in the image.
    image = np.full((20, 30, 3), 200, dtype=np.uint8)
    mask = np.zeros((20, 30), dtype=np.uint8)
    transform = PairTransform(build_train_augmentation(64, scale_range, hflip=True), random=True)
    torch.manual_seed(0)
    for _ in range(10):
        out_image, out_mask = _run(transform, image, mask)
        assert out_image.shape == (3, 64, 64) and out_mask.shape == (64, 64)
        padded = out_mask == 255
        assert padded.any()
        assert set(np.unique(out_mask).tolist()) <= {0, 255}
        assert (out_image[:, padded] == 0).all()
        assert (out_image[:, ~padded] == 200).all()
    if scale_range == (1.0, 1.0):
        assert (out_mask == 0).sum() == 20 * 30


def test_train_pipeline_types_and_label_preservation():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (70, 90, 3), dtype=np.uint8)
    mask = rng.integers(0, 6, (70, 90), dtype=np.uint8)
    mask[0] = 255
    cfg = DataConfig(crop_size=48, scale_range=(0.75, 1.5), photometric=True)
    transform = build_train_transform(cfg)
    torch.manual_seed(1)
    for _ in range(5):
        out_image, out_mask = transform(image, mask)
        assert out_image.dtype == torch.uint8 and out_image.shape == (3, 48, 48)
        assert out_mask.dtype == torch.int64 and out_mask.shape == (48, 48)
        # nearest-neighbour mask interpolation: no invented labels
        assert set(out_mask.unique().tolist()) <= set(range(6)) | {255}


def test_train_pipeline_is_reproducible_from_torch_seed():
    image = np.random.default_rng(0).integers(0, 256, (50, 60, 3), dtype=np.uint8)
    mask = np.zeros((50, 60), dtype=np.uint8)
    transform = build_train_transform(DataConfig(crop_size=32))
    torch.manual_seed(7)
    first = [transform(image, mask)[0] for _ in range(4)]
    torch.manual_seed(7)
    second = [transform(image, mask)[0] for _ in range(4)]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not all(torch.equal(first[0], other) for other in first[1:])


def test_hflip_flips_image_and_mask_together():
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    image[:, :4] = 255
    mask = np.zeros((8, 8), dtype=np.uint8)
    mask[:, :4] = 1
    transform = PairTransform(build_train_augmentation(8, (1.0, 1.0), hflip=True), random=True)
    torch.manual_seed(0)
    seen_flipped = False
    for _ in range(20):
        out_image, out_mask = _run(transform, image, mask)
        assert ((out_image[0] == 255) == (out_mask == 1)).all()
        seen_flipped |= bool(out_mask[0, -1] == 1)
    assert seen_flipped


def test_rot90_with_hflip_gives_every_symmetry_of_the_square_to_image_and_mask_alike():
    """data.rot90 (issue 32 item 2): each of the 8 rotations and reflections of a crop, the mask moved with the
    image, every band alike; a non-square crop is refused (the config names the keys first)."""
    image = np.arange(5 * 5 * 6, dtype=np.uint16).reshape(5, 5, 6)
    mask = np.arange(25, dtype=np.uint8).reshape(5, 5)
    symmetries = {np.rot90(flipped, turns).tobytes() for flipped in (mask, mask[:, ::-1]) for turns in range(4)}
    transform = PairTransform(build_train_augmentation(5, (1.0, 1.0), hflip=True, rot90=True), random=True)
    torch.manual_seed(0)
    seen = set()
    for _ in range(80):
        out_image, out_mask = _run(transform, image, mask)
        moved = out_mask.astype(np.uint8)
        assert moved.tobytes() in symmetries
        expected = image.reshape(25, 6)[moved.reshape(-1)]  # each pixel's bands travel with its mask value
        assert np.array_equal(out_image.transpose(1, 2, 0).reshape(25, 6), expected)
        seen.add(moved.tobytes())
    assert seen == symmetries
    with pytest.raises(ValueError, match="rot90 needs a square crop"):
        build_train_augmentation((4, 6), (1.0, 1.0), rot90=True)


def test_eval_pipeline_full_image_and_base_size():
    image = np.random.default_rng(0).integers(0, 256, (30, 50, 3), dtype=np.uint8)
    mask = np.random.default_rng(1).integers(0, 4, (30, 50), dtype=np.uint8)
    out_image, out_mask = build_eval_transform(DataConfig(base_size=0))(image, mask)
    assert np.array_equal(out_image.permute(1, 2, 0).numpy(), image)
    assert np.array_equal(out_mask.numpy(), mask)
    out_image, out_mask = build_eval_transform(DataConfig(base_size=25))(image, mask)
    assert out_image.shape == (3, 15, 25) and out_mask.shape == (15, 25)
    assert set(out_mask.unique().tolist()) <= set(range(4))
    assert build_eval_augmentation(0) is None


class _SameImage(Dataset):
    def __init__(self):
        self.transform = build_train_transform(DataConfig(crop_size=24, scale_range=(0.5, 2.0)))
        self.image = np.random.default_rng(3).integers(0, 256, (40, 40, 3), dtype=np.uint8)
        self.mask = np.zeros((40, 40), dtype=np.uint8)

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return self.transform(self.image, self.mask)


def test_two_workers_produce_different_augmentations():
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(_SameImage(), batch_size=1, num_workers=2, worker_init_fn=worker_init,
                        generator=generator)
    batches = [images[0] for images, _ in loader]
    # with 2 workers, consecutive batches alternate workers: worker 0 -> 0, 2, 4; worker 1 -> 1, 3, 5
    worker0, worker1 = batches[0::2], batches[1::2]
    assert all(not torch.equal(a, b) for a, b in zip(worker0, worker1))
    # and the whole epoch is reproducible from the loader's generator
    again = [images[0] for images, _ in DataLoader(_SameImage(), batch_size=1, num_workers=2,
                                                   worker_init_fn=worker_init,
                                                   generator=torch.Generator().manual_seed(0))]
    assert all(torch.equal(a, b) for a, b in zip(batches, again))


@pytest.mark.parametrize("crop", [256, (200, 320), (320, 120)])
@pytest.mark.parametrize("scale, top, left", [(1.0, 0, 0), (1.7, 100, 37), (0.6, 0, 0), (1.31, 3, 50), (2.0, 300, 600)])
def test_random_scale_crop_matches_resize_pad_crop_reference(scale, top, left, crop):
    # Reference: resize the whole image, pad bottom/right (0 / 255), crop at (top, left).
    from syncseg.data.transforms import RandomScaleCrop

    image, mask = (np.random.default_rng(5).integers(0, 256, (375, 500, 3), dtype=np.uint8),
                   np.random.default_rng(6).integers(0, 21, (375, 500), dtype=np.uint8))
    image = cv2.GaussianBlur(image, (0, 0), 4)  # smooth, so a sub-pixel shift changes little
    mask = cv2.resize(mask[::25, ::25], (500, 375), interpolation=cv2.INTER_NEAREST)  # blocky labels
    crop_h, crop_w = (crop, crop) if isinstance(crop, int) else crop
    transform = RandomScaleCrop(crop, (0.5, 2.0))
    scaled_shape = (round(375 * scale), round(500 * scale))
    top, left = min(top, max(0, scaled_shape[0] - crop_h)), min(left, max(0, scaled_shape[1] - crop_w))
    params = {"scale": scale, "top": top, "left": left, "scaled_shape": scaled_shape}
    out_image, out_mask = transform.apply(image, **params), transform.apply_to_mask(mask, **params)

    def reference(array, interpolation, fill):
        resized = cv2.resize(array, (scaled_shape[1], scaled_shape[0]), interpolation=interpolation)
        pad = ((0, max(0, crop_h - resized.shape[0])), (0, max(0, crop_w - resized.shape[1])))
        padded = np.pad(resized, pad + ((0, 0),) * (array.ndim - 2), constant_values=fill)
        return padded[top:top + crop_h, left:left + crop_w]

    ref_image, ref_mask = reference(image, cv2.INTER_LINEAR, 0), reference(mask, cv2.INTER_NEAREST, 255)
    assert out_image.shape == ref_image.shape == (crop_h, crop_w, 3) and out_mask.shape == (crop_h, crop_w)
    assert np.array_equal(out_mask == 255, ref_mask == 255)  # the padded region is exactly the same
    assert (out_mask == ref_mask).mean() > 0.97
    assert np.abs(out_image.astype(int) - ref_image.astype(int)).mean() < 2.0


@pytest.mark.parametrize("crop", [(24, 64), (64, 24)])
def test_rectangular_crops_pad_with_the_ignore_label_and_draw_offsets_per_axis(crop):
    from syncseg.data.transforms import RandomScaleCrop

    image = np.full((20, 30, 3), 200, dtype=np.uint8)
    mask = np.zeros((20, 30), dtype=np.uint8)
    transform = PairTransform(build_train_augmentation(crop, (1.0, 1.0), hflip=False, ignore_index=254), random=True)
    torch.manual_seed(0)
    out_image, out_mask = _run(transform, image, mask)
    assert out_image.shape == (3, *crop) and out_mask.shape == crop
    assert (out_mask == 0).sum() == min(20, crop[0]) * min(30, crop[1])  # the visible part of the image
    assert set(np.unique(out_mask).tolist()) == {0, 254} and (out_image[:, out_mask == 254] == 0).all()
    # offsets: within [0, scaled - crop] on each axis separately (here a 100 x 50 image)
    picker = RandomScaleCrop(crop, (1.0, 1.0))
    offsets = set()
    for seed in range(200):
        picker.set_random_seed(seed)
        params = picker.get_params_dependent_on_data({"shape": (100, 50, 3)}, {})
        offsets.add((params["top"], params["left"]))
    tops, lefts = {t for t, _ in offsets}, {left for _, left in offsets}
    top_range, left_range = set(range(100 - crop[0] + 1)), set(range(max(50, crop[1]) - crop[1] + 1))
    assert tops <= top_range and lefts <= left_range
    assert len(tops) > len(top_range) // 2 and len(lefts) > len(left_range) // 2  # drawn on each axis


def test_square_crop_given_as_one_integer_or_as_a_pair_is_the_same_augmentation():
    image = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    mask = np.random.default_rng(1).integers(0, 5, (50, 70), dtype=np.uint8)
    outputs = []
    for crop in (40, (40, 40)):
        transform = build_train_transform(DataConfig(crop_size=crop, scale_range=(0.5, 2.0)))
        torch.manual_seed(3)
        outputs.append([_run(transform, image, mask) for _ in range(5)])
    for (image_a, mask_a), (image_b, mask_b) in zip(*outputs):
        assert np.array_equal(image_a, image_b) and np.array_equal(mask_a, mask_b)


@pytest.mark.parametrize("channels", [1, 4, 5, 13, MAX_CHANNELS])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_geometry_moves_every_channel_as_it_moves_an_rgb_image(channels, dtype):
    """Random rescale, crop, flip (training) and the long-side resize (evaluation) on 1 to MAX_CHANNELS
    channels (cv2's resize drops a single channel's axis and refuses more than 128): channel k of the
    result is what the same seed does to an RGB image holding channel k (to the rounding of the last bit)."""
    rng = np.random.default_rng(channels)
    image = rng.integers(0, np.iinfo(dtype).max, (21, 27, channels), endpoint=True).astype(dtype)
    mask = rng.integers(0, 3, (21, 27), dtype=np.uint8)
    train = build_train_transform(DataConfig(crop_size=(16, 24), scale_range=(0.6, 1.8)))
    evaluation = build_eval_transform(DataConfig(base_size=17))
    for transform in (train, evaluation):
        for seed in range(3):
            torch.manual_seed(seed)
            out_image, out_mask = transform(image, mask)
            assert out_image.shape[0] == channels and out_image.dtype == torch.from_numpy(image).dtype
            for first in sorted({0, channels // 2, channels - 1}):
                torch.manual_seed(seed)
                rgb_image, rgb_mask = transform(np.ascontiguousarray(np.repeat(image[..., first:first + 1], 3, 2)),
                                                mask)
                # cv2's linear interpolation rounds its many-channel and 3-channel paths differently
                difference = (out_image[first].to(torch.int32) - rgb_image[0].to(torch.int32)).abs()
                assert difference.max() <= 1 and torch.equal(out_mask, rgb_mask)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_16_bit_batches_travel_pinned_to_the_gpu_and_normalize_there_as_on_the_cpu():
    images = torch.randint(0, 65536, (2, 5, 9, 11), dtype=torch.int32).to(torch.uint16)
    mean, std = (0.5,) * 5, (0.25,) * 5
    on_gpu = images.pin_memory().to("cuda", non_blocking=True)
    assert on_gpu.dtype == torch.uint16
    torch.testing.assert_close(normalize_batch(on_gpu, mean, std, max_value=65535).cpu(),
                               normalize_batch(images, mean, std, max_value=65535), rtol=0, atol=1e-6)


@pytest.mark.parametrize("photometric", [False, True])
def test_flip_is_drawn_independently_of_the_scale(photometric):
    """Issue 31: every step seeded with the sample's one seed drew the same first number, so the flip fired
    exactly when the scale was below the range's middle (upscaled crops were never flipped). The mask shows
    both: a 40 x 40 image in a 100 x 100 crop is visible over round(40 * scale) columns, and a flip moves the
    padding (the ignore label) from the right to the left."""
    image = np.full((40, 40, 3), 100, dtype=np.uint8)
    mask = np.zeros((40, 40), dtype=np.uint8)
    transform = PairTransform(build_train_augmentation(100, (0.5, 2.0), hflip=True, photometric=photometric),
                              random=True)
    torch.manual_seed(0)
    flips = {"small": [], "large": []}
    for _ in range(300):
        _, out_mask = _run(transform, image, mask)
        visible = int((out_mask[0] != 255).sum())
        flips["large" if visible > 50 else "small"].append(bool(out_mask[0, 0] == 255))
    for size, drawn in flips.items():
        assert len(drawn) > 60, size
        assert 0.3 < np.mean(drawn) < 0.7, (size, np.mean(drawn))


@pytest.mark.parametrize("rot90", [False, True])
def test_geometry_run_step_by_step_equals_albumentations_compose(rot90):
    """PairTransform runs the training geometry itself (no Compose machinery per sample); albumentations'
    Compose with the same per-step seeds is the reference, on 8- and 16-bit images of 1, 3 and 6 channels."""
    rng = np.random.default_rng(0)
    augmentation = build_train_augmentation(48, (0.5, 2.0), hflip=True, rot90=rot90)
    direct, composed = PairTransform(augmentation, random=True), PairTransform(augmentation, random=True)
    composed._direct = False
    assert direct._direct
    padded = set()
    for trial in range(60):
        height, width = (int(value) for value in rng.integers(10, 120, 2))
        channels, dtype = (1, 3, 6)[trial % 3], (np.uint8, np.uint16)[trial % 2]
        image = rng.integers(0, np.iinfo(dtype).max, (height, width, channels), dtype=dtype)
        mask = rng.integers(0, 21, (height, width), dtype=np.uint8)
        torch.manual_seed(trial)
        got_image, got_mask = direct(image, mask)
        torch.manual_seed(trial)
        ref_image, ref_mask = composed(image, mask)
        assert torch.equal(got_image, ref_image) and torch.equal(got_mask, ref_mask), trial
        padded.add(bool((got_mask == 255).any()))  # the mask holds 0..20: 255 is padding
    assert padded == {False, True}  # crops the source fills (a view, or flipped in one pass) and padded ones


@pytest.mark.parametrize("crop", [48, (40, 56)])
@pytest.mark.parametrize("channels", [1, 3, 6])
def test_the_crop_flipped_in_its_own_pass_or_left_a_view_is_the_flipped_or_copied_crop(crop, channels):
    """RandomScaleCrop writes a HorizontalFlip that follows it itself (`flip`) and may hand back a view of the
    resized window (`view`): the same arrays as the crop flipped afterwards / copied, padded or not."""
    from syncseg.data.transforms import RandomScaleCrop

    rng = np.random.default_rng(channels)
    image = rng.integers(0, 65535, (70, 90, channels), dtype=np.uint16)
    mask = rng.integers(0, 21, (70, 90), dtype=np.uint8)
    transform, cases = RandomScaleCrop(crop, (0.5, 2.0)), set()
    for scale in (0.4, 0.7, 1.0, 1.3, 1.9):
        crop_h, crop_w = transform.crop_size
        scaled = (round(70 * scale), round(90 * scale))
        for top, left in ((0, 0), (max(0, scaled[0] - crop_h), max(0, scaled[1] - crop_w))):
            params = {"scale": scale, "top": top, "left": left, "scaled_shape": scaled}
            plain_image, plain_mask = transform.apply(image, **params), transform.apply_to_mask(mask, **params)
            assert plain_image.flags.c_contiguous and plain_mask.flags.c_contiguous  # Compose gets its own arrays
            for flip in (False, True):
                for view in (False, True):
                    got = transform.apply(image, flip=flip, view=view, **params)
                    got_mask = transform.apply_to_mask(mask, flip=flip, view=view, **params)
                    want, want_mask = (plain_image[:, ::-1], plain_mask[:, ::-1]) if flip else (plain_image, plain_mask)
                    assert got.shape == want.shape and np.array_equal(got, want), (scale, top, left, flip, view)
                    assert np.array_equal(got_mask, want_mask), (scale, top, left, flip, view)
            cases.add(bool((plain_mask == 255).any()))
    assert cases == {False, True}


def test_compact_masks_stay_uint8_with_the_same_labels_and_other_masks_widen():
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (70, 90, 3), dtype=np.uint8)
    mask = rng.integers(0, 21, (70, 90), dtype=np.uint8)
    cfg = DataConfig(crop_size=48, scale_range=(0.5, 2.0))
    wide, compact = build_train_transform(cfg), build_train_transform(cfg, compact_masks=True)
    for trial in range(20):
        torch.manual_seed(trial)
        wide_image, wide_mask = wide(image, mask)
        torch.manual_seed(trial)
        compact_image, compact_mask = compact(image, mask)
        assert wide_mask.dtype == torch.int64 and compact_mask.dtype == torch.uint8
        assert torch.equal(compact_mask.long(), wide_mask) and torch.equal(compact_image, wide_image), trial
    # a read-only decoded mask (Pillow's arrays are) is copied, not shared with a warning; int32 masks widen
    frozen = mask.copy()
    frozen.setflags(write=False)
    untouched = PairTransform(None, random=False, compact_masks=True)
    _, out = untouched(image, frozen)
    assert out.dtype == torch.uint8 and torch.equal(out, torch.from_numpy(mask))
    _, out = untouched(image, mask.astype(np.int32))
    assert out.dtype == torch.int64 and torch.equal(out, torch.from_numpy(mask).long())
