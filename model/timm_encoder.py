"""timm encoders as DeepLab backbones: `model.backbone=timm:<name>` (timm:resnest50d, timm:convnext_tiny,
timm:efficientnet_b3, timm:regnety_040, ...; a pretrained tag may follow the name: timm:resnet50.a1_in1k).

The encoder is `timm.create_model(name, features_only=True, output_stride=model.output_stride)`: the
output stride is timm's own dilation. A timm model without it (ViT, Swin, DenseNet, ...) is a
ValueError that says so, as is one whose last feature map does not come out at that stride. timm is
imported only when such a backbone is built (it is pinned in requirements.txt: another version may
build other keys).

Feature maps, from timm's feature_info: `out` is the last one, `aux` the one before it (ResNet's
layer3), `low_level` the last one at output stride 4 (the DeepLabV3+ decoder's input; the first one
when none is at 4). The backbone norm of `model.norm` replaces the encoder's BatchNorm2d layers
(syncseg.model.norm.adopt_batch_norms); encoders with LayerNorm or GroupNorm keep theirs.

Weights are never downloaded. `model.pretrained_backbone`: "none" (timm's initialization); a path to a
timm checkpoint of that model (classification weights are fine: timm's own loader drops the head);
"imagenet": timm's default pretrained weights for the name, read where timm itself caches them (the
Hugging Face cache, HF_HUB_CACHE, by default ~/.cache/huggingface/hub, or torch's hub cache for older
weights); when they are not there, a FileNotFoundError names the repository, the file and the folder.
"""
from __future__ import annotations

import difflib
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import torch
from torch import Tensor, nn

from syncseg.model.registry import TIMM_PREFIX

logger = logging.getLogger(__name__)



def timm_model_name(backbone: str) -> str | None:
    """`"timm:resnest50d"` -> `"resnest50d"`; None for the other backbones."""
    return backbone[len(TIMM_PREFIX):] if backbone.startswith(TIMM_PREFIX) else None


class TimmBackbone(nn.Module):
    """A timm `features_only` encoder returning DeepLab's {"low_level", "aux", "out"} feature dict."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder
        reductions, channels = encoder.feature_info.reduction(), encoder.feature_info.channels()
        at_four = [index for index, reduction in enumerate(reductions) if reduction == 4]
        self.low_level_index = at_four[-1] if at_four else 0
        self.aux_index = max(len(channels) - 2, 0)
        self.low_level_channels = channels[self.low_level_index]
        self.aux_channels = channels[self.aux_index]
        self.out_channels = channels[-1]
        self.output_stride = reductions[-1]

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        features = self.encoder(x)
        return {"low_level": features[self.low_level_index], "aux": features[self.aux_index], "out": features[-1]}


def _summary(error: BaseException, limit: int = 300) -> str:
    """An exception's text on one line, cut to `limit` characters."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def cached_pretrained_weights(name: str) -> Path:
    """The local file of timm's default pretrained weights for `name`, from the Hugging Face cache or
    torch's hub cache (nothing is downloaded). Raises FileNotFoundError naming where it must be,
    ValueError when timm has no pretrained weights for the name."""
    import huggingface_hub
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name)
    if cfg is None or not (cfg.hf_hub_id or cfg.url):
        raise ValueError(f"model.backbone=timm:{name}: timm lists no pretrained weights for it; use "
                         "model.pretrained_backbone=none or the path to a checkpoint")
    hub_cache = Path(huggingface_hub.constants.HF_HUB_CACHE)
    places = []
    if cfg.hf_hub_id:
        repo, _, revision = cfg.hf_hub_id.partition("@")
        for file_name in [cfg.hf_hub_filename] if cfg.hf_hub_filename else ["model.safetensors", "pytorch_model.bin"]:
            found = huggingface_hub.try_to_load_from_cache(repo, file_name, cache_dir=hub_cache,
                                                           revision=revision or None)
            if isinstance(found, str):
                return Path(found)
            places.append(f"'{file_name}' of the Hugging Face repository '{repo}' in '{hub_cache}' "
                          f"(models--{repo.replace('/', '--')}/snapshots/<revision>/)")
    if cfg.url:
        path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(cfg.url).path)
        if path.is_file():
            return path
        places.append(f"'{path}'")
    raise FileNotFoundError(
        f"model.pretrained_backbone=imagenet: timm's weights for '{name}' are not in the local caches; expected "
        f"{' or '.join(places)}. Nothing is downloaded at run time: on a machine with network access run "
        f"python -c \"import timm; timm.create_model('{name}', pretrained=True)\" and copy its cache here "
        "(set HF_HUB_CACHE to change the folder), or give model.pretrained_backbone=/path/to/weights")


