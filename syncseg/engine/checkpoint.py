"""Checkpoints: the only place that calls torch.save / torch.load, and loading one into a model on a device.

A checkpoint is a dict of primitives and tensors (docs/design.md): `format_version`, `model` (unwrapped
state dict), `config` (syncseg.engine.config.to_dict), `classes`, `iteration`, `epoch`, `best_miou`,
`run_id`, and in last.pt also what a resume needs (`optimizer`, `scheduler`, `scaler`, `rng`,
`overrides`). best.pt is the file people keep and share: `WEIGHTS_KEYS` plus the validation
`metrics` that made it the best, no optimizer state (a third of last.pt with AdamW, whose two
moments are each as large as the weights). It loads with `weights_only=True`, so no pickled classes.
Files are written atomically (syncseg.engine.atomic: a temporary file in the same folder, fsync, os.replace), so an
existing checkpoint is either the old one or the new one, never half-written; they get the mode a
plain `open()` would give (0644 under umask 022), so teammates on a shared cluster can read them.
A `.safetensors` file written by `scripts/export.py --format safetensors` loads here too.

`Checkpointer` writes a training run's checkpoints (the non-finite check, every process's RNG state,
the best.pt subset) and restores the RNG state; syncseg.engine.trainer.Trainer.state_dict / load_state_dict
are the rest of the pair. `load_inference_model` is what eval.py and predict.py share: checkpoint -> config (with overrides and
CLI flags) -> model with the weights, on a device, in eval mode. `init_from_weights` is fine-tuning's
(model.init_checkpoint): a syncseg checkpoint or a plain state dict such as torchvision's
segmentation weights, the classifier skipped when the class count differs.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from syncseg.engine.atomic import write_atomically
from syncseg.engine.config import Config, from_dict, inference_config
from syncseg.engine.devices import resolve_channels_last
from syncseg.engine.distributed import DistInfo, all_reduce_sum, barrier, is_dist
from syncseg.engine.seeding import capture_rng_state, restore_rng_state
from syncseg.model.backbones import unwrap_state_dict
from syncseg.model.builder import LoadedWeights, build_model, load_segmentation_weights, state_dict_problems

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
# What eval.py / predict.py / fine-tuning need; a training resume also needs optimizer etc. and
# asks for them with `required_keys=`.
REQUIRED_KEYS = ("format_version", "model", "config", "classes")
RESUME_KEYS = REQUIRED_KEYS + ("iteration", "epoch", "best_miou", "optimizer", "scheduler", "scaler", "rng")
# What best.pt keeps of a training payload (plus `metrics`): everything but the resume state.
WEIGHTS_KEYS = REQUIRED_KEYS + ("iteration", "epoch", "best_miou", "run_id")
SAFETENSORS_SUFFIX = ".safetensors"
# .safetensors metadata entries (each a JSON string) that become payload keys
SAFETENSORS_METADATA = ("format_version", "config", "classes", "iteration", "best_miou", "metrics", "run_id")

def is_safetensors_name(path: str | Path) -> bool:
    """Whether `path` is read as a .safetensors release file: the suffix, exactly SAFETENSORS_SUFFIX,
    is what tells the formats apart (load_checkpoint, peek_checkpoint, load_weights_file), so
    save_safetensors writes only under such a name."""
    return Path(path).suffix == SAFETENSORS_SUFFIX


_PLAIN_TYPES = (type(None), bool, int, float, str, bytes, torch.Tensor, torch.Size, torch.dtype, torch.device)


def _check_plain(value: Any, where: str) -> None:
    """Raise ValueError if `value` holds anything `torch.load(weights_only=True)` would refuse."""
    if isinstance(value, _PLAIN_TYPES):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise ValueError(f"checkpoint payload: key {key!r} at {where} must be a str or int")
            _check_plain(item, f"{where}.{key}")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    raise ValueError(
        f"checkpoint payload: {where} is a {type(value).__module__}.{type(value).__qualname__}; only "
        "primitives, tensors, lists, tuples and dicts load with weights_only=True (convert it first, "
        "e.g. numpy arrays with torch.from_numpy, dataclasses with syncseg.engine.config.to_dict)"
    )


def weights_payload(payload: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The best.pt subset of a training payload: WEIGHTS_KEYS (those present) and `metrics`."""
    small = {key: payload[key] for key in WEIGHTS_KEYS if key in payload}
    if metrics is not None:
        small["metrics"] = dict(metrics)
    return small


