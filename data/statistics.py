"""A split's statistics as verify_dataset reports them (syncseg/commands/verify_dataset.py prints them): each
sample read as the config reads it and as its file stores it, in DataLoader workers (`_Stats`), the images'
per-channel sums and ranges by stored format (`ChannelStats`), and their totals over a split (`verify_split`).
numpy and torch are imported where used, so that importing this module stays light.
"""
from __future__ import annotations

from typing import Any


class _Stats:
    """Per-sample statistics computed in loader workers (a map-style dataset): the sample as the config reads it
    (its errors: one line per bad file), and the image as its file stores it, whatever the config says, so that
    the config lines that read it can be printed even when the config cannot read it."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        import numpy as np

        from syncseg.data import BadSampleError

        errors: list[str] = []
        try:
            image, labels = self.dataset.load(index)
        except (BadSampleError, OSError) as error:
            errors.append(str(error))
            image = labels = None
        stored = image
        path = f"sample {index}"
        if hasattr(self.dataset, "samples"):  # files: read them as stored too
            path = str(self.dataset.samples[index][0])
            stored, labels = self._as_stored(index, image, labels, errors)
        item: dict[str, Any] = {"index": index, "path": path, "errors": errors}
        if stored is not None:
            values = stored.reshape(-1, stored.shape[2]).astype(np.float64)
            item.update(height=stored.shape[0], width=stored.shape[1],
                        format=(stored.shape[2], 8 * stored.dtype.itemsize), sum=values.sum(0),
                        squares=np.square(values).sum(0), min=values.min(0), max=values.max(0))
        if labels is not None:
            item["counts"] = np.bincount(labels.ravel(), minlength=256)
        return item

    def _as_stored(self, index: int, image: Any, labels: Any, errors: list[str]) -> tuple[Any, Any]:
        """(the image as its file stores it, the labels), each None when unreadable; the mask is read alone when
        the config could not read the image, so that its classes count."""
        from syncseg.data import BadSampleError
        from syncseg.data.images import read_stored_image

        image_path, mask_path = self.dataset.samples[index]
        try:
            stored = read_stored_image(image_path)
        except BadSampleError:
            return image, labels  # only the config's reader reads it (e.g. a float TIFF as RGB), or nothing does
        if labels is None and hasattr(self.dataset, "labels_for"):  # annotation shapes: drawn for the stored size
            try:
                labels = self.dataset.labels_for(index, *stored.shape[:2])
            except BadSampleError as error:
                if str(error) not in errors:
                    errors.append(str(error))
        elif labels is None:
            try:
                raw = self.dataset.masks.read_raw(mask_path)
                if raw.shape != stored.shape[:2]:
                    raise BadSampleError(f"image '{image_path}' is {stored.shape[1]}x{stored.shape[0]} but mask "
                                         f"'{mask_path}' is {raw.shape[1]}x{raw.shape[0]} (width x height); they "
                                         "must match")
                labels = self.dataset.masks.to_labels(raw, mask_path)
            except BadSampleError as error:
                if str(error) not in errors:
                    errors.append(str(error))
        return stored, labels


class ChannelStats:
    """Per-channel sums, range and pixel count of the images of one stored format (channels, bits)."""

    def __init__(self, channels: int, bits: int) -> None:
        import numpy as np

        self.channels, self.bits, self.num_images, self.num_pixels = channels, bits, 0, 0
        self.paths: list[str] = []
        self.sum, self.squares = np.zeros(channels), np.zeros(channels)
        self.low, self.high = np.full(channels, np.inf), np.full(channels, -np.inf)

    def add(self, item: dict[str, Any]) -> None:
        import numpy as np

        self.num_images += 1
        self.paths.append(item["path"])
        self.num_pixels += item["height"] * item["width"]
        self.sum += np.asarray(item["sum"])  # the loader hands the worker's arrays over as tensors
        self.squares += np.asarray(item["squares"])
        self.low = np.minimum(self.low, np.asarray(item["min"]))
        self.high = np.maximum(self.high, np.asarray(item["max"]))

    def full_scale(self) -> int:
        """syncseg.data.checks.full_scale: 255 for 8-bit files, else the 10- to 16-bit full scale that holds the
        largest value seen."""
        from syncseg.data.checks import full_scale

        return full_scale(self.bits, float(self.high.max()))

    def config(self) -> dict[str, Any]:
        """data.in_channels, max_value, mean and std (units of max_value) for these images, and the mean
        and std in the images' own units."""
        import numpy as np

        mean = self.sum / self.num_pixels
        std = np.sqrt(np.maximum(self.squares / self.num_pixels - mean ** 2, 0.0))
        std[std == 0] = 1.0  # a constant channel: any positive std normalizes it to a constant
        scale = self.full_scale()

        def rounded(values: Any, digits: int) -> list[float]:
            return [round(float(value), digits) for value in values]

        return {"in_channels": self.channels, "max_value": scale, "mean": rounded(mean / scale, 4),
                "std": rounded(std / scale, 4), "mean_in_image_units": rounded(mean, 1),
                "std_in_image_units": rounded(std, 1)}

    def describe(self) -> str:
        ranges = ", ".join(f"{low:g}..{high:g}" for low, high in zip(self.low, self.high))
        return (f"{self.num_images} image(s) of {self.channels} channel(s), {self.bits}-bit, values per channel "
                f"{ranges}")


def verify_split(dataset: Any, *, workers: int = 0, limit: int = 0) -> dict[str, Any]:
    """Statistics of one split: counts, size range, class pixel counts, bad samples (one line per bad file),
    and the images' stored formats (every image whose file can be read as stored, bad ones under the
    config included)."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    indices = range(min(len(dataset), limit) if limit > 0 else len(dataset))
    loader = DataLoader(torch.utils.data.Subset(_Stats(dataset), list(indices)), batch_size=None,
                        num_workers=workers)
    pixels = np.zeros(256, dtype=np.int64)
    bad, heights, widths = [], [], []
    num_bad = 0
    formats: dict[tuple[int, int], ChannelStats] = {}
    for item in loader:
        bad.extend(item["errors"])
        num_bad += bool(item["errors"])
        if "format" in item:
            heights.append(int(item["height"]))
            widths.append(int(item["width"]))
            formats.setdefault(tuple(item["format"]), ChannelStats(*item["format"])).add(item)
        if "counts" in item:
            pixels += np.asarray(item["counts"], dtype=np.int64)
    num_classes = dataset.num_classes
    class_pixels = pixels[:num_classes]
    frequencies = class_pixels / max(1, class_pixels.sum())
    present = frequencies > 0
    weights = np.zeros(num_classes)
    if present.any():
        weights[present] = np.median(frequencies[present]) / frequencies[present]
    return {
        "num_samples": len(dataset),
        "num_checked": len(indices),
        "num_bad": num_bad,
        "bad": bad,
        "height_range": [min(heights), max(heights)] if heights else None,
        "width_range": [min(widths), max(widths)] if widths else None,
        "ignore_pixels": int(pixels[dataset.ignore_index]),
        "classes": list(dataset.classes),
        "class_pixels": class_pixels.tolist(),
        "class_frequency": frequencies.tolist(),
        "median_frequency_weights": weights.round(4).tolist(),
        "image_formats": formats,  # replaced by plain values for the JSON report
    }
