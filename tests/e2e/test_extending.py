"""docs/extending.md, proved: a data set kind, a backbone and a loss term registered from outside the package
(this file) are accepted by the config and trained on in-process, a few CPU steps each."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from syncseg.data.registry import DATASET_KINDS, DatasetKind, register_dataset_kind
from syncseg.engine.checkpoint_file import load_checkpoint
from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.registry import LOSS_TERMS, PIXELS, register_loss_term
from syncseg.engine.trainer import Trainer
from syncseg.model.registry import BACKBONES, register_backbone
from tests.e2e.common import TINY_BASE

TOY_CLASSES = ("sea", "land", "cloud")


class ToyDataset(Dataset):
    """A few random 40x40 images whose masks are three horizontal bands, one per class."""

    def __init__(self, length: int, *, seed: int, transform, ignore_index: int) -> None:
        rng = np.random.default_rng(seed)
        self.images = rng.integers(0, 256, (length, 40, 40, 3), dtype=np.uint8)
        self.masks = np.repeat(np.arange(40, dtype=np.uint8)[:, None] * 3 // 40, 40, axis=1)
        self.transform, self.ignore_index = transform, ignore_index
        self.classes = TOY_CLASSES
        self.palette = np.array([(0, 0, 255), (0, 255, 0), (255, 255, 255)], dtype=np.uint8)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.images)

    def name_of(self, index: int) -> str:
        return f"toy_{index}"

    def __getitem__(self, index: int):
        return self.transform(self.images[index], self.masks)


def build_toy(data_cfg, split: str, transform) -> ToyDataset:
    return ToyDataset(8 if split == data_cfg.train_split else 2, seed=len(split), transform=transform,
                      ignore_index=data_cfg.ignore_index)


class TinyBackbone(nn.Module):
    """Four strided convolutions: low_level at stride 4, aux at 8, out at 16."""

    def __init__(self, norm_layer) -> None:
        super().__init__()

        def stage(inputs: int, outputs: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(inputs, outputs, 3, stride=2, padding=1, bias=False), norm_layer(outputs),
                                 nn.ReLU())

        self.stages = nn.ModuleList([stage(3, 8), stage(8, 8), stage(8, 16), stage(16, 16)])
        self.low_level_channels, self.aux_channels, self.out_channels = 8, 16, 16

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = []
        for stage in self.stages:
            x = stage(x)
            features.append(x)
        return {"low_level": features[1], "aux": features[2], "out": features[3]}


def build_tiny_backbone(name: str, *, output_stride: int, norm_layer) -> TinyBackbone:
    assert output_stride == 16, "this toy has one output stride"
    return TinyBackbone(norm_layer)


def soft_error(loss, inputs):
    """1 - the probability of the true class, per valid pixel (weighted like cross-entropy)."""
    probability = F.softmax(inputs.logits, dim=1).gather(1, inputs.safe_target.unsqueeze(1)).squeeze(1)
    return ((1 - probability) * inputs.pixel_weight).sum(), inputs.pixel_weight.sum()


@pytest.fixture
def toy_kind():
    kind = register_dataset_kind(DatasetKind("toy", build_toy, classes=TOY_CLASSES,
                                             palette=((0, 0, 255), (0, 255, 0), (255, 255, 255))))
    yield kind
    DATASET_KINDS.unregister("toy")


@pytest.fixture
def tiny_backbone_and_soft_error():
    register_backbone("tiny", build_tiny_backbone)
    register_loss_term("soft_error", soft_error, normalized_by=PIXELS, weighs_classes=True)
    yield
    BACKBONES.unregister("tiny")
    LOSS_TERMS.unregister("soft_error")


def _train(tmp_path, *overrides: str):
    config = load_config("demo.yaml", [f"output_dir={tmp_path}", *TINY_BASE, "train.amp=off", "train.iters=3",
                                       "train.val_interval=3", "train.ckpt_interval=3", "train.num_vis_images=1",
                                       *overrides])
    torch.manual_seed(0)
    trainer = Trainer.from_config(config, DistInfo(), progress=False)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def test_a_data_set_kind_registered_outside_the_package_trains(toy_kind, tmp_path):
    with pytest.raises(ValueError, match=r"data.dataset='toys' is not one of .*, toy; did you mean 'toy'\?"):
        load_config(None, ["data.dataset=toys"])
    with pytest.raises(ValueError, match="dataset 'toy' has a fixed class list"):
        load_config(None, ["data.dataset=toy", "data.num_classes=3"])
    result = _train(tmp_path, "data.dataset=toy")
    assert result.iteration == 3 and len(result.losses) == 3 and all(np.isfinite(list(result.losses.values())))
    assert len(result.last_val["iou"]) == 3
    checkpoint = load_checkpoint(tmp_path / "last.pt")
    assert checkpoint["classes"] == list(TOY_CLASSES) and checkpoint["config"]["data"]["dataset"] == "toy"
    assert toy_kind.palette_for(3).tolist() == [[0, 0, 255], [0, 255, 0], [255, 255, 255]]


def test_a_backbone_and_a_loss_term_registered_outside_the_package_train(tiny_backbone_and_soft_error, tmp_path):
    result = _train(tmp_path, "model.backbone=tiny", "train.loss=ce:1,soft_error:0.5",
                    "train.class_weights=1,1,1,1,1,2")
    assert result.iteration == 3 and all(np.isfinite(list(result.losses.values())))
    model = load_checkpoint(tmp_path / "last.pt")["model"]
    assert "backbone.stages.3.0.weight" in model
