"""Config files and command lines -> a typed, validated syncseg.engine.config.Config, and back to plain dicts.

Order of precedence (last wins): dataclass defaults -> `base:` config(s) -> the YAML file ->
`KEY=VALUE` overrides. Unknown keys raise ValueError naming the closest valid key. Values are
converted to the type of the field they set, so `train.iters=200` is an int and
`data.scale_range=0.5,2.0` a tuple of floats. Keys that were renamed are still read (checkpoints
written before the rename keep loading).
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import yaml

from syncseg.engine.config.mappings import MAPPING_PARSERS, MAPPING_TYPE_NAMES, marker, plain
from syncseg.engine.config.fields import SquareIfOne
from syncseg.engine.config.schema import (CONFIG_DIR, SECTIONS, Config, DataConfig, all_keys, field_types, validate)
from syncseg.engine.atomic import write_atomically

logger = logging.getLogger(__name__)

RENAMED_KEYS = {"eval.crop_size": "eval.window_size"}  # old name -> current name


def _unknown_key_error(key: str, source: str) -> ValueError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(all_keys())}"
    return ValueError(f"{source}: unknown config key '{key}'{hint}")


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if type(marker(annotation)) in MAPPING_TYPE_NAMES:
        return MAPPING_TYPE_NAMES[type(marker(annotation))]
    if origin is Annotated and _is_square_size(annotation):
        return "H,W (two integers, or one for a square)"
    if origin is tuple:
        args = typing.get_args(annotation)
        inner = args[0].__name__ if args else "value"
        return f"a comma-separated list of {inner}"
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(annotation)))
    return getattr(annotation, "__name__", str(annotation))


def _is_square_size(annotation: Any) -> bool:
    return any(isinstance(mark, SquareIfOne) for mark in typing.get_args(annotation)[1:])


def _convert(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Convert a YAML or command-line value to the field's declared type (choices are validate()'s)."""
    origin = typing.get_origin(annotation)
    fail = ValueError(f"{source}: config key '{key}' expects {_type_name(annotation)}, got {value!r}")
    if type(marker(annotation)) in MAPPING_PARSERS:
        try:
            return MAPPING_PARSERS[type(marker(annotation))](value)
        except (TypeError, ValueError):
            raise fail from None
    if origin is Annotated:
        base = typing.get_args(annotation)[0]
        if _is_square_size(annotation):  # one value: a square (every config and checkpoint before H,W)
            parts = value.strip("()[] ").split(",") if isinstance(value, str) else value
            if isinstance(parts, (list, tuple)) and len(parts) == 1:
                value = [parts[0], parts[0]]
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                value = [value, value]
        try:
            return _convert(value, base, key, source)
        except ValueError:
            raise fail from None
    if origin is Literal:
        choices = typing.get_args(annotation)
        kinds = {type(choice) for choice in choices}
        if bool in kinds and not (isinstance(value, str) and value in choices):  # auto | true | false
            try:
                return _convert(value, bool, key, source)
            except ValueError:
                raise fail from None
        try:
            return _convert(value, kinds.pop() if len(kinds) == 1 else str, key, source)
        except ValueError:
            raise fail from None
    if origin is tuple:
        args = typing.get_args(annotation)
        if isinstance(value, str):
            value = [v for v in (p.strip() for p in value.strip("()[] ").split(",")) if v]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise fail
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], key, source) for v in value)
        if len(value) != len(args):
            raise fail
        return tuple(_convert(v, a, key, source) for v, a in zip(value, args))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise fail
    if annotation is int:
        if isinstance(value, bool):
            raise fail
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                try:
                    as_float = float(value)
                except ValueError:
                    raise fail from None
                if as_float.is_integer():
                    return int(as_float)
        raise fail
    if annotation is float:
        if isinstance(value, bool):
            raise fail
        try:
            return float(value)
        except (TypeError, ValueError):
            raise fail from None
    if annotation is str:
        if value is None:
            return ""
        if isinstance(value, (dict, list)):
            raise fail
        return str(value)
    raise AssertionError(f"unsupported field type {annotation!r} for {key}")


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path as given, or a bare name looked up in configs/ (with or without .yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / path.name, CONFIG_DIR / f"{path.name}.yaml"):
        if candidate.is_file():
            return candidate
    available = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
    raise FileNotFoundError(
        f"config file '{name_or_path}' not found (looked at '{path}' and in '{CONFIG_DIR}'); "
        f"available: {', '.join(available) or 'none'}"
    )


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config, merging the `base:` chain under it (base first; a relative base is looked up
    beside the file, then as a path or a name in configs/)."""
    path = path.resolve()
    if path in seen:
        raise ValueError(f"{path}: circular 'base:' chain: {' -> '.join(map(str, seen + (path,)))}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of config keys at the top level, got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        return raw
    base_path = Path(str(base))
    if not base_path.is_absolute() and (path.parent / base_path).is_file():
        base_path = path.parent / base_path
    merged = read_yaml(resolve_config_path(base_path), seen + (path,))
    _deep_update(merged, raw)
    return merged


def _deep_update(target: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = value


def flatten(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    """{"train": {"iters": 5}, "name": "x"} -> {"train.iters": 5, "name": "x"}."""
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ValueError(f"{source}: '{key}' must be a mapping of keys, got {value!r}")
            for sub_key, sub_value in value.items():
                flat[f"{key}.{sub_key}"] = sub_value
        else:
            flat[str(key)] = value
    return flat


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`["train.iters=200", "data.root=/x"]` -> {"train.iters": "200", "data.root": "/x"}."""
    parsed = {}
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"command line: override '{item}' must look like KEY=VALUE (e.g. train.iters=200)")
        key, value = item.split("=", 1)
        parsed[key.strip()] = value
    return parsed


