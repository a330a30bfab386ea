"""Matching a state dict to a model: the one place that compares keys and shapes and words the problems.

`load_model_weights` loads every tensor strictly (evaluation, prediction, a resumed run);
`load_segmentation_weights` loads what fits for fine-tuning (ours or torchvision's DeepLabV3 weights), skipping
a classifier of another class count. Both raise one ValueError whose phrases come from `state_dict_problems`.
Reading the files is syncseg.engine.checkpoint_file's (model/backbones.py reads backbone weight files).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from torch import Tensor, nn

from syncseg.model.builder import unwrap_model
from syncseg.model.input_channels import RGB, describe_rule, first_convolution, rgb_filters_for


def describe_architecture(model_cfg: Any) -> str:
    """The model.* settings that decide the state dict's keys and shapes, as KEY=VALUE text."""
    return (f"model.arch={model_cfg.arch} model.backbone={model_cfg.backbone} "
            f"model.output_stride={model_cfg.output_stride} model.head_channels={model_cfg.head_channels} "
            f"model.aux_loss={model_cfg.aux_loss}")


def _mismatch(key: str, given: Tensor, expected: Tensor, *, source: str) -> str:
    """A shape mismatch as state_dict_problems quotes it: "key: <source> (shape) vs model (shape)"."""
    return f"{key}: {source} {tuple(given.shape)} vs model {tuple(expected.shape)}"


def _logits_keys(model: nn.Module) -> set[str]:
    """State-dict keys of the last conv of `classifier` and `aux_classifier` (their outputs are classes)."""
    keys = set()
    for head_name in ("classifier", "aux_classifier"):
        head = getattr(model, head_name, None)
        if head is None:
            continue
        convs = [name for name, module in head.named_modules() if isinstance(module, nn.Conv2d)]
        if convs:
            keys |= {f"{head_name}.{convs[-1]}.weight", f"{head_name}.{convs[-1]}.bias"}
    return keys


def compact_keys(selected: Iterable[str], universe: Iterable[str]) -> list[str]:
    """`selected` keys, in `universe`'s order, with `module.*` standing for every key of `universe` under a
    module when all of them are selected: e.g. ["backbone.*", "classifier.0.*", "classifier.4.weight"]."""
    chosen = set(selected)

    def visit(prefix: str, keys: list[str]) -> list[str]:
        picked = [key for key in keys if key in chosen]
        if not picked:
            return []
        if prefix and len(picked) == len(keys):
            return [f"{prefix}*"]
        groups: dict[str, list[str]] = {}  # next name -> keys under it; a leaf key is its own group
        for key in keys:
            head, dot, _ = key[len(prefix):].partition(".")
            groups.setdefault(f"{prefix}{head}." if dot else key, []).append(key)
        out: list[str] = []
        for name, group in groups.items():
            out += visit(name, group) if name.endswith(".") else [name] if name in chosen else []
        return out

    return visit("", list(dict.fromkeys(universe)))


@dataclass
class LoadedWeights:
    """What `load_segmentation_weights` did: `loaded` keys, `skipped` file keys (key -> why) and `missing`
    model keys (left at their fresh initialization), with the key lists of the model and of the file."""

    loaded: list[str]
    skipped: dict[str, str]
    missing: list[str]
    model_keys: list[str] = field(repr=False, default_factory=list)
    file_keys: list[str] = field(repr=False, default_factory=list)
    adapted: str = ""  # the backbone's first convolution and the rule, when its RGB filters were adapted

    def summary(self) -> str:
        """One line naming every loaded, skipped and missing key (whole modules written as `module.*`,
        BatchNorm counters counted)."""
        loaded = _described(self.loaded, self.model_keys) or "nothing"
        reasons: dict[str, list[str]] = {}
        for key, reason in self.skipped.items():
            reasons.setdefault(reason, []).append(key)
        skipped = "; ".join(f"{_described(keys, self.file_keys)} ({reason})" for reason, keys in reasons.items())
        missing = _described(self.missing, self.model_keys) or "none"
        if self.adapted:
            loaded += f" ({self.adapted})"
        return (f"loaded {len(self.loaded)} of the model's {len(self.model_keys)} tensors: {loaded}; "
                f"skipped {len(self.skipped)} of the file's {len(self.file_keys)}: {skipped or 'none'}; "
                f"not in the file (kept freshly initialized): {missing}")


def _is_counter(key: str) -> bool:
    return key.endswith(".num_batches_tracked")


def _described(keys: Iterable[str], universe: Iterable[str]) -> str:
    keys = list(keys)
    parts = compact_keys([k for k in keys if not _is_counter(k)], [k for k in universe if not _is_counter(k)])
    modules = tuple(part[:-1] for part in parts if part.endswith("*"))
    counters = sum(_is_counter(key) and not key.startswith(modules) for key in keys)  # outside a `module.*`
    if counters:
        parts.append(f"{counters} BatchNorm counter(s) (num_batches_tracked)")
    return ", ".join(parts)


