"""PreciseBN: BatchNorm running statistics recomputed as the population statistics of the batches."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from syncseg.data.transforms import normalize_batch
from syncseg.engine.config import DataConfig, load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.precise_bn import recompute_batch_norm_statistics
from syncseg.engine.trainer import Trainer
from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d

DATA = DataConfig()


def _batches(sizes):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 256, (size, 3, 6, 7), dtype=torch.uint8, generator=generator),
             torch.zeros(size, 6, 7, dtype=torch.int64)) for size in sizes]


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, SynchronizedBatchNorm2d])
def test_running_statistics_become_the_population_statistics_of_the_data(norm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm(4), nn.ReLU(), nn.Conv2d(4, 2, 1), norm(2))
    for layer in (model[1], model[4]):  # corrupted statistics, a momentum of its own, a count
        layer.running_mean.fill_(7.0), layer.running_var.fill_(0.01)
        layer.momentum = 0.3
        layer.num_batches_tracked.fill_(11)
    batches = _batches([3, 5, 2])  # unequal batches: each weighs by its pixels
    model.eval()
    assert recompute_batch_norm_statistics(model, model, batches, data_cfg=DATA, precision="off",
                                           device=torch.device("cpu")) == 2
    assert not model.training and model[1].momentum == 0.3 and int(model[1].num_batches_tracked) == 11
    # reference: float64, every pixel of every batch at once, each layer fed as training feeds it
    reference = model.double().train()
    inputs = torch.cat([normalize_batch(images, DATA.mean, DATA.std) for images, _ in batches]).double()
    first = reference[0](inputs)
    for layer, features in ((reference[1], first),):
        torch.testing.assert_close(layer.running_mean, features.mean((0, 2, 3)), rtol=0, atol=1e-5)
        torch.testing.assert_close(layer.running_var, features.var((0, 2, 3), unbiased=True), rtol=0, atol=1e-5)
    assert torch.isfinite(reference[4].running_var).all() and not torch.allclose(
        reference[4].running_mean, torch.full_like(reference[4].running_mean, 7.0))


def test_a_stop_between_batches_leaves_the_statistics_as_they_were():
    # asked before every batch (StopRequest.agreed): the pass ends at once instead of running its batches
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), SynchronizedBatchNorm2d(4))
    model[1].running_mean.fill_(7.0)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    asked = []
    count = recompute_batch_norm_statistics(model, model, _batches([3, 5, 2]), data_cfg=DATA, precision="off",
                                            device=torch.device("cpu"),
                                            should_stop=lambda: asked.append(len(asked)) or len(asked) == 2)
    assert count is None and asked == [0, 1]  # the second batch never ran
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert model[1].momentum == 0.1


def test_training_losses_are_untouched_and_validation_sees_the_new_statistics(tmp_path):
    tiny = ["data.synthetic_image_size=32", "data.crop_size=32", "data.synthetic_train_size=16",
            "data.synthetic_val_size=2", "data.num_workers=0", "model.backbone=resnet18", "model.head_channels=8",
            "model.aspp_rates=1", "model.aux_loss=false", "train.batch_size=4", "train.warmup_iters=1",
            "train.amp=off", "eval.amp=off", "train.num_vis_images=0", "train.iters=3", "train.val_interval=3",
            "train.log_interval=1"]
    results = {}
    for batches in (0, 2):
        config = load_config("demo.yaml", [f"output_dir={tmp_path / str(batches)}", *tiny,
                                           f"train.precise_bn_batches={batches}"])
        trainer = Trainer.from_config(config, DistInfo(), progress=False)
        results[batches] = trainer.fit()
        trainer.close()
    assert results[2].losses == results[0].losses  # its batches come from a loader of its own
    assert results[2].last_val["iou"] != results[0].last_val["iou"]