def _current_name(key: str, source: str) -> str:
    if key in RENAMED_KEYS:
        logger.debug("%s: config key %s is now called %s", source, key, RENAMED_KEYS[key])
        return RENAMED_KEYS[key]
    return key


def build_config(values: Mapping[str, Any], *, source: str = "config", base: Config | None = None,
                 origins: Mapping[str, str] | None = None) -> Config:
    """Apply flat dotted `values` on top of `base` (defaults when None), converting each value, then
    validating the result once.

    `origins` (key -> the file or "command line" that set it; `source` for keys it does not list) names the
    origin in errors: a value that does not convert names its own key's origin, a rule over several keys the
    origins of the keys its message names before any hint (`source` when it names none of `values`).
    """
    origins = dict(origins or {})
    current = to_dict(base or Config())
    set_keys = {}
    for key, value in values.items():
        origin = origins.get(key, source)
        key = _current_name(key, origin)
        set_keys[key] = origin
        section, _, name = key.partition(".")
        if name:
            if section not in SECTIONS or name not in field_types(SECTIONS[section]):
                raise _unknown_key_error(key, origin)
            current[section][name] = _convert(value, field_types(SECTIONS[section])[name], key, origin)
        else:
            types = field_types(Config)
            if key not in types or key in SECTIONS:
                raise _unknown_key_error(key, origin)
            current[key] = _convert(value, types[key], key, origin)
    config = from_dict(current, source=source)
    _validate_naming_origins(config, set_keys, fallback=source)
    return config


_UNNAMED = "\0"  # validate()'s source while the origin is not known yet
_MENTIONED_KEY = re.compile(r"\b(?:" + "|".join(SECTIONS) + r")\.[a-z_]+\b|\b[a-z_]+(?==)")


def _validate_naming_origins(config: Config, origins: Mapping[str, str], *, fallback: str) -> None:
    """validate(config), its error prefixed with where the keys it names were set (see build_config)."""
    try:
        validate(config, source=_UNNAMED)
    except ValueError as error:
        message = str(error)
        if not message.startswith(_UNNAMED + ": "):
            raise
        body = message[len(_UNNAMED) + 2:]
        problem = body.split(";")[0]  # what is wrong; a hint after ';' may name keys that are not at fault
        named = [origins[key] for key in _MENTIONED_KEY.findall(problem) if key in origins]
        where = " and ".join(dict.fromkeys(named)) or fallback
        raise ValueError(f"{where}: {body}") from None


