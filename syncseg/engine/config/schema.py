"""The configuration schema: frozen dataclasses, and the one place every allowed value and limit is stated.

Fixed choices are `Literal` annotations; the values of an extension point (data.dataset, model.backbone,
model.arch, model.norm, train.loss's names) are its registry's (syncseg/lazy_registry.py), checked when a config
is validated, so a kind registered by the user's code is accepted; numeric limits are `Limit`s attached to
their fields; rules that involve several fields are in `validate()` (the data section's, which depend on
the data set kind, in syncseg/engine/config/data_rules.py). Builders and datasets receive validated
sections and do not check them again. Reading YAML, the `base:` chain, command-line overrides and the dict round trip
live in syncseg/engine/config/io.py.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

# light modules only (plain Python): importing the schema imports neither torch nor cv2 nor albumentations
from syncseg.data.constants import (IGNORE_INDEX, IMAGENET_MEAN, IMAGENET_STD, MAX_8BIT, MAX_16BIT, MAX_CHANNELS,
                                    RGB_CHANNELS, LabelTarget, height_width)
from syncseg.data.registry import DATASET_KINDS
from syncseg.engine.config.data_rules import check_data_for_its_kind
from syncseg.engine.config.fields import (ColourToClass, Limit, PixelSize, ValueToClass, WeightedTerms,
                                          limited as _limited, registered as _registered)
from syncseg.engine.object_store import cache_root, is_url, local_name
from syncseg.engine.registry import LOSS_TERMS
from syncseg.layout import config_dir
from syncseg.model.registry import BACKBONES, HEADS, NORMS

CONFIG_DIR = config_dir()

# autocast for training (train.amp) and inference (eval.amp); auto: by the device's capability
# (syncseg.engine.devices.resolve_precision: bf16 where native, fp16 + GradScaler on other GPUs, else fp32);
# off: full fp32 (no TF32 on CUDA); tf32: fp32 tensors with TF32 matmuls and convolutions on Ampere and later
Precision = Literal["auto", "off", "tf32", "fp16", "bf16"]


LabelMap = Annotated[tuple[tuple[int, LabelTarget], ...], ValueToClass()]
ClassColors = Annotated[tuple[tuple[tuple[int, int, int], LabelTarget], ...], ColourToClass()]
LossTerms = Annotated[tuple[tuple[str, float], ...], WeightedTerms()]  # names: syncseg.engine.registry.LOSS_TERMS


_POSITIVE = Limit(ge=1)
_NON_NEGATIVE = Limit(ge=0)
_LABEL = Limit(ge=0, le=255)  # masks are 8-bit PNGs


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _registered("synthetic", DATASET_KINDS)  # a kind of syncseg.data.registry
    root: str = ""  # dataset root folder (unused by synthetic)
    # voc: train | train_aug; cityscapes: train; ade20k: training (= train); folder: a list-file stem or "all"
    train_split: str = "train"
    val_split: str = "val"  # ade20k: validation (= val)
    crop_size: PixelSize = _limited((513, 513), _POSITIVE)  # training crop H,W (one int: square), pixels
    scale_range: tuple[float, float] = _limited((0.5, 2.0), Limit(gt=0))  # random rescale factors, low <= high
    base_size: int = _limited(0, _NON_NEGATIVE)  # eval: resize the long side to this many pixels (0 = as is)
    hflip: bool = True
    # random rotations by 0/90/180/270 degrees (with hflip: all 8 symmetries of a square) for images with no
    # "up" (overhead, microscope); needs a square crop_size
    rot90: bool = False
    photometric: bool = False  # colour jitter + blur during training
    num_workers: int = _limited(4, _NON_NEGATIVE)
    ignore_index: int = _limited(IGNORE_INDEX, _LABEL)  # mask value that no loss or metric counts
    # class count of a kind without a class list of its own (folder: required; synthetic: 2..8); 0 = its default
    num_classes: int = _limited(0, _LABEL)
    # folder: optional names, len == num_classes; annotation kinds: the class list (else the export's own)
    class_names: tuple[str, ...] = ()
    skip_bad_samples: bool = False  # warn and skip unreadable / inconsistent samples instead of raising
    # mask encodings (docs/own-data.md); every file-backed dataset reads its masks through one table
    label_map: LabelMap = ()  # raw mask value -> class index or ignore, over the dataset's own reading
    reduce_zero_label: bool = False  # folder: raw 0 is ignored and raw k is class k-1 (ADE-style masks)
    class_colors: ClassColors = ()  # colour-coded masks: RGB colour -> class index or ignore
    # labels as annotation tools export them (data.dataset coco | labelme | cvat | yolo_seg | label_studio;
    # docs/own-data.md): the export's file or folder under data.root ("" = found by split name; set, splits are
    # "all" or <split>.txt lists of image names), what pixels no shape covers are, the label names that mark
    # ignored regions, COCO's iscrowd regions, and the width of lines in pixels
    annotations: str = ""
    uncovered: Literal["background", "ignore"] = "background"
    ignore_labels: tuple[str, ...] = ("__ignore__",)
    iscrowd: Literal["ignore", "category"] = "ignore"
    line_width: float = _limited(10.0, Limit(gt=0))
    # images beyond 8-bit RGB (data/images.py; folder datasets): channels per pixel, and the value of full
    # scale, which also says the bit depth: up to 255 the files are 8-bit, above it 16-bit (4095: 12-bit data)
    in_channels: int = _limited(RGB_CHANNELS, Limit(ge=1, le=MAX_CHANNELS))
    max_value: int = _limited(MAX_8BIT, Limit(ge=1, le=MAX_16BIT))
    # one value per channel in units of the full scale, (x / max_value - mean) / std on the device
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = _limited(IMAGENET_STD, Limit(gt=0))
    # synthetic dataset
    synthetic_image_size: int = _limited(128, Limit(ge=16))  # smaller leaves shapes of a few pixels
    synthetic_train_size: int = _limited(2000, _POSITIVE)  # number of training images
    synthetic_val_size: int = _limited(100, _POSITIVE)
    # georeferenced scenes (data.dataset=raster, syncseg/data/raster): image rasters and their label rasters or
    # vector files (one per scene, or one for all) under data.root, the vector attribute that is the class,
    # the validation region (a vector file or "minx,miny,maxx,maxy"; "" = each scene's bottom fifth), the random
    # training chips per epoch, and the factor that takes a float raster's values to 0..data.max_value; entries
    # of scenes and labels may be glob patterns (tiles/*.tif), paired in sorted order
    scenes: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    label_attribute: str = "class"
    val_region: str = ""
    chips_per_epoch: int = _limited(2000, _POSITIVE)
    raster_scale: float = _limited(0.0, _NON_NEGATIVE)
    seed: int = 0  # synthetic generator seed (train and val use disjoint streams); raster: the chips' draws


@dataclass(frozen=True)
class ModelConfig:
    arch: str = _registered("deeplabv3plus", HEADS)  # syncseg.model.registry.HEADS
    # torchvision backbones, or timm:<name> for a timm encoder (model/timm_encoder.py checks the name)
    backbone: str = _registered("resnet50", BACKBONES)
    output_stride: Literal[8, 16, 32] = 16
    pretrained_backbone: str = "none"  # none | imagenet | path to a backbone state dict
    init_checkpoint: str = ""  # segmentation checkpoint to fine-tune from (classifier skipped on mismatch)
    norm: str = _registered("syncbn", NORMS)  # syncseg.model.registry.NORMS
    # under torchrun/srun, synchronized BatchNorm reduces within groups of this many consecutive ranks (e.g.
    # one node's GPUs); 0 = over all processes. The world size must be a multiple (syncseg.engine.distributed)
    syncbn_group_size: int = _limited(0, _NON_NEGATIVE)
    aux_loss: bool = False  # auxiliary FCN head on layer3
    aspp_rates: tuple[int, ...] = _limited((), _POSITIVE)  # () = from output_stride (6/12/18 at 16, 12/24/36 at 8)
    head_channels: int = _limited(256, _POSITIVE)  # ASPP / decoder width
    # dropout after the ASPP projection (DeepLab's and torchvision's 0.5); short runs from scratch learn
    # faster without it (the demo: val mIoU 0.26 -> 0.38 after 375 iterations)
    aspp_dropout: float = _limited(0.5, Limit(ge=0, le=0.9))
    # memory layout of activations: auto = channels-last when train.amp runs as bf16 or fp16 on the device,
    # whose kernels want it (AMX: the demo's bf16 step took 2x as long without it), the usual layout in fp32
    # (AVX2 kernels lost ~15% with channels-last); eval.py/predict.py resolve it the same way, so they
    # reproduce training's validation
    channels_last: Literal["auto", True, False] = "auto"


@dataclass(frozen=True)
class TrainConfig:
    iters: int = _limited(30000, _POSITIVE)
    batch_size: int = _limited(16, _POSITIVE)  # global batch per optimizer step, over all devices / processes
    accumulate: int = _limited(1, _POSITIVE)  # micro-batches per optimizer step (gradient accumulation)
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = _limited(0.01, Limit(gt=0))
    momentum: float = _limited(0.9, _NON_NEGATIVE)
    weight_decay: float = _limited(1e-4, _NON_NEGATIVE)
    head_lr_mult: float = _limited(10.0, _NON_NEGATIVE)
    warmup_iters: int = _limited(0, _NON_NEGATIVE)
    poly_power: float = _limited(0.9, _NON_NEGATIVE)
    amp: Precision = "auto"
    compile: bool = False  # torch.compile the model for training (one process per device; docs/training.md)
    aux_weight: float = _limited(0.4, _NON_NEGATIVE)
    # weighted sum of syncseg.engine.registry.LOSS_TERMS, each normalized over the global batch
    # (syncseg/engine/loss.py), on every head
    loss: LossTerms = (("ce", 1.0),)
    focal_gamma: float = _limited(2.0, _NON_NEGATIVE)  # focal: (1 - p)^gamma down-weights easy pixels
    class_weights: tuple[float, ...] = _limited((), _NON_NEGATIVE)  # () = unweighted; weigh ce and focal
    ohem: bool = False
    ohem_thresh: float = _limited(0.7, Limit(gt=0, le=1))
    ohem_min_kept: int = _limited(100000, _NON_NEGATIVE)
    val_interval: int = _limited(1000, _POSITIVE)
    ckpt_interval: int = _limited(1000, _POSITIVE)
    log_interval: int = _limited(20, _POSITIVE)
    num_vis_images: int = _limited(4, _NON_NEGATIVE)  # fixed val images drawn as image | truth | prediction
    seed: int = 0
    # exponential moving average of the weights, updated every step: w_ema = d * w_ema + (1 - d) * w; 0 = off.
    # When on, validation and best.pt use the averaged weights.
    ema_decay: float = _limited(0.0, Limit(ge=0, lt=1))
    # recompute BatchNorm running statistics as population statistics over this many training
    # micro-batches before each validation and at the end (PreciseBN); 0 = off. At most 10000: even
    # one-image micro-batches then reach the 10^3-10^4 images population statistics need (fvcore's
    # default is 200 batches), while a slip of the keyboard (1000000) would run for hours per validation.
    precise_bn_batches: int = _limited(0, Limit(ge=0, le=10_000))


@dataclass(frozen=True)
class EvalConfig:
    mode: Literal["whole", "slide"] = "whole"
    window_size: PixelSize = _limited((513, 513), _POSITIVE)  # slide: window H,W (one int: square), pixels
    stride: PixelSize = _limited((341, 341), _POSITIVE)  # slide: window step H,W, <= window_size on each axis
    scales: tuple[float, ...] = _limited((1.0,), Limit(gt=0))
    flip: bool = False
    batch_size: int = _limited(1, _POSITIVE)
    window_batch: int = _limited(8, _POSITIVE)  # slide: images (windows) per forward pass, flips included
    amp: Precision = "auto"  # autocast for validation, eval.py and predict.py


@dataclass(frozen=True)
class DistConfig:
    # seconds a collective (and the process-group rendezvous) waits for the other processes before the
    # run stops: a hung or vanished peer ends every rank within this bound; a checkpoint save or a
    # validation pass must fit in it
    timeout_s: float = _limited(300.0, Limit(gt=0))


LOGGERS = ("tensorboard", "mlflow", "wandb")  # log.loggers' names (syncseg/engine/trackers.py)


@dataclass(frozen=True)
class LogConfig:
    # where a run's records go besides metrics.jsonl (always written), rank 0 only: any of LOGGERS
    loggers: tuple[str, ...] = ("tensorboard",)
    # MLflow's tracking URI: "" = a SQLite store in the run dir (run_dir/mlflow.db, no server); else the
    # server's http(s):// address or another store URI (sqlite:///..., postgresql://..., databricks)
    mlflow_uri: str = ""
    mlflow_experiment: str = ""  # "" = the config's name
    mlflow_checkpoint: bool = False  # upload best.pt as an artifact of the MLflow run when training ends
    wandb_project: str = ""  # "" = syncseg; offline unless WANDB_MODE says otherwise (docs/training.md)
    wandb_entity: str = ""  # "" = the W&B default entity
    # seconds a tracker may take to start (a server that does not answer) and to send what is queued at the end
    timeout_s: float = _limited(30.0, Limit(gt=0))


@dataclass(frozen=True)
class Config:
    name: str = "default"
    output_dir: str = ""  # "" = runs/<name>; a URL (s3://bucket/runs/x) is staged locally and uploaded
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def run_dir(self) -> Path:
        """The local folder training writes: output_dir, runs/<name>, or for a URL its staging folder
        (syncseg.engine.remote_run_dir)."""
        if self.run_url:
            return cache_root() / "runs" / local_name(self.run_url)
        return Path(self.output_dir or f"runs/{self.name}")

    @property
    def run_url(self) -> str:
        """output_dir when it is an object-store URL, else ""."""
        return self.output_dir.rstrip("/") if is_url(self.output_dir) else ""


SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "eval": EvalConfig,
                             "dist": DistConfig,
                             "log": LogConfig}


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> annotation, with `Annotated` markers kept (syncseg.engine.config.io converts by them)."""
    return typing.get_type_hints(cls, include_extras=True)


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def all_keys() -> list[str]:
    """Every dotted key: top-level names, then `section.name` for each section."""
    keys = [f.name for f in dataclasses.fields(Config) if f.name not in SECTIONS]
    for section, cls in SECTIONS.items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def choices(key: str) -> tuple[Any, ...]:
    """The allowed values of a dotted key with a Literal type or a registry (its registered names, now),
    e.g. choices("model.backbone")."""
    section, _, name = key.partition(".")
    registry = {item.name: item for item in dataclasses.fields(SECTIONS[section])}[name].metadata.get("registry")
    if registry is not None:
        return registry.names()
    annotation = field_types(SECTIONS[section])[name]
    if typing.get_origin(annotation) is not Literal:
        raise KeyError(f"config key {key} has no fixed choices")
    return typing.get_args(annotation)


