"""The Python API: build a model, load a config and train, load a checkpoint and predict.

    import syncseg
    model = syncseg.build_model(arch="deeplabv3plus", backbone="resnet50", num_classes=21, norm="syncbn")
    result = syncseg.train(syncseg.load_config("demo.yaml", ["train.iters=200"]))
    predictor = syncseg.load_model(result.run_dir / "best.pt")
    mask = predictor.predict("photo.jpg")

The commands (train.py, eval.py, predict.py) and these functions call the same engine, so a checkpoint
gives the same predictions here as in predict.py. Bad input raises ValueError / FileNotFoundError naming
the key, value or file.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from syncseg.engine.config import Config, build_config, load_config
from syncseg.engine.training_run import CompletedRun, run_training

__all__ = ["Predictor", "build_model", "demo_image", "load_config", "load_model", "predict", "train"]


def build_model(arch: str = "deeplabv3plus", backbone: str = "resnet50", num_classes: int = 21, *,
                norm: str = "syncbn", in_channels: int = 3, **model_keys: Any) -> nn.Module:
    """A DeepLab network (training mode, on the CPU) for `num_classes` classes.

    `arch`, `backbone`, `norm` and `model_keys` are the model.* config keys without the prefix
    (output_stride=8, aux_loss=True, pretrained_backbone="imagenet" from torchvision's local cache or a
    file path, head_channels, aspp_rates, ...), checked as the config checks them. forward(x: normalized
    float N x in_channels x H x W) -> {"out": logits N x num_classes x H x W, "aux": ... with aux_loss}.
    """
    from syncseg.model.builder import build_model as build_network

    values = {"model.arch": arch, "model.backbone": backbone, "model.norm": norm,
              **{f"model.{key}": value for key, value in model_keys.items()}}
    model_cfg = build_config(values, source="syncseg.build_model").model
    if isinstance(in_channels, bool) or not isinstance(in_channels, int) or in_channels < 1:
        raise ValueError(f"syncseg.build_model: in_channels={in_channels!r} must be a positive integer")
    return build_network(model_cfg, num_classes, in_channels=in_channels)


def train(config: Config | str | Path, overrides: list[str] | tuple[str, ...] = (), *, resume: str | None = "auto",
          overwrite: bool = False, gpus: str | None = None, stop_at: int | None = None,
          progress: bool | None = None) -> CompletedRun:
    """Train in this process, as train.py would with the same config and overrides; returns the run's
    result (iteration, best_miou, last_validation, run_dir).

    `config`: a Config (load_config) or a config file's name or path. `resume`: "auto" continues the run
    dir's last.pt when it exists, None starts afresh (a run dir that holds a run is refused unless
    `overwrite`), or a checkpoint path. `gpus`: as train.py's --gpus ("cpu", "0,1"; default GPU 0 when CUDA
    is available). Under torchrun each process calls it. Raises ValueError / FileNotFoundError for bad
    input, FloatingPointError for a non-finite loss; a SIGINT/SIGTERM saves last.pt and returns (reason
    "signal").
    """
    from syncseg.engine.allocator import keep_freed_memory
    from syncseg.engine.distributed import cleanup, detect_launch, setup_distributed
    from syncseg.engine.run_plan import ConfigSource, dist_timeout

    logging.getLogger("syncseg.api").info(keep_freed_memory())
    source = ConfigSource(config)
    launch = detect_launch()
    dist_info = setup_distributed(gpus, timeout_s=dist_timeout(source, resume, list(overrides)), launch=launch)
    try:
        run = run_training(source, overrides, dist_info=dist_info, resume=resume, overwrite=overwrite,
                           stop_at=stop_at, progress=progress)
    except BaseException:
        cleanup(synchronize=False)
        raise
    cleanup(synchronize=run.result.reason != "signal")
    return run


@dataclasses.dataclass
class Predictor:
    """A checkpoint's model in eval mode on its device, with what predicts like eval.py and predict.py:
    the checkpoint's normalization, eval settings (mode, scales, flip, amp) and data.base_size."""

    model: nn.Module
    config: Config
    classes: list[str]
    device: torch.device
    path: Path
    iteration: int | None

    @classmethod
    def from_loaded(cls, loaded: Any) -> "Predictor":
        """The Predictor of a syncseg.engine.model_from_checkpoint.InferenceModel (load_inference_model's result)."""
        return cls(model=loaded.model, config=loaded.config, classes=loaded.classes, device=loaded.device,
                   path=loaded.path, iteration=loaded.iteration)

    @property
    def palette(self) -> np.ndarray:
        """num_classes x 3 uint8: the colours eval.py and predict.py draw the classes in."""
        from syncseg.data.registry import dataset_kind

        return np.asarray(dataset_kind(self.config.data.dataset).palette_for(len(self.classes)), dtype=np.uint8)

    def predict(self, image: np.ndarray | str | Path) -> np.ndarray:
        """Class indices H x W (int64) for one image: an H x W x C array (uint8, or uint16 for 16-bit data;
        C = data.in_channels, RGB order for photos) or an image file, read as predict.py reads it."""
        return self.predict_logits(image).argmax(0).numpy()

    def predict_logits(self, image: np.ndarray | str | Path) -> torch.Tensor:
        """Logits num_classes x H x W (float32, on the CPU) for one image (see predict)."""
        return self._logits([self._pixels(image)])[0]

    def predict_many(self, images: Sequence[np.ndarray | str | Path], *, batch_size: int = 4) -> list[np.ndarray]:
        """predict for each image, `batch_size` at a time: consecutive images of one size go through the
        network as one batch (BatchNorm is in eval mode, so an image's mask does not depend on its
        neighbours); images of another size start a new batch."""
        if batch_size < 1:
            raise ValueError(f"predict_many: batch_size={batch_size} must be at least 1")
        masks: list[np.ndarray] = []
        group: list[np.ndarray] = []
        for pixels in (self._pixels(image) for image in images):
            if group and (pixels.shape != group[0].shape or len(group) == batch_size):
                masks += [logits.argmax(0).numpy() for logits in self._logits(group)]
                group = []
            group.append(pixels)
        if group:
            masks += [logits.argmax(0).numpy() for logits in self._logits(group)]
        return masks

    def predict_logits_batch(self, images: Sequence[np.ndarray]) -> torch.Tensor:
        """Logits N x num_classes x H x W (float32, on the CPU) of H x W x C arrays of one size, in one batch."""
        return self._logits([self._pixels(image) for image in images])

    def _logits(self, group: list[np.ndarray]) -> torch.Tensor:
        """Logits N x num_classes x H x W (float32, CPU) of images of one size (H x W x C arrays)."""
        from syncseg.engine.devices import resolve_precision
        from syncseg.engine.inference import predict_batch

        eval_cfg = dataclasses.replace(self.config.eval, amp=resolve_precision(self.config.eval.amp, self.device)[0])
        batch = torch.stack([torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1) for pixels in group])
        with torch.inference_mode():
            logits = predict_batch(self.model, batch.to(self.device), num_classes=len(self.classes),
                                   data_cfg=self.config.data, eval_cfg=eval_cfg, long_side=self.config.data.base_size)
        return logits.float().cpu()

    def _pixels(self, image: np.ndarray | str | Path) -> np.ndarray:
        from syncseg.data.images import ImageFormat, read_image

        image_format = ImageFormat.of(self.config.data)
        if isinstance(image, (str, Path)):
            return read_image(Path(image), image_format, exif_orientation=True)
        pixels = np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        channels = self.config.data.in_channels
        if pixels.ndim != 3 or pixels.shape[2] != channels:
            raise ValueError(f"image of shape {tuple(np.shape(image))}: expected H x W x {channels} "
                             f"(data.in_channels={channels} of checkpoint '{self.path}')")
        if pixels.dtype not in (np.uint8, np.uint16):
            raise ValueError(f"image of dtype {pixels.dtype}: expected uint8 (or uint16 for data.max_value above "
                             "255), as image files hold them")
        return pixels


