"""What is wrong with a shape, one line each: the start of training looks at 32 samples, verify_dataset at all.

A polygon that loops over itself (a pixel it winds around twice, which the tools' fill rules draw differently:
even-odd leaves it empty, nonzero fills it) is an error; one that only crosses itself (a twist: labelme's own
example set has two), polygons of fewer than 3 points, zero-area shapes and coordinates outside the image are
warnings (the second and third draw nothing, the last is clipped). numpy only.
"""
from __future__ import annotations

import numpy as np

from syncseg.data.annotations.shapes import Shape

def ring_area(ring: np.ndarray) -> float:
    """The shoelace area of a closed ring of (x, y) points (pixels^2, unsigned)."""
    xy = np.asarray(ring, dtype=np.float64).reshape(-1, 2)
    x, y = xy[:, 0], xy[:, 1]
    return float(abs(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))) / 2)


def self_intersection(ring: np.ndarray) -> tuple[float, float] | None:
    """A point where two non-adjacent edges of the closed ring properly cross (touching does not count),
    or None. O(n^2) in the ring's points, vectorized per edge."""
    xy = np.asarray(ring, dtype=np.float64).reshape(-1, 2)
    keep = np.ones(len(xy), dtype=bool)
    keep[1:] = np.any(xy[1:] != xy[:-1], axis=1)  # repeated points make zero-length edges
    xy = xy[keep]
    if len(xy) > 1 and np.array_equal(xy[0], xy[-1]):
        xy = xy[:-1]
    count = len(xy)
    if count < 4:
        return None
    start, end = xy, np.roll(xy, -1, axis=0)
    direction = end - start

    def cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]

    for i in range(count - 2):
        others = np.arange(i + 2, count if i > 0 else count - 1)  # not the edge itself nor its neighbours
        if not len(others):
            continue
        d_i = direction[i]
        side_start = cross(d_i, start[others] - start[i])
        side_end = cross(d_i, end[others] - start[i])
        side_a = cross(direction[others], start[i] - start[others])
        side_b = cross(direction[others], end[i] - start[others])
        crossing = (side_start * side_end < 0) & (side_a * side_b < 0)
        if crossing.any():
            j = others[np.flatnonzero(crossing)[0]]
            t = cross(start[j] - start[i], direction[j]) / cross(d_i, direction[j])
            point = start[i] + t * d_i
            return float(point[0]), float(point[1])
    return None


def overlaps_itself(ring: np.ndarray) -> tuple[float, float] | None:
    """A pixel centre (x, y) that the closed ring winds around twice or more, or None. There the fill rules
    disagree (even-odd leaves it empty, nonzero fills it): a polygon that crosses itself without such a
    pixel (a twist, a figure eight) is drawn alike by every tool."""
    xy = np.asarray(ring, dtype=np.float64).reshape(-1, 2)
    start, end = xy, np.roll(xy, -1, axis=0)
    low, high = int(np.floor(xy[:, 1].min())), int(np.ceil(xy[:, 1].max()))
    left, right = int(np.floor(xy[:, 0].min())), int(np.ceil(xy[:, 0].max())) + 1
    centres = np.arange(low, high + 1, dtype=np.float64)[:, None] + 0.5
    y0, y1 = start[None, :, 1], end[None, :, 1]
    crossing = (y0 <= centres) != (y1 <= centres)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = start[None, :, 0] + (centres - y0) * (end[None, :, 0] - start[None, :, 0]) / (y1 - y0)
    rows, edges = np.nonzero(crossing)
    direction = np.where(y1[0, edges] > y0[0, edges], 1, -1)
    columns = np.clip(np.ceil(x[rows, edges] - 0.5).astype(np.int64) - left, 0, right - left)
    toggles = np.zeros((len(centres), right - left + 1), dtype=np.int64)
    np.add.at(toggles, (rows, columns), direction)
    winding = np.abs(np.cumsum(toggles, axis=1))
    found = np.argwhere(winding >= 2)
    if not len(found):
        return None
    row, column = found[0]
    return float(left + column + 0.5), float(low + row + 0.5)


def shape_problems(shape: Shape, height: int, width: int) -> tuple[list[str], list[str]]:
    """(errors, warnings) about `shape` in an image of `height` x `width`, each one line naming the shape."""
    errors, warnings = [], []
    if shape.kind == "polygon":
        for number, ring in enumerate(shape.rings):
            part = f" (part {number + 1} of {len(shape.rings)})" if len(shape.rings) > 1 else ""
            if len(ring) < 3:
                warnings.append(f"{shape.ident}{part}: a polygon of {len(ring)} point(s), fewer than 3: not drawn")
                continue
            crossing = self_intersection(ring)  # first: a symmetric bow tie has zero area too
            overlap = overlaps_itself(ring) if crossing is not None else None
            if overlap is not None:
                errors.append(f"{shape.ident}{part}: the polygon crosses itself near x={crossing[0]:.1f}, "
                              f"y={crossing[1]:.1f} and winds twice around x={overlap[0]:.1f}, y={overlap[1]:.1f}, "
                              "where tools fill it differently (even-odd leaves it empty, nonzero fills it); redraw "
                              "it without the loop (or split it into two)")
            elif crossing is not None:
                warnings.append(f"{shape.ident}{part}: the polygon crosses itself near x={crossing[0]:.1f}, "
                                f"y={crossing[1]:.1f} (a twist: drawn alike by every tool)")
            elif ring_area(ring) == 0:
                warnings.append(f"{shape.ident}{part}: a polygon of zero area: it draws at most its outline")
    elif shape.kind in ("rectangle", "circle") and len(shape.rings) and len(shape.rings[0]) >= 2:
        first, last = np.asarray(shape.rings[0][0]), np.asarray(shape.rings[0][-1])
        if shape.kind == "rectangle" and (first[0] == last[0] or first[1] == last[1]):
            warnings.append(f"{shape.ident}: a rectangle of zero area: it draws at most its outline")
        if shape.kind == "circle" and np.array_equal(first, last):
            warnings.append(f"{shape.ident}: a circle of radius 0: it draws one pixel at most")
    elif shape.kind in ("rectangle", "circle", "line"):
        count = len(shape.rings[0]) if shape.rings else 0
        warnings.append(f"{shape.ident}: a {shape.kind} needs 2 points, has {count}: not drawn")
    if shape.kind in ("polygon", "rectangle", "circle", "line", "point") and shape.rings:
        xy = np.concatenate([np.asarray(ring, dtype=np.float64).reshape(-1, 2) for ring in shape.rings])
        if len(xy) and (xy[:, 0].min() < 0 or xy[:, 1].min() < 0 or xy[:, 0].max() > width
                        or xy[:, 1].max() > height):
            warnings.append(f"{shape.ident}: coordinates outside the {width}x{height} image (x "
                            f"{xy[:, 0].min():g}..{xy[:, 0].max():g}, y {xy[:, 1].min():g}..{xy[:, 1].max():g}): "
                            "clipped at its edges")
    if shape.kind == "rle":
        size = tuple(int(v) for v in shape.rle["size"])
        if size != (height, width):
            errors.append(f"{shape.ident}: its RLE is {size[1]}x{size[0]} (width x height) but the image is "
                          f"{width}x{height}")
    return errors, warnings
