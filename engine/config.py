"""Configuration: frozen dataclasses filled from a YAML file, then dotted command-line overrides.

Order of precedence (last wins): dataclass defaults -> `base:` config(s) -> the YAML file ->
`KEY=VALUE` overrides. Unknown keys raise ValueError naming the closest valid key. Values are
converted to the type of the field they set, so `train.iters=200` is an int and
`data.scale_range=0.5,2.0` a tuple of floats.

Only train.py / eval.py see the whole Config; builders receive their own section
(`build_model(cfg.model, ...)`, `build_dataset(cfg.data, ...)`).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "synthetic"  # voc | cityscapes | synthetic | folder
    root: str = ""  # dataset root folder (unused by synthetic)
    train_split: str = "train"  # voc: train | train_aug; cityscapes: train; folder: a list-file stem or "all"
    val_split: str = "val"
    crop_size: int = 513  # square training crop, pixels
    scale_range: tuple[float, float] = (0.5, 2.0)  # random rescale factors for training
    base_size: int = 0  # eval: resize the long side to this many pixels first (0 = full image)
    hflip: bool = True
    photometric: bool = False  # colour jitter + blur during training
    num_workers: int = 4
    ignore_index: int = 255
    num_classes: int = 0  # folder/synthetic: number of classes (0 = dataset default)
    class_names: tuple[str, ...] = ()  # folder: optional names, len == num_classes
    skip_bad_samples: bool = False  # warn and skip unreadable / inconsistent samples instead of raising
    mean: tuple[float, float, float] = IMAGENET_MEAN  # applied on the device to uint8/255 images
    std: tuple[float, float, float] = IMAGENET_STD
    # synthetic dataset
    synthetic_image_size: int = 128
    synthetic_train_size: int = 2000  # number of training images
    synthetic_val_size: int = 100
    seed: int = 0  # synthetic generator seed (train and val use disjoint streams)


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "deeplabv3plus"  # deeplabv3 | deeplabv3plus
    backbone: str = "resnet50"  # resnet18 | resnet34 | resnet50 | resnet101 | mobilenet_v3_large
    output_stride: int = 16  # 8 or 16
    pretrained_backbone: str = "none"  # none | imagenet | path to a backbone state dict
    init_checkpoint: str = ""  # segmentation checkpoint to fine-tune from (classifier skipped on mismatch)
    norm: str = "syncbn"  # syncbn | bn | frozen_bn
    aux_loss: bool = False  # auxiliary FCN head on layer3
    aspp_rates: tuple[int, ...] = ()  # () = derived from output_stride (6/12/18 at 16, 12/24/36 at 8)
    head_channels: int = 256  # ASPP / decoder width
    channels_last: bool = False


@dataclass(frozen=True)
class TrainConfig:
    iters: int = 30000
    batch_size: int = 16  # global batch over all devices / processes
    optimizer: str = "sgd"  # sgd | adamw
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-4
    head_lr_mult: float = 10.0
    warmup_iters: int = 0
    poly_power: float = 0.9
    amp: str = "off"  # off | fp16 | bf16
    aux_weight: float = 0.4
    class_weights: tuple[float, ...] = ()  # () = unweighted cross-entropy
    ohem: bool = False
    ohem_thresh: float = 0.7
    ohem_min_kept: int = 100000
    val_interval: int = 1000
    ckpt_interval: int = 1000
    log_interval: int = 20
    num_vis_images: int = 4  # fixed val images drawn as image | truth | prediction in TensorBoard
    seed: int = 0


@dataclass(frozen=True)
class EvalConfig:
    mode: str = "whole"  # whole | slide
    crop_size: int = 513  # sliding window size
    stride: int = 341  # sliding window stride
    scales: tuple[float, ...] = (1.0,)
    flip: bool = False
    batch_size: int = 1


@dataclass(frozen=True)
class Config:
    name: str = "default"
    output_dir: str = ""  # "" = runs/<name>
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir or f"runs/{self.name}")


_SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "eval": EvalConfig}
_CHOICES = {
    "data.dataset": ("voc", "cityscapes", "synthetic", "folder"),
    "model.arch": ("deeplabv3", "deeplabv3plus"),
    "model.backbone": ("resnet18", "resnet34", "resnet50", "resnet101", "mobilenet_v3_large"),
    "model.output_stride": (8, 16),
    "model.norm": ("syncbn", "bn", "frozen_bn"),
    "train.optimizer": ("sgd", "adamw"),
    "train.amp": ("off", "fp16", "bf16"),
    "eval.mode": ("whole", "slide"),
}


def _all_keys() -> list[str]:
    keys = [f.name for f in dataclasses.fields(Config) if f.name not in _SECTIONS]
    for section, cls in _SECTIONS.items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _unknown_key_error(key: str, source: str) -> ValueError:
    close = difflib.get_close_matches(key, _all_keys(), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(_all_keys())}"
    return ValueError(f"{source}: unknown config key '{key}'{hint}")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Convert a YAML or command-line value to the field's declared type."""
    origin = typing.get_origin(annotation)
    fail = ValueError(f"{source}: config key '{key}' expects {_type_name(annotation)}, got {value!r}")
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


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        inner = args[0].__name__ if args else "value"
        return f"a comma-separated list of {inner}"
    return getattr(annotation, "__name__", str(annotation))


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


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML config, merging the `base:` chain under it (base first)."""
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
    base_path = Path(base)
    if not base_path.is_absolute() and (path.parent / base_path).is_file():
        base_path = path.parent / base_path
    merged = _read_yaml(resolve_config_path(base_path), seen + (path,))
    _deep_update(merged, raw)
    return merged


def _deep_update(target: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = value


def _flatten(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _SECTIONS:
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


def build_config(values: Mapping[str, Any], *, source: str = "config", base: Config | None = None) -> Config:
    """Apply flat dotted `values` on top of `base` (defaults when None), converting and validating."""
    current = to_dict(base or Config())
    for key, value in values.items():
        section, _, name = key.partition(".")
        if name:
            if section not in _SECTIONS:
                raise _unknown_key_error(key, source)
            types = _field_types(_SECTIONS[section])
            if name not in types:
                raise _unknown_key_error(key, source)
            current[section][name] = _convert(value, types[name], key, source)
        else:
            types = _field_types(Config)
            if key not in types or key in _SECTIONS:
                raise _unknown_key_error(key, source)
            current[key] = _convert(value, types[key], key, source)
    config = from_dict(current)
    validate(config, source=source)
    return config


def load_config(
    name_or_path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """YAML file (with `base:` chain) then `KEY=VALUE` overrides -> validated Config."""
    config = Config()
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        config = build_config(_flatten(_read_yaml(path), str(path)), source=str(path))
    return build_config(parse_overrides(overrides), source="command line", base=config)


def to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict of primitives (tuples become lists), safe for YAML, JSON and checkpoints."""
    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        return value

    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = {g.name: plain(getattr(value, g.name)) for g in dataclasses.fields(value)}
        else:
            out[f.name] = plain(value)
    return out