def save_checkpoint(path: str | Path, payload: Mapping[str, Any]) -> None:
    """Write `payload` to `path` with torch.save, atomically (`write_atomically`: the previous file stays
    whole on any failure, and a full disk is an OSError naming the file).

    Raises ValueError, before writing anything, when the payload holds an object that would not load
    with weights_only=True.
    """
    _check_plain(dict(payload), "payload")
    write_atomically(path, lambda file: torch.save(dict(payload), file))


def _read(path: Path, what: str) -> Any:
    """torch.load with weights_only=True, or a .safetensors release file read as a payload."""
    is_safetensors = is_safetensors_name(path)
    if is_safetensors and importlib.util.find_spec("safetensors") is None:
        raise ValueError(f"reading '{path}' needs the safetensors package (pip install -r requirements.txt)")
    try:
        if is_safetensors:
            return _load_safetensors(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip, safetensors and torch errors all mean the same thing here
        raise ValueError(
            f"{what} '{path}' could not be read ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "it is truncated, corrupt, or not a file written by torch.save or safetensors"
        ) from None


def load_checkpoint(path: str | Path, *, required_keys: Iterable[str] = REQUIRED_KEYS) -> dict[str, Any]:
    """Load a checkpoint on the CPU with weights_only=True and check its format.

    Raises FileNotFoundError when `path` does not exist, ValueError naming the file when it is not a
    readable checkpoint, lacks one of `required_keys`, or has a newer `format_version` than this code.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint '{path}' not found (expected a .pt file written by train.py)")
    payload = _read(path, "checkpoint")
    if not isinstance(payload, dict):
        raise ValueError(f"checkpoint '{path}' holds a {type(payload).__name__}, expected a dict with keys "
                         f"{', '.join(REQUIRED_KEYS)}")
    missing = [key for key in required_keys if key not in payload]
    if missing:
        hint = ""
        if "model" in payload and "optimizer" in missing:
            hint = "; it holds weights only (like best.pt): resume from the run's last.pt"
        raise ValueError(f"checkpoint '{path}' lacks required key(s) {', '.join(missing)} "
                         f"(has: {', '.join(map(str, payload))}){hint}")
    version = payload.get("format_version")
    if version is not None and (not isinstance(version, int) or version > FORMAT_VERSION):
        raise ValueError(f"checkpoint '{path}' has format_version={version!r}; this code reads versions "
                         f"<= {FORMAT_VERSION} (update syncseg)")
    return payload


def _load_safetensors(path: Path) -> dict[str, Any]:
    """A payload from a .safetensors release file: its tensors are `model`, its metadata the rest (JSON)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as file:
        metadata = file.metadata() or {}
        state = {key: file.get_tensor(key) for key in file.keys()}
    payload = {key: json.loads(value) for key, value in metadata.items() if key in SAFETENSORS_METADATA}
    payload["model"] = state
    return payload


def save_safetensors(path: str | Path, payload: Mapping[str, Any]) -> None:
    """Write a payload's `model` as a .safetensors file with SAFETENSORS_METADATA as JSON metadata
    (atomically, with the umask's mode, like save_checkpoint). Raises ValueError, before writing
    anything, without safetensors or when `path` does not end in SAFETENSORS_SUFFIX (the loaders would
    take the file for a torch.save checkpoint and fail on it)."""
    if not is_safetensors_name(path):
        raise ValueError(f"'{path}': a safetensors file must be named *{SAFETENSORS_SUFFIX}, the suffix by which "
                         "eval.py, predict.py and model.init_checkpoint know it (e.g. "
                         f"'{Path(path).with_suffix(SAFETENSORS_SUFFIX)}')")
    try:
        from safetensors.torch import save
    except ImportError:
        raise ValueError("writing .safetensors needs the safetensors package (pip install -r requirements.txt)") from None
    metadata = {key: json.dumps(payload[key]) for key in SAFETENSORS_METADATA if key in payload}
    tensors = {key: value.detach().cpu().contiguous() for key, value in payload["model"].items()}
    # serialized in memory (one copy of the weights) so that the file is written by write_atomically
    write_atomically(path, lambda file: file.write(save(tensors, metadata=metadata)), what="safetensors file")


def load_weights_file(path: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """The model weights in `path` for fine-tuning, and what kind of file it was.

    Accepts a syncseg checkpoint (best.pt / last.pt: its `model`), a plain state dict (torchvision's
    segmentation weights such as deeplabv3_resnet101_coco-586e9e4e.pth), or a state dict wrapped as
    {"state_dict": ...} or {"model": ...}; a `module.` prefix on every key is stripped later
    (syncseg.model.builder.load_segmentation_weights). Raises FileNotFoundError naming the file and where such
    files come from, ValueError when it is unreadable or holds no state dict.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"model.init_checkpoint: weights file '{path}' not found; give a best.pt / last.pt of a syncseg run or "
            "a segmentation state dict such as torchvision's deeplabv3_resnet101_coco-586e9e4e.pth (nothing is "
            "downloaded: fetch it on a machine with network access and copy it to that path)")
    loaded = _read(path, "model.init_checkpoint weights file")
    state_dict, where = unwrap_state_dict(loaded)  # the one unwrap, shared with backbone weight files
    if state_dict is None:
        raise ValueError(f"model.init_checkpoint '{path}' holds no state dict (a mapping of names to tensors, "
                         "possibly under 'model' or 'state_dict')")
    if where == "model" and "format_version" in loaded:
        return state_dict, f"a syncseg checkpoint, iteration {loaded.get('iteration', '?')}"
    return state_dict, f"a state dict under '{where}'" if where else "a plain state dict"


def init_from_weights(model: nn.Module, path: str | Path, *, model_cfg: Any) -> LoadedWeights:
    """Fine-tuning: load `path` (see load_weights_file) into `model`, built from `model_cfg`, and log
    which keys were loaded, skipped (the classifier of another class count) and left fresh. Raises one
    ValueError naming the file and both architectures when the weights do not fit."""
    state_dict, kind = load_weights_file(path)
    try:
        report = load_segmentation_weights(model, state_dict)
    except ValueError as error:
        raise ValueError(f"model.init_checkpoint '{path}' ({kind}) does not fit the model "
                         f"[{describe_architecture(model_cfg)}]: {error}") from None
    logger.info("model.init_checkpoint '%s' (%s): %s", path, kind, report.summary())
    return report


def peek_checkpoint(path: str | Path) -> dict[str, Any] | None:
    """The small entries (iteration, best_miou, run_id, ..., and the config) of a checkpoint, read
    without loading its tensors (memory-mapped); None when the file is missing or unreadable."""
    try:
        if is_safetensors_name(path):
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as file:
                payload = {key: json.loads(value) for key, value in (file.metadata() or {}).items()
                           if key in SAFETENSORS_METADATA}
        else:
            payload = torch.load(Path(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # missing, partial or foreign: nothing to learn from it
        return None
    if not isinstance(payload, dict):
        return None
    small = {key: value for key, value in payload.items() if isinstance(value, (int, float, str, type(None)))}
    if isinstance(payload.get("config"), dict):
        small["config"] = payload["config"]
    return small


def first_non_finite(state: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding inf or nan, or None."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def non_finite_error(what: str, *, iteration: int, run_dir: Path) -> FloatingPointError:
    """The error that stops training at a non-finite loss or tensor (`what`), saving nothing."""
    return FloatingPointError(
        f"non-finite {what} at iteration {iteration}; stopping without saving. The last good checkpoint "
        f"({run_dir / 'last.pt'}) was left untouched; lower train.lr, try train.amp=off, or check the data")


class Checkpointer:
    """Writes a training run's last.pt / best.pt into `run_dir` (rank 0 writes; every process calls `save`,
    which gathers the RNG states) and restores this process's RNG state from one."""

    def __init__(self, run_dir: Path, dist_info: DistInfo) -> None:
        self.run_dir, self.dist = Path(run_dir), dist_info

    def save(self, names: Iterable[str], state: Mapping[str, Any], *, best_metrics: Mapping[str, Any] | None,
             weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write run_dir/<name> for each name: last.pt gets `state` (syncseg.engine.trainer.Trainer.state_dict) plus
        every process's RNG state; best.pt `weights_payload(state, metrics=best_metrics)` with `weights`
        (e.g. the averaged ones) as its model when given.

        Raises FloatingPointError, before writing, when a tensor of state["model"] is not finite on any
        process: the previous checkpoint stays the last good one.
        """
        names = list(names)
        bad = first_non_finite(state["model"])
        flag = torch.tensor([0.0 if bad is None else 1.0], device=self.dist.device)
        all_reduce_sum(flag)
        if flag.item() > 0:
            where = f"tensor {bad}" if bad is not None else "a tensor of another process"
            raise non_finite_error(where, iteration=int(state["iteration"]), run_dir=self.run_dir)
        rng_states: list[Any] = [capture_rng_state()]
        if is_dist():
            rng_states = [None] * self.dist.world_size
            torch.distributed.all_gather_object(rng_states, capture_rng_state())
        if self.dist.is_main:
            payload = {**state, "rng": {"per_rank": rng_states}}
            for name in names:
                shared = payload if weights is None else {**payload, "model": weights}
                save_checkpoint(self.run_dir / name, weights_payload(shared, metrics=best_metrics)
                                if name == "best.pt" else payload)
            logger.info("saved %s at iteration %d", " and ".join(names), state["iteration"])
        barrier()

    def restore_rng(self, rng: Mapping[str, Any], *, reseed: int) -> None:
        """This process's RNG state from a checkpoint's `rng`; when it was saved by a different number of
        processes, torch is seeded with `reseed` instead (with a warning)."""
        states = rng.get("per_rank") or []
        if len(states) == self.dist.world_size:
            restore_rng_state(states[self.dist.rank])
        else:
            logger.warning("checkpoint RNG states are for %d process(es), this run has %d: reseeding",
                           len(states), self.dist.world_size)
            torch.manual_seed(reseed)


def describe_architecture(model_cfg: Any) -> str:
    """The model.* settings that decide the state dict's keys and shapes, as KEY=VALUE text."""
    return (f"model.arch={model_cfg.arch} model.backbone={model_cfg.backbone} "
            f"model.output_stride={model_cfg.output_stride} model.head_channels={model_cfg.head_channels} "
            f"model.aux_loss={model_cfg.aux_loss}")


def load_model_weights(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, checkpoint: str | Path,
                       saved_model_cfg: Any, model_cfg: Any) -> None:
    """Load every tensor of a checkpoint's `model` strictly (evaluation / prediction, not fine-tuning).

    Raises one ValueError naming the checkpoint, the architecture it was trained with
    (`saved_model_cfg`) and the one asked for (`model_cfg`), and the first missing / unexpected /
    mis-shaped tensor, instead of load_state_dict's multi-line shape traceback.
    """
    expected = model.state_dict()
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    shapes = [f"{key}: checkpoint {tuple(state_dict[key].shape)} vs model {tuple(value.shape)}"
              for key, value in expected.items() if key in state_dict and state_dict[key].shape != value.shape]
    if missing or unexpected or shapes:
        problems = state_dict_problems(missing, unexpected, shapes)
        raise ValueError(
            f"checkpoint '{checkpoint}' does not fit the model: it was trained as "
            f"[{describe_architecture(saved_model_cfg)}], the config asks for [{describe_architecture(model_cfg)}]: "
            f"{'; '.join(problems)}; drop the model.* overrides"
        )
    model.load_state_dict(state_dict, strict=True)


@dataclass
class InferenceModel:
    """A checkpoint's model ready for inference (eval mode, on `device`) and what describes it."""

    model: nn.Module
    config: Config  # the checkpoint's config with the overrides and flags applied
    classes: list[str]
    iteration: int | None
    path: Path
    device: torch.device


def load_inference_model(path: str | Path, *, device: torch.device, overrides: list[str] | tuple[str, ...] = (),
                         flags: Mapping[str, Any] | None = None) -> InferenceModel:
    """Load checkpoint `path` (best.pt or last.pt) for evaluation or prediction on `device`.

    The model is rebuilt from the stored config; `overrides` (KEY=VALUE) and `flags` ({"eval.mode":
    ...}, None values ignored) apply on top. Raises FileNotFoundError / ValueError with one line
    naming the file, the key or the mismatching tensor.
    """
    path = Path(path)
    payload = load_checkpoint(path)
    source = f"checkpoint '{path}'"
    config = inference_config(payload["config"], overrides, source=source, flags=flags)
    classes = [str(name) for name in payload["classes"]]
    # the layout training resolved on this kind of device (from train.amp), so validation numbers reproduce
    channels_last, _ = resolve_channels_last(config.model.channels_last, config.train.amp, device)
    model = build_model(config.model, len(classes), in_channels=config.data.in_channels, channels_last=channels_last)
    load_model_weights(model, payload.pop("model"), checkpoint=path,
                       saved_model_cfg=from_dict(payload["config"], source=source).model, model_cfg=config.model)
    model.to(device).eval()
    return InferenceModel(model=model, config=config, classes=classes, iteration=payload.get("iteration"),
                          path=path, device=device)
