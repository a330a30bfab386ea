"""The checkpoint file format: the only place that calls torch.save / torch.load (besides model/backbones.py).

A checkpoint is a dict of primitives and tensors (docs/design.md): `format_version`, `model` (unwrapped
state dict), `config` (syncseg.engine.config.to_dict), `classes`, `iteration`, `epoch`, `best_miou`,
`run_id`, and in last.pt also what a resume needs (`optimizer`, `scheduler`, `scaler`, `rng`,
`overrides`). best.pt is the file people keep and share: `WEIGHTS_KEYS` plus the validation
`metrics` that made it the best, no optimizer state (a third of last.pt with AdamW, whose two
moments are each as large as the weights). It loads with `weights_only=True`, so no pickled classes.
Files are written atomically (syncseg.engine.atomic: a temporary file in the same folder, fsync, os.replace), so an
existing checkpoint is either the old one or the new one, never half-written; they get the mode a
plain `open()` would give (0644 under umask 022), so teammates on a shared cluster can read them.
A `.safetensors` file written by `python -m syncseg export --format safetensors` loads here too.

What uses the files lives elsewhere: a training run's writing (syncseg.engine.training_state.Checkpointer), loading
for inference (syncseg.engine.model_from_checkpoint.load_inference_model), fine-tuning from `load_weights_file`
(syncseg.engine.build.init_from_weights), and matching a state dict to a model (syncseg.model.weights).
"""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from syncseg.engine.atomic import write_atomically
from syncseg.engine.object_store import local_copy
from syncseg.model.backbones import unwrap_state_dict

FORMAT_VERSION = 1
# What eval.py / predict.py / fine-tuning need; a training resume also needs optimizer etc. and
# asks for them with `required_keys=`.
REQUIRED_KEYS = ("format_version", "model", "config", "classes")
RESUME_KEYS = REQUIRED_KEYS + ("iteration", "epoch", "best_miou", "optimizer", "scheduler", "scaler", "rng")
# What best.pt keeps of a training payload (plus `metrics`): everything but the resume state.
WEIGHTS_KEYS = REQUIRED_KEYS + ("iteration", "epoch", "best_miou", "run_id", "label_ids")
SAFETENSORS_SUFFIX = ".safetensors"
# .safetensors metadata entries (each a JSON string) that become payload keys
SAFETENSORS_METADATA = ("format_version", "config", "classes", "iteration", "best_miou", "metrics", "run_id",
                        "label_ids")

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
    (syncseg.model.weights.load_segmentation_weights). Raises FileNotFoundError naming the file and where such
    files come from, ValueError when it is unreadable or holds no state dict. An object-store URL is read from
    its download (syncseg.engine.object_store.local_copy).
    """
    path = local_copy(path)
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
