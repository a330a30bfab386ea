"""Every float config value must be finite (issue 34 item 3): NaN passes any comparison, so a limit alone
let `train.ema_decay=nan` or `data.std=nan,1,1` through. Checked over every key whose type holds a float."""
from __future__ import annotations

import re
import typing

import pytest

from syncseg.engine.config import SECTIONS, field_types, load_config


def _holds_float(annotation) -> bool:
    return annotation is float or any(_holds_float(argument) for argument in typing.get_args(annotation))


def _bad_value(annotation, bad: str) -> str:
    """`bad` where the field's first number goes, the rest valid: 'nan', 'nan,1' or 'ce:nan'."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    arguments = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and arguments and typing.get_origin(arguments[0]) is tuple:
        return f"ce:{bad}"  # (name, weight) pairs: train.loss
    if typing.get_origin(annotation) is tuple and arguments[-1] is not Ellipsis:
        return ",".join([bad] + ["1"] * (len(arguments) - 1))
    return bad


FLOAT_KEYS = [(f"{section}.{name}", annotation) for section, cls in SECTIONS.items()
              for name, annotation in field_types(cls).items() if _holds_float(annotation)]


def test_the_float_keys_are_found():
    keys = {key for key, _ in FLOAT_KEYS}
    assert {"train.lr", "train.ema_decay", "data.std", "data.scale_range", "train.loss", "dist.timeout_s"} <= keys


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key,annotation", FLOAT_KEYS, ids=[key for key, _ in FLOAT_KEYS])
def test_no_float_key_accepts_nan_or_infinity(key, annotation, bad):
    value = _bad_value(annotation, bad)
    with pytest.raises(ValueError, match=rf"^command line: {re.escape(key)}=.*every number must be finite"):
        load_config("demo.yaml", [f"{key}={value}"])