def state_dict_problems(missing: list[str], unexpected: list[str], mismatched: list[str], *,
                        where: str = "") -> list[str]:
    """One phrase per kind of state-dict mismatch, each with its count and first example (for one-line errors).

    `mismatched` holds "key: file (...) vs model (...)" descriptions; `where` qualifies them (e.g.
    " outside the classifier")."""
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s) (e.g. {missing[0]})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) (e.g. {unexpected[0]})")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es){where} (e.g. {mismatched[0]})")
    return problems


def load_segmentation_weights(model: nn.Module, state_dict: Mapping[str, Tensor]) -> LoadedWeights:
    """Load a segmentation state dict (ours or torchvision's DeepLabV3) for fine-tuning.

    Skipped, with the reason: the final classifier convs (`classifier`, `aux_classifier`) whose shapes
    differ (the number of classes changed), `aux_classifier.*` when the model has none, and BatchNorm
    counters (`num_batches_tracked`) a frozen BatchNorm does not keep. Adapted: the RGB filters of the
    backbone's first convolution, for a model of other input channels (model/input_channels.py). Missing
    and left freshly initialized: `aux_classifier.*` when the file has none, and BatchNorm counters.
    Anything else that does not match (a missing, unexpected or mis-shaped tensor: another
    architecture, backbone or head width) raises one ValueError before any tensor is loaded. A `module.`
    prefix on every key (a DataParallel / DDP state dict) is stripped.
    """
    model = unwrap_model(model)
    if state_dict and all(key.startswith("module.") for key in state_dict):
        state_dict = {key[len("module."):]: value for key, value in state_dict.items()}
    own = model.state_dict()
    logits_keys = _logits_keys(model)
    has_aux = getattr(model, "aux_classifier", None) is not None
    first_conv = f"backbone.{first_convolution(model.backbone)[0]}.weight"
    loaded, skipped, mismatched, unexpected, adapted = [], {}, [], [], {}
    for key, value in state_dict.items():
        if key == first_conv and key in own and value.ndim == 4 and value.shape[1] == RGB != own[key].shape[1]:
            adapted[key] = rgb_filters_for(value, own[key].shape[1])  # an RGB model's filters, other channels
        if key in own and own[key].shape == adapted.get(key, value).shape:
            loaded.append(key)
        elif key in own and key in logits_keys:
            skipped[key] = (f"{value.shape[0]} classes in the file, {own[key].shape[0]} in the model")
        elif key in own:
            mismatched.append(_mismatch(key, value, own[key], source="file"))
        elif key.startswith("aux_classifier.") and not has_aux:
            skipped[key] = "the model has no aux classifier: model.aux_loss=false"
        elif _is_counter(key) and key.rsplit(".", 1)[0] + ".running_mean" in own:
            skipped[key] = "frozen BatchNorm keeps no counter"
        else:
            unexpected.append(key)
    missing = [key for key in own if key not in state_dict]
    fatal_missing = [key for key in missing if not (key.startswith("aux_classifier.") or _is_counter(key))]
    if fatal_missing or unexpected or mismatched:
        problems = state_dict_problems(fatal_missing, unexpected, mismatched, where=" outside the classifier")
        if not any(key.startswith("backbone.") for key in state_dict) and any(f"backbone.{key}" in own
                                                                           for key in state_dict):
            problems.append("the file looks like backbone (classification) weights: give it as "
                            "model.pretrained_backbone instead")
        raise ValueError("; ".join(problems))
    result = model.load_state_dict({key: adapted.get(key, state_dict[key]) for key in loaded}, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= set(missing) | set(skipped), result
    return LoadedWeights(loaded=loaded, skipped=skipped, missing=missing, model_keys=list(own),
                         file_keys=list(state_dict),
                         adapted="".join(f"{key} from the file's RGB filters: {describe_rule(value.shape[1])}"
                                         for key, value in adapted.items()))


def load_model_weights(model: nn.Module, state_dict: Mapping[str, Tensor], *, checkpoint: str | Path,
                       saved_model_cfg: Any, model_cfg: Any) -> None:
    """Load every tensor of a checkpoint's `model` strictly (evaluation / prediction / resume, not fine-tuning).

    Raises one ValueError naming the checkpoint, the architecture it was trained with (`saved_model_cfg`)
    and the one asked for (`model_cfg`), and the first missing / unexpected / mis-shaped tensor, instead of
    load_state_dict's multi-line shape traceback.
    """
    expected = model.state_dict()
    missing = [key for key in expected if key not in state_dict]
    unexpected = [key for key in state_dict if key not in expected]
    shapes = [_mismatch(key, state_dict[key], value, source="checkpoint")
              for key, value in expected.items() if key in state_dict and state_dict[key].shape != value.shape]
    if missing or unexpected or shapes:
        problems = state_dict_problems(missing, unexpected, shapes)
        raise ValueError(
            f"checkpoint '{checkpoint}' does not fit the model: it was trained as "
            f"[{describe_architecture(saved_model_cfg)}], the config asks for [{describe_architecture(model_cfg)}]: "
            f"{'; '.join(problems)}; drop the model.* overrides"
        )
    model.load_state_dict(state_dict, strict=True)
