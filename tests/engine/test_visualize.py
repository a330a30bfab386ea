"""syncseg.engine.visualize: titled grids, legends, the ignore colour and photo overlays."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from syncseg.data import IGNORE_COLOR, bit_palette
from syncseg.engine.config import DataConfig, EvalConfig
from syncseg.engine.visualize import (
    MIN_PANEL_WIDTH,
    background_indices,
    color_labels,
    legend_image,
    overlay,
    prediction_grid,
    titled_grid,
    with_legend,
)

BAND = (32, 32, 32)


def test_titled_grid_aligns_columns_enlarges_small_panels_and_draws_titles():
    small = np.full((10, 16, 3), 200, np.uint8)
    wide = np.full((10, 32, 3), 100, np.uint8)
    grid = titled_grid([[small, wide], [wide, small]], ("left", "right"))
    factor = MIN_PANEL_WIDTH // 16  # the narrowest panel reaches MIN_PANEL_WIDTH
    column = 32 * factor  # columns as wide as their widest panel
    assert grid.shape[1] == 2 * column + 2
    band = grid.shape[0] - 2 * 10 * factor - 2
    assert band > 10
    top = grid[band:band + 10 * factor]
    assert (top[:, :16 * factor] == 200).all() and (top[:, 16 * factor:column] == BAND).all()  # padded, not stretched
    assert (top[:, column + 2:] == 100).all()
    title = grid[:band]
    assert (title[:, :column] != BAND).any() and (title[:, column + 2:] != BAND).any()  # text over both columns
    untitled = titled_grid([[small, wide]], ())
    assert (untitled[:band] == BAND).all()


def test_legend_wraps_and_shows_each_colour():
    colors = [(255, 0, 0), (0, 255, 0), (0, 0, 255), IGNORE_COLOR]
    legend = legend_image(["one", "two", "three", "ignore"], colors, width=120)
    assert legend.shape[1] == 120 and legend.shape[0] >= 2 * 20  # four entries do not fit one 120 px line
    pixels = {tuple(p) for p in legend.reshape(-1, 3)}
    assert all(tuple(c) in pixels for c in colors)
    assert legend_image(["one"], colors[:1], width=400).shape[0] < legend.shape[0]


def test_color_labels_paints_ignore_cream_apart_from_background():
    palette = bit_palette(3)
    colors = color_labels(np.array([[0, 1, 255]]), palette, ignore_index=255)
    assert tuple(colors[0, 0]) == (0, 0, 0) and tuple(colors[0, 1]) == tuple(palette[1])
    assert tuple(colors[0, 2]) == IGNORE_COLOR


def test_prediction_grid_has_titles_a_legend_and_cream_ignore_pixels():
    """The colours are the data set kind's (syncseg.data.registry; synthetic: the bit palette), whatever the
    dataset object says."""
    thing = tuple(bit_palette(2)[1])

    class Dataset:
        classes = ("background", "thing")
        palette = np.array([(0, 0, 0), (200, 0, 0)], np.uint8)  # not used
        ignore_index = 255

        def __getitem__(self, index):
            mask = torch.zeros(8, 8, dtype=torch.int64)
            mask[:, :2] = 255
            return torch.full((3, 8, 8), 50, dtype=torch.uint8), mask

    class Model(torch.nn.Module):
        def forward(self, x):
            logits = torch.zeros(x.shape[0], 2, *x.shape[-2:])
            logits[:, 1, :, 4:] = 1.0
            return {"out": logits}

    model = Model().train()
    grid = prediction_grid(model, Dataset(), [0], device=torch.device("cpu"), data_cfg=DataConfig(), eval_cfg=EvalConfig())
    assert model.training  # the caller's mode is restored
    factor = MIN_PANEL_WIDTH // 8
    size = 8 * factor
    pixels = grid.reshape(-1, 3)
    assert grid.shape[1] == 3 * size + 4 and grid.shape[0] > size + 40  # title band + one row + legend
    band = next(row for row in range(grid.shape[0]) if (grid[row, :size] == 50).all())
    truth = grid[band:band + size, size + 2:2 * size + 2]
    assert (truth[:, :2 * factor] == IGNORE_COLOR).all() and (truth[:, 2 * factor:] == 0).all()
    prediction = grid[band:band + size, 2 * size + 4:]
    assert (prediction[:, :4 * factor] == 0).all() and (prediction[:, 4 * factor:] == thing).all()
    # a stop request (asked before every image) ends the grid: nothing is drawn, the mode is restored
    answers = iter([False, True])
    assert prediction_grid(model, Dataset(), [0, 0, 0], device=torch.device("cpu"), data_cfg=DataConfig(),
                           eval_cfg=EvalConfig(), should_stop=lambda: next(answers)) is None
    assert model.training
    legend = grid[band + size:]
    assert (legend == IGNORE_COLOR).all(axis=-1).any() and (legend == thing).all(axis=-1).any()
    assert len({tuple(p) for p in pixels}) > 6  # text is drawn (anti-aliased greys), not only flat colours


def test_overlay_leaves_background_untouched_and_blends_the_rest():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (6, 7, 3), dtype=np.uint8)
    labels = np.zeros((6, 7), np.int64)
    labels[2:, 3:] = 2
    palette = bit_palette(3)
    result = overlay(image, labels, palette, alpha=0.5, uncoloured=background_indices(["Background", "a", "b"]))
    assert np.array_equal(result[labels == 0], image[labels == 0])
    expected = 0.5 * image[labels == 2].astype(float) + 0.5 * palette[2].astype(float)
    assert np.abs(result[labels == 2] - expected).max() <= 0.5
    assert np.array_equal(overlay(image, labels, palette, alpha=1.0), palette[labels])  # no background: all coloured
    assert background_indices(["road", "car"]) == []


def test_with_legend_appends_below_at_the_same_width():
    picture = np.zeros((20, 300, 3), np.uint8)
    out = with_legend(picture, ["a", "b"], bit_palette(2), ignore=False)
    assert out.shape[1] == 300 and out.shape[0] > 20 and np.array_equal(out[:20], picture)
    assert not (out[20:] == IGNORE_COLOR).all(axis=-1).any()
    with pytest.raises(ValueError, match="no rows"):
        titled_grid([], ())
