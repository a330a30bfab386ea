"""Pictures for people: the image | truth | prediction grid with column titles and a colour legend, and
prediction overlays on photos.

Colours come from the dataset palette (syncseg.data.base.palette_table); pixels equal to the ignore label are
drawn in data.IGNORE_COLOR (VOC's cream), so they are told apart from background (often black). Panels
narrower than MIN_PANEL_WIDTH are enlarged by a whole factor (nearest neighbour: every label pixel
stays a solid block) so the titles fit and small crops stay visible in TensorBoard.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from syncseg.data.images import display_rgb
from syncseg.data.palettes import IGNORE_COLOR, palette_table
from syncseg.data.registry import dataset_kind
from syncseg.engine.atomic import write_atomically
from syncseg.engine.inference import predict_batch

MIN_PANEL_WIDTH = 128
GRID_TITLES = ("image", "truth", "prediction")
BACKGROUND_NAMES = ("background", "_background_")  # classes an overlay leaves uncoloured
_BAND_COLOR = (32, 32, 32)  # title and legend bands
_TEXT_COLOR = (240, 240, 240)
_GAP = 2  # pixels between panels


@lru_cache(maxsize=4)
def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)  # Pillow's bundled font: nothing read from the system


def color_labels(labels: np.ndarray, palette: np.ndarray, *, ignore_index: int) -> np.ndarray:
    """HxW labels -> HxWx3 uint8 colours (IGNORE_COLOR for `ignore_index`, black past the palette)."""
    return palette_table(palette, ignore_index=ignore_index)[np.asarray(labels, dtype=np.uint8)]


def _enlarge(panel: np.ndarray, factor: int) -> np.ndarray:
    return panel if factor == 1 else panel.repeat(factor, axis=0).repeat(factor, axis=1)


def titled_grid(rows: Sequence[Sequence[np.ndarray]], titles: Sequence[str]) -> np.ndarray:
    """HxWx3 uint8 panels in rows under one band of column titles. Columns are as wide as their widest
    panel (smaller panels padded with the band colour), so titles sit over their column for images of
    any size; panels narrower than MIN_PANEL_WIDTH are enlarged by a whole factor."""
    if not rows:
        raise ValueError("titled_grid: no rows")
    narrowest = min(panel.shape[1] for row in rows for panel in row)
    factor = max(1, math.ceil(MIN_PANEL_WIDTH / max(1, narrowest)))
    rows = [[_enlarge(np.asarray(panel, dtype=np.uint8), factor) for panel in row] for row in rows]
    num_columns = max(len(row) for row in rows)
    widths = [max(row[column].shape[1] for row in rows if column < len(row)) for column in range(num_columns)]
    font = _font(16)
    band = 24
    width = sum(widths) + _GAP * (num_columns - 1)
    height = band + sum(max(panel.shape[0] for panel in row) for row in rows) + _GAP * (len(rows) - 1)
    canvas = np.empty((height, width, 3), dtype=np.uint8)
    canvas[:] = _BAND_COLOR
    top = band
    for row in rows:
        left = 0
        for column, panel in enumerate(row):
            canvas[top:top + panel.shape[0], left:left + panel.shape[1]] = panel
            left += widths[column] + _GAP
        top += max(panel.shape[0] for panel in row) + _GAP
    picture = Image.fromarray(canvas)
    draw = ImageDraw.Draw(picture)
    left = 0
    for column, title in enumerate(list(titles)[:num_columns]):
        draw.text((left + widths[column] / 2, band / 2), title, fill=_TEXT_COLOR, font=font, anchor="mm")
        left += widths[column] + _GAP
    return np.asarray(picture)


def legend_image(names: Sequence[str], colors: Sequence[Sequence[int]], *, width: int) -> np.ndarray:
    """A legend `width` pixels wide: a colour swatch and the name of each entry, wrapped into lines."""
    font, swatch, pad, line = _font(14), 14, 6, 22
    entries = [(str(name), tuple(int(c) for c in color)) for name, color in zip(names, colors)]
    sizes = [swatch + 4 + math.ceil(font.getlength(name)) + 2 * pad for name, _ in entries]
    lines, current, used = [], [], 0
    for entry, size in zip(entries, sizes):
        if current and used + size > width:
            lines.append(current)
            current, used = [], 0
        current.append((entry, size))
        used += size
    if current:
        lines.append(current)
    picture = Image.new("RGB", (max(1, width), line * len(lines) + pad), _BAND_COLOR)
    draw = ImageDraw.Draw(picture)
    for number, entries_of_line in enumerate(lines):
        left, top = pad, pad // 2 + number * line
        for (name, color), size in entries_of_line:
            draw.rectangle((left, top + 2, left + swatch - 1, top + 2 + swatch - 1), fill=color, outline=_TEXT_COLOR)
            draw.text((left + swatch + 4, top + 2 + swatch / 2), name, fill=_TEXT_COLOR, font=font, anchor="lm")
            left += size
    return np.asarray(picture)


def with_legend(picture: np.ndarray, classes: Sequence[str], palette: np.ndarray, *,
                ignore: bool = True) -> np.ndarray:
    """`picture` with a legend of the class colours (and "ignore" in IGNORE_COLOR) appended below."""
    names, colors = list(classes), [tuple(color) for color in np.asarray(palette)[: len(classes)]]
    if ignore:
        names.append("ignore")
        colors.append(IGNORE_COLOR)
    legend = legend_image(names, colors, width=picture.shape[1])
    return np.concatenate([picture, legend], axis=0)


@torch.no_grad()
def prediction_grid(model: torch.nn.Module, dataset: Any, indices: Sequence[int], *, device: torch.device,
                    data_cfg: Any, eval_cfg: Any, should_stop: Callable[[], bool] | None = None) -> np.ndarray | None:
    """image | truth | prediction, one row per dataset index, predicted as evaluation does
    (syncseg.engine.inference.predict_batch with `eval_cfg`, in eval mode; the model's mode is restored), under
    column titles and above a legend of the class colours and the ignore colour. Images other than 8-bit
    RGB are drawn by syncseg.data.images.display_rgb. None when `should_stop()`, asked before every image
    (it must not communicate: only rank 0 draws), said to stop."""
    palette = dataset_kind(data_cfg.dataset).palette_for(len(dataset.classes))
    ignore_index = int(getattr(dataset, "ignore_index", data_cfg.ignore_index))
    rows = []
    was_training = model.training
    model.eval()
    try:
        for index in indices:
            if should_stop is not None and should_stop():
                return None
            image, mask = dataset[index]
            logits = predict_batch(model, image.unsqueeze(0).to(device), num_classes=len(dataset.classes),
                                   data_cfg=data_cfg, eval_cfg=eval_cfg, output_size=tuple(mask.shape[-2:]))
            prediction = logits.argmax(1)[0].cpu().numpy()
            rows.append([display_rgb(image.permute(1, 2, 0).numpy(), data_cfg.max_value)] + [
                color_labels(labels, palette, ignore_index=ignore_index) for labels in (mask.numpy(), prediction)])
    finally:
        model.train(was_training)
    return with_legend(titled_grid(rows, GRID_TITLES), dataset.classes, palette)


def background_indices(classes: Sequence[str]) -> list[int]:
    """Indices of the classes named background (BACKGROUND_NAMES, any case): an overlay leaves them bare."""
    return [index for index, name in enumerate(classes) if str(name).lower() in BACKGROUND_NAMES]


def overlay(image: np.ndarray, labels: np.ndarray, palette: np.ndarray, *, alpha: float,
            uncoloured: Sequence[int] = ()) -> np.ndarray:
    """The photo (HxWx3 uint8) with each pixel's class colour blended in at opacity `alpha`, except the
    pixels of the `uncoloured` classes (background), which keep the photo's own values."""
    colors = np.asarray(palette, dtype=np.float32)[np.asarray(labels, dtype=np.int64)]
    blended = (1 - alpha) * image.astype(np.float32) + alpha * colors
    result = np.clip(np.rint(blended), 0, 255).astype(np.uint8)
    if len(uncoloured):
        keep = np.isin(labels, np.asarray(uncoloured))
        result[keep] = image[keep]
    return result


def save_png(image: Image.Image | np.ndarray, path: Any) -> None:
    """Write `image` as a PNG at `path`, never half-written (syncseg.engine.atomic.write_atomically, without
    fsync): a full disk is an OSError naming the file, and an earlier file there stays whole."""
    picture = image if isinstance(image, Image.Image) else Image.fromarray(image)
    write_atomically(path, lambda file: picture.save(file, format="PNG"), what="image", durable=False)
