"""The markers the schema attaches to its fields: numeric `Limit`s, registry-valued fields, and the
`Annotated` markers that tell syncseg.engine.config.io how a value is written in YAML and on the command line
(a square size, a label map, class colours, weighted loss terms). Plain Python: the schema imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from syncseg.lazy_registry import Registry


@dataclass(frozen=True)
class Limit:
    """Bounds for a number, or for every element of a tuple of numbers."""

    ge: float | None = None  # >=
    gt: float | None = None  # >
    le: float | None = None  # <=
    lt: float | None = None  # <

    def violated_by(self, value: float) -> bool:
        return ((self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
                or (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt))

    def describe(self) -> str:
        parts = [f">= {self.ge:g}" if self.ge is not None else "", f"> {self.gt:g}" if self.gt is not None else "",
                 f"<= {self.le:g}" if self.le is not None else "", f"< {self.lt:g}" if self.lt is not None else ""]
        return " and ".join(part for part in parts if part)


def limited(default: Any, limit: Limit) -> Any:
    return field(default=default, metadata={"limit": limit})


def registered(default: str, registry: Registry) -> Any:
    """A field whose values are the names in `registry` (and its families, e.g. model.backbone=timm:<name>)."""
    return field(default=default, metadata={"registry": registry})


@dataclass(frozen=True)
class SquareIfOne:
    """Marks a (height, width) field: one integer (in a file, on the command line, in an old
    checkpoint's config) means a square, so `data.crop_size=513` is (513, 513)."""


PixelSize = Annotated[tuple[int, int], SquareIfOne()]  # (height, width) in pixels


@dataclass(frozen=True)
class ValueToClass:
    """Marks data.label_map: raw mask value -> class index or "ignore". A mapping in YAML ({255: 1}),
    `255:1,128:ignore` on the command line; held as ((raw, target), ...) sorted by raw value."""


@dataclass(frozen=True)
class ColourToClass:
    """Marks data.class_colors: mask colour -> class index or "ignore". A mapping in YAML whose keys are
    "R,G,B" or "#rrggbb" ({"0,0,0": 0, "#ff0000": 1}), `#000000:0,#ff0000:1` on the command line; held
    as (((R, G, B), target), ...) sorted by colour."""


@dataclass(frozen=True)
class WeightedTerms:
    """Marks train.loss: loss name -> weight, in order. A list of one-key mappings in YAML
    ([ce: 1.0, dice: 1.0]; a mapping or bare names, weight 1, work too), `ce:1,dice:1` on the command
    line; held as ((name, weight), ...)."""