def _strict_weights(name: str, path: Path) -> dict[str, Any]:
    """create_model options that load `path` through timm's own reader, key filter and input adaptation,
    after checking it strictly: a features_only model loads non-strictly in timm (a wrong file would
    only log a warning), so the file is first loaded strictly into the whole network (on the meta
    device: shapes and names only), without its classifier."""
    import timm
    from timm.models import get_pretrained_cfg, load_state_dict

    try:
        state_dict = load_state_dict(str(path))
    except Exception as error:  # corrupt / not a checkpoint
        raise ValueError(f"model.pretrained_backbone '{path}' could not be read as a state dict: "
                         f"{_summary(error)}") from None
    cfg = get_pretrained_cfg(name)
    classifiers = cfg.classifier if cfg is not None and cfg.classifier else ()
    for classifier in (classifiers,) if isinstance(classifiers, str) else classifiers:
        state_dict.pop(f"{classifier}.weight", None)
        state_dict.pop(f"{classifier}.bias", None)
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "copying from a non-meta parameter ... is a no-op"
            timm.create_model(name, pretrained=True, num_classes=0,
                              pretrained_cfg_overlay={"state_dict": dict(state_dict), "num_classes": 0})
    except RuntimeError as error:
        raise ValueError(f"model.pretrained_backbone '{path}' does not fit model.backbone=timm:{name} (a timm "
                         f"checkpoint of that model is expected): {_summary(error)}") from None
    return {"pretrained": True, "pretrained_cfg_overlay": {"state_dict": state_dict, "num_classes": 0}}


def build_timm_backbone(name: str, *, output_stride: int, norm_layer: Callable[..., nn.Module],
                        pretrained: str = "none") -> TimmBackbone:
    """The timm encoder `name` at `output_stride` (8, 16 or 32) with the backbone norm `norm_layer` (see the
    module docstring for `pretrained`). Raises ValueError naming the model for names timm does not know,
    models without features_only or output-stride support and weights that do not fit;
    FileNotFoundError for missing weight files."""
    import timm

    from syncseg.model.norm import adopt_batch_norms

    key = f"model.backbone=timm:{name}"
    if name.startswith(("hf-hub:", "hf_hub:")):
        raise ValueError(f"{key}: Hugging Face Hub names fetch their config over the network; give the timm "
                         "architecture name and put the weights file in model.pretrained_backbone")
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else " (see timm.list_models())"
        raise ValueError(f"{key}: timm {timm.__version__} has no model '{name}'{hint}")
    options: dict[str, Any] = {"features_only": True, "output_stride": output_stride, "pretrained": False}
    if pretrained not in ("", "none"):
        path = cached_pretrained_weights(name) if pretrained == "imagenet" else Path(pretrained)
        if not path.is_file():
            raise FileNotFoundError(f"model.pretrained_backbone: weights file '{path}' for {key} not found; expected "
                                    "'none', 'imagenet' (timm's cache) or the path to a timm checkpoint")
        options.update(_strict_weights(name, path))
        logger.info("%s: weights from '%s'", key, path)
    try:
        encoder = timm.create_model(name, **options)
    except TypeError as error:
        if "output_stride" not in str(error):
            raise
        raise ValueError(f"{key}: timm builds this model without output-stride (dilation) support, so "
                         f"model.output_stride={output_stride} cannot be honoured; choose a convolutional encoder "
                         "(resnet*, resnest*, convnext*, efficientnet*, mobilenetv3*, regnet*, xception*, ...)") from None
    except RuntimeError as error:
        raise ValueError(f"{key}: timm cannot build it as a feature extractor ({_summary(error)})") from None
    backbone = TimmBackbone(encoder)
    if backbone.output_stride != output_stride:
        raise ValueError(f"{key}: its last feature map comes out at output stride {backbone.output_stride}, not "
                         f"model.output_stride={output_stride}; choose another encoder")
    if not any(isinstance(module, nn.BatchNorm2d) for module in encoder.modules()):
        logger.info("%s has no BatchNorm layers: model.norm applies to the head only", key)
    adopt_batch_norms(encoder, norm_layer)
    return backbone