def from_dict(raw: Mapping[str, Any], *, source: str = "config") -> Config:
    """Inverse of to_dict; unknown keys raise (so an old checkpoint's config is checked too)."""
    sections = {}
    top = {}
    for key, value in raw.items():
        if key in _SECTIONS:
            cls = _SECTIONS[key]
            types = _field_types(cls)
            kwargs = {}
            for name, sub_value in (value or {}).items():
                if name not in types:
                    raise _unknown_key_error(f"{key}.{name}", source)
                kwargs[name] = _convert(sub_value, types[name], f"{key}.{name}", source)
            sections[key] = cls(**kwargs)
        else:
            types = _field_types(Config)
            if key not in types:
                raise _unknown_key_error(key, source)
            top[key] = _convert(value, types[key], key, source)
    return Config(**top, **sections)


def validate(config: Config, *, source: str = "config") -> None:
    """Range and choice checks; raises ValueError naming the key, the value and what is expected."""
    for key, choices in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value not in choices:
            raise ValueError(f"{source}: {key}={value!r} is not one of {', '.join(map(str, choices))}")
    positive = ["data.crop_size", "train.iters", "train.batch_size", "train.val_interval",
                "train.ckpt_interval", "train.log_interval", "eval.crop_size", "eval.stride", "eval.batch_size"]
    for key in positive:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value <= 0:
            raise ValueError(f"{source}: {key}={value} must be > 0")
    low, high = config.data.scale_range
    if not 0 < low <= high:
        raise ValueError(f"{source}: data.scale_range={low},{high} must satisfy 0 < low <= high")
    if config.train.lr <= 0:
        raise ValueError(f"{source}: train.lr={config.train.lr} must be > 0")
    if not config.eval.scales or any(s <= 0 for s in config.eval.scales):
        raise ValueError(f"{source}: eval.scales={config.eval.scales} must be a non-empty list of positive numbers")
    if config.data.num_workers < 0:
        raise ValueError(f"{source}: data.num_workers={config.data.num_workers} must be >= 0")
    if config.data.class_names and config.data.num_classes and len(config.data.class_names) != config.data.num_classes:
        raise ValueError(
            f"{source}: data.class_names has {len(config.data.class_names)} names but "
            f"data.num_classes={config.data.num_classes}"
        )


def inference_config(
    saved: Mapping[str, Any],
    overrides: list[str] | tuple[str, ...] = (),
    *,
    source: str,
    mode: str | None = None,
    scales: str | tuple[float, ...] | None = None,
    flip: bool | None = None,
) -> Config:
    """A checkpoint's stored config for inference: then KEY=VALUE overrides, then the CLI flags.

    The weights come from the checkpoint, so backbone and init weights are never read again.
    """
    values: dict[str, Any] = {"model.pretrained_backbone": "none", "model.init_checkpoint": ""}
    values.update(parse_overrides(overrides))
    for key, value in (("eval.mode", mode), ("eval.scales", scales), ("eval.flip", flip)):
        if value is not None:
            values[key] = value
    return build_config(values, source="command line", base=from_dict(saved, source=source))


def save_config(config: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
