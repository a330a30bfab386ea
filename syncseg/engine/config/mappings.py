"""The config fields whose values are mappings: data.label_map, data.class_colors and train.loss.

Each is marked in syncseg.engine.config.schema (ValueToClass, ColourToClass, WeightedTerms); this module reads
them from YAML, from `KEY=VALUE` text and from checkpoints' plain dicts, and writes them back in the
form the docs show. Types only: ranges, names and cross-field rules are syncseg.engine.config.schema.validate's.
"""
from __future__ import annotations

import re
import typing
from typing import Annotated, Any, Mapping

from syncseg.data.constants import IGNORE
from syncseg.engine.config.schema import ColourToClass, ValueToClass, WeightedTerms

MAPPING_TYPE_NAMES = {
    ValueToClass: f"raw value -> class index or {IGNORE} (YAML {{255: 1}}; command line 255:1,128:{IGNORE})",
    ColourToClass: (f"colour -> class index or {IGNORE} (YAML {{\"0,0,0\": 0, \"#ff0000\": 1}}; command line "
                    f"#000000:0,#ff0000:1,#ffffff:{IGNORE})"),
    WeightedTerms: "loss name -> weight (YAML [ce: 1.0, dice: 1.0]; command line ce:1,dice:1)",
}


def marker(annotation: Any) -> Any:
    """The schema's marker of an Annotated field (SquareIfOne, ValueToClass, ...), or None."""
    if typing.get_origin(annotation) is not Annotated:
        return None
    return next(iter(typing.get_args(annotation)[1:]), None)


def _entries(value: Any) -> list[tuple[Any, Any]]:
    """(key, value) pairs of a mapping, of a list of one-key mappings or pairs, or of `k:v,k:v` text."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip().strip("{}[]")
        return [tuple(part.split(":", 1)) if ":" in part else (part, None)
                for part in (p.strip() for p in text.split(",")) if part]
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, (list, tuple)):
        pairs = []
        for item in value:
            if isinstance(item, Mapping) and len(item) == 1:
                pairs += list(item.items())
            elif isinstance(item, (list, tuple)) and len(item) == 2:
                pairs.append(tuple(item))
            else:
                pairs.append((item, None))
        return pairs
    raise TypeError(value)


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(value)
    return int(str(value).strip())


def _label_target(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == IGNORE:
        return IGNORE
    return _integer(value)


def _label_map(value: Any) -> tuple[tuple[int, int | str], ...]:
    pairs = [(_integer(raw), _label_target(target)) for raw, target in _entries(value)]
    return tuple(sorted(pairs, key=lambda pair: pair[0]))


_RGB_TEXT = re.compile(r"\s*(#[0-9a-fA-F]{6}|\d+\s*,\s*\d+\s*,\s*\d+)\s*:\s*(\w+)\s*(?:,|$)")


def _rgb(value: Any) -> tuple[int, int, int]:
    if isinstance(value, str) and value.strip().startswith("#") and len(value.strip()) == 7:
        code = int(value.strip()[1:], 16)
        return (code >> 16) & 255, (code >> 8) & 255, code & 255
    parts = value.strip("()[] ").split(",") if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)) or len(parts) != 3:
        raise ValueError(value)
    return tuple(_integer(part) for part in parts)


def _class_colors(value: Any) -> tuple[tuple[tuple[int, int, int], int | str], ...]:
    if isinstance(value, str):  # "R,G,B:class" entries hold commas themselves
        text, position, pairs = value.strip().strip("{}"), 0, []
        while position < len(text):
            match = _RGB_TEXT.match(text, position)
            if match is None:
                raise ValueError(value)
            pairs.append(match.groups())
            position = match.end()
    else:
        pairs = _entries(value)
    colours = [(_rgb(colour), _label_target(target)) for colour, target in pairs]
    return tuple(sorted(colours, key=lambda pair: pair[0]))


def _loss_terms(value: Any) -> tuple[tuple[str, float], ...]:
    terms = []
    for name, weight in _entries(value):
        if not isinstance(name, str) or isinstance(weight, bool):
            raise TypeError(name)
        terms.append((name.strip(), 1.0 if weight is None else float(weight)))
    return tuple(terms)


MAPPING_PARSERS = {ValueToClass: _label_map, ColourToClass: _class_colors, WeightedTerms: _loss_terms}


def plain(value: Any, annotation: Any) -> Any:
    """A field's value as YAML writes it: the mapping fields as mappings (in the form the docs show),
    tuples as lists."""
    kind = type(marker(annotation))
    if kind is ValueToClass:
        return {raw: target for raw, target in value}
    if kind is ColourToClass:
        return {"#{:02x}{:02x}{:02x}".format(*rgb): target for rgb, target in value}
    if kind is WeightedTerms:
        return [{name: weight} for name, weight in value]
    return [plain(v, None) for v in value] if isinstance(value, tuple) else value