def _floats(value: Any) -> list[float]:
    """Every float in a field's value, nested tuples (train.loss's (name, weight) pairs) included."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, tuple):
        return [number for element in value for number in _floats(element)]
    return []


def _check_fields(section_name: str, section: Any, source: str) -> None:
    types = field_types(type(section))
    for item in dataclasses.fields(section):
        key, value, annotation = f"{section_name}.{item.name}", getattr(section, item.name), types[item.name]
        registry = item.metadata.get("registry")
        if registry is not None and value not in registry:
            raise ValueError(f"{source}: {registry.unknown(value)}")
        if typing.get_origin(annotation) is Literal and value not in typing.get_args(annotation):
            allowed = ", ".join(map(str, typing.get_args(annotation)))
            raise ValueError(f"{source}: {key}={value!r} is not one of {allowed}")
        if not all(math.isfinite(number) for number in _floats(value)):
            # NaN compares false with every limit, and an infinity is no setting: neither may pass
            raise ValueError(f"{source}: {key}={_shown(value)}: every number must be finite (not nan or inf)")
        limit = item.metadata.get("limit")
        values = value if isinstance(value, tuple) else (value,)
        if limit is not None and any(limit.violated_by(v) for v in values):
            each = "every value " if isinstance(value, tuple) else ""
            raise ValueError(f"{source}: {key}={_shown(value)}: {each}must be {limit.describe()}")


def validate(config: Config, *, source: str = "config") -> None:
    """Choice, range and cross-field checks; ValueError naming the key, the value and what is expected."""
    for section_name in SECTIONS:
        _check_fields(section_name, getattr(config, section_name), source)
    data, evaluation = config.data, config.eval
    low, high = data.scale_range
    if low > high:
        raise ValueError(f"{source}: data.scale_range={low},{high} must satisfy low <= high")
    crop = height_width(data.crop_size)
    if data.rot90 and crop[0] != crop[1]:
        raise ValueError(f"{source}: data.rot90 with data.crop_size={_shown(crop)} (height,width): a rotation by 90 "
                         "degrees swaps height and width, so the crops of a batch would differ; use a square "
                         f"crop (e.g. data.crop_size={min(crop)}) or data.rot90=false")
    if not evaluation.scales:
        raise ValueError(f"{source}: eval.scales is empty; give at least one test scale (e.g. 1.0)")
    stride, window = height_width(evaluation.stride), height_width(evaluation.window_size)
    if evaluation.mode == "slide" and any(step > size for step, size in zip(stride, window)):
        raise ValueError(f"{source}: eval.stride={_shown(stride)} > eval.window_size={_shown(window)} (height,width) "
                         "would leave pixels between the sliding windows uncovered; use a stride <= the window "
                         "on both axes")
    train = config.train
    if train.accumulate > train.batch_size:
        raise ValueError(f"{source}: train.accumulate={train.accumulate} > train.batch_size={train.batch_size}: the "
                         "global batch is split into train.accumulate micro-batches of at least one sample each")
    if train.accumulate > 1 and train.ohem:
        raise ValueError(f"{source}: train.ohem with train.accumulate={train.accumulate}: OHEM picks its pixels and "
                         "its normalizer from each forward pass, so the accumulated gradient would not be the global "
                         "batch's; use train.accumulate=1 (a smaller train.batch_size) or train.ohem=false")
    check_data_for_its_kind(data, source)
    _check_loss(train, source)
    _check_log(config.log, source)


def _check_log(log: LogConfig, source: str) -> None:
    for name in log.loggers:
        if name not in LOGGERS:
            raise ValueError(f"{source}: log.loggers names '{name}', which is not one of {', '.join(LOGGERS)}")
        if log.loggers.count(name) > 1:
            raise ValueError(f"{source}: log.loggers lists '{name}' twice")
    for key, value, logger in (("mlflow_uri", log.mlflow_uri, "mlflow"), ("mlflow_experiment", log.mlflow_experiment,
                               "mlflow"), ("mlflow_checkpoint", log.mlflow_checkpoint, "mlflow"), ("wandb_project", log.wandb_project, "wandb"),
                               ("wandb_entity", log.wandb_entity, "wandb")):
        if value and logger not in log.loggers:
            raise ValueError(f"{source}: log.{key}={value} is set but log.loggers ({','.join(log.loggers) or 'empty'}) "
                             f"does not name {logger}; add it (log.loggers={','.join(log.loggers + (logger,))})")


def _check_loss(train: TrainConfig, source: str) -> None:
    names = [name for name, _ in train.loss]
    if not names:
        raise ValueError(f"{source}: train.loss is empty; give at least one of {LOSS_TERMS.describe()} "
                         "(e.g. train.loss=ce:1)")
    for name, weight in train.loss:
        if name not in LOSS_TERMS:
            raise ValueError(f"{source}: train.loss names '{name}', which is not one of {LOSS_TERMS.describe()}"
                             f"{LOSS_TERMS.suggestion(name)}")
        if names.count(name) > 1:
            raise ValueError(f"{source}: train.loss lists '{name}' twice; give each loss once, with its weight")
        if not weight > 0:
            raise ValueError(f"{source}: train.loss gives '{name}' the weight {weight:g}; expected a weight > 0 "
                             "(leave out a loss to turn it off)")
    if train.ohem and "ce" not in names:
        raise ValueError(f"{source}: train.ohem selects the hard pixels of the ce loss, but train.loss "
                         f"({','.join(names)}) has no ce; add ce or set train.ohem=false")
    weighing = [name for name, term in LOSS_TERMS.items() if term.weighs_classes]
    if train.class_weights and not set(weighing) & set(names):
        raise ValueError(f"{source}: train.class_weights weigh the {' and '.join(weighing)} losses, but train.loss "
                         f"({','.join(names)}) has none of them; add one or leave train.class_weights empty")