def load_config(name_or_path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                normalization_unknown: bool = False) -> Config:
    """YAML file (with `base:` chain) then `KEY=VALUE` overrides -> one validated Config.

    The file and the overrides are merged first and validated together, so a rule over several keys sees
    the command line's values (a shared base file completed per run); errors name the file or the command
    line that set the keys involved.

    `normalization_unknown` is for the tool that measures data.mean and data.std (verify_dataset), which
    needs neither: when the file and the command line leave one of them unset while data.in_channels is
    not its default's length, it stands at 0 (mean) or 1 (std) per channel instead of failing the check
    that training needs (one value per channel).
    """
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    sources = []
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        for key, value in flatten(read_yaml(path), str(path)).items():
            values[key], origins[key] = value, str(path)
        sources.append(str(path))
    for key, value in parse_overrides(overrides).items():
        values.pop(key, None)  # the command line's value wins, and is checked as the command line's
        values[key], origins[key] = value, "command line"
    if overrides:
        sources.append("command line")
    if normalization_unknown:
        _neutral_normalization(values, origins)
    return build_config(values, source=" with the ".join(sources) or "config", origins=origins)


def _neutral_normalization(values: dict[str, Any], origins: dict[str, str]) -> None:
    """data.mean = 0 and data.std = 1 per channel, each where `values` leaves it unset and data.in_channels
    asks for another count than its default's (see load_config's normalization_unknown)."""
    defaults = DataConfig()
    try:
        channels = _convert(values.get("data.in_channels", defaults.in_channels), int, "data.in_channels", "")
    except ValueError:
        return  # build_config names the value and where it was set
    for key, neutral, default in (("data.mean", 0.0, defaults.mean), ("data.std", 1.0, defaults.std)):
        if key not in values and channels >= 1 and channels != len(default):
            values[key] = [neutral] * channels
            origins[key] = f"{key} left unset (0 for the mean, 1 for the std: nothing is normalized here)"


def to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict of primitives (tuples become lists), safe for YAML, JSON and checkpoints."""
    out: dict[str, Any] = {}
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if dataclasses.is_dataclass(value):
            types = field_types(type(value))
            out[item.name] = {g.name: plain(getattr(value, g.name), types[g.name]) for g in dataclasses.fields(value)}
        else:
            out[item.name] = plain(value, None)
    return out


def from_dict(raw: Mapping[str, Any], *, source: str = "config") -> Config:
    """Inverse of to_dict; unknown keys raise (so an old checkpoint's config is checked too)."""
    sections: dict[str, Any] = {}
    top: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SECTIONS:
            cls = SECTIONS[key]
            types = field_types(cls)
            kwargs = {}
            for name, sub_value in (value or {}).items():
                dotted = _current_name(f"{key}.{name}", source)
                name = dotted.partition(".")[2]
                if name not in types:
                    raise _unknown_key_error(dotted, source)
                kwargs[name] = _convert(sub_value, types[name], dotted, source)
            sections[key] = cls(**kwargs)
        else:
            types = field_types(Config)
            if key not in types:
                raise _unknown_key_error(key, source)
            top[key] = _convert(value, types[key], key, source)
    return Config(**top, **sections)


def inference_config(
    saved: Mapping[str, Any],
    overrides: list[str] | tuple[str, ...] = (),
    *,
    source: str,
    flags: Mapping[str, Any] | None = None,
) -> Config:
    """A checkpoint's stored config for inference: then KEY=VALUE overrides, then the CLI `flags`
    ({"eval.mode": "slide", ...}; None values are left out).

    The weights come from the checkpoint, so backbone and init weights are never read again.
    """
    values: dict[str, Any] = {"model.pretrained_backbone": "none", "model.init_checkpoint": ""}
    values.update(parse_overrides(overrides))
    values.update({key: value for key, value in (flags or {}).items() if value is not None})
    return build_config(values, source="command line", base=from_dict(saved, source=source))


def config_yaml(config: Config, *, header: str = "") -> str:
    """Every key of `config` (defaults included) as YAML, readable back with --config; `header` lines
    become YAML comments on top."""
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    return comments + yaml.safe_dump(to_dict(config), sort_keys=False)


def save_config(config: Config, path: str | Path) -> None:
    """Write config.yaml atomically: a resume rewrites it, and a full disk must not leave it empty."""
    text = config_yaml(config).encode()
    write_atomically(path, lambda file: file.write(text), what="config")
