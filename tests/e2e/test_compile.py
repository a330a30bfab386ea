"""train.compile=true: torch.compile trains the same model to the same losses (CPU, one process). The
synchronized layers compiled with their collectives (2 and 4 gloo processes, against eager and
nn.BatchNorm2d) are the package's tests: model/sync_batchnorm/tests/test_compile.py."""
from __future__ import annotations

import pytest
from torch import nn

from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo, compile_for_training
from syncseg.engine.trainer import Trainer

TINY = ["data.synthetic_image_size=32", "data.crop_size=32", "data.synthetic_train_size=8", "data.synthetic_val_size=2",
        "data.num_workers=0", "model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1",
        "model.channels_last=false", "train.batch_size=2", "train.iters=3", "train.val_interval=100",
        "train.ckpt_interval=100", "train.amp=off", "eval.batch_size=2"]


def _losses(tmp_path, compiled: bool) -> dict[int, float]:
    config = load_config("demo.yaml", [f"output_dir={tmp_path / str(compiled)}", *TINY, f"train.compile={compiled}"])
    trainer = Trainer.from_config(config, DistInfo(), progress=False)
    for module in trainer.model.modules():
        if isinstance(module, nn.Dropout):  # compiled code draws its dropout masks from another generator
            module.p = 0.0
    assert (trainer.parts.forward_model is not trainer.parts.train_model) == compiled
    result = trainer.fit()
    trainer.close()
    return result.losses


@pytest.mark.slow
def test_compiled_training_gives_the_eager_losses(tmp_path):
    eager, compiled = _losses(tmp_path, False), _losses(tmp_path, True)
    assert sorted(eager) == sorted(compiled) == [1, 2, 3]
    for iteration, loss in eager.items():
        assert compiled[iteration] == pytest.approx(loss, rel=1e-4, abs=1e-5), iteration
    assert len(set(eager.values())) > 1


def test_thread_replicas_cannot_be_compiled(no_accelerator):
    from syncseg.model.sync_batchnorm import DataParallelWithCallback

    replicas = DataParallelWithCallback(nn.Linear(2, 2), device_ids=[])
    with pytest.raises(ValueError, match="train.compile=true cannot compile DataParallelWithCallback"):
        compile_for_training(replicas, DistInfo(mode="dp", device_ids=(0, 1)), enabled=True)