def load_model(checkpoint: str | Path, *, device: str | torch.device = "cpu",
               overrides: list[str] | tuple[str, ...] = (), runtime: str = "torch",
               exported: str | Path | None = None, threads: int = 0) -> Predictor:
    """A Predictor for a best.pt / last.pt of a syncseg run or a .safetensors export, on `device`.

    The network is rebuilt from the stored config; `overrides` (KEY=VALUE, e.g. "eval.mode=slide") apply on
    top. `runtime` "onnxruntime" or "openvino" runs an ONNX export of the checkpoint on the CPU instead of
    PyTorch (`exported`, or one written once beside the checkpoint; `threads` > 0 the runtime's thread count;
    syncseg.engine.runtimes). Raises FileNotFoundError / ValueError naming the file or the tensor that does
    not fit.
    """
    from syncseg.engine.allocator import keep_freed_memory
    from syncseg.engine.cli import RUNTIMES, RuntimeChoice
    from syncseg.engine.model_from_checkpoint import load_inference_model

    if runtime not in RUNTIMES:
        raise ValueError(f"load_model: runtime={runtime!r} is not one of {', '.join(RUNTIMES)}")
    if runtime == "torch" and (exported is not None or threads):
        raise ValueError("load_model: exported= and threads= apply to runtime='onnxruntime' or 'openvino'")
    choice = None if runtime == "torch" else RuntimeChoice(runtime, Path(exported) if exported else None, threads)
    logging.getLogger("syncseg.api").info(keep_freed_memory())
    return Predictor.from_loaded(load_inference_model(checkpoint, device=torch.device(device),
                                                      overrides=list(overrides), runtime=choice))


def predict(predictor: Predictor, image: np.ndarray | str | Path) -> np.ndarray:
    """predictor.predict(image): class indices H x W."""
    return predictor.predict(image)


def demo_image(index: int = 0, *, size: int = 96) -> np.ndarray:
    """An H x W x 3 uint8 image of the demo's synthetic shapes (validation split), for trying a demo model."""
    from syncseg.data.synthetic import SyntheticShapes

    if index < 0:
        raise ValueError(f"demo_image: index={index} must be >= 0")
    image, _ = SyntheticShapes(index + 1, size, split="val").load(index)
    return image
