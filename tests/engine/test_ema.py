"""train.ema_decay: the average of the weights, its exact resume, and what validation and best.pt use."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from syncseg.engine.checkpoint_file import RESUME_KEYS, load_checkpoint
from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.ema import ModelEMA
from syncseg.engine.trainer import Trainer

TINY = [
    "data.synthetic_image_size=32", "data.crop_size=32", "data.synthetic_train_size=16", "data.synthetic_val_size=2",
    "data.num_workers=0", "model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1",
    "model.aux_loss=false", "train.batch_size=4", "train.warmup_iters=1", "train.log_interval=1",
    "train.amp=off", "eval.amp=off", "train.num_vis_images=0", "train.ema_decay=0.5",
]


def test_average_follows_the_formula_and_copies_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    ema = ModelEMA(model, 0.75)
    expected = [p.detach().double().clone() for p in model.parameters()]
    for _ in range(3):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter))
        model.train()(torch.randn(5, 3))  # moves the running statistics
        ema.update(model)
        expected = [0.75 * e + 0.25 * p.detach().double() for e, p in zip(expected, model.parameters())]
    for average, reference in zip(ema.module.parameters(), expected):
        torch.testing.assert_close(average.double(), reference, rtol=0, atol=1e-6)
        assert not average.requires_grad
    for average, current in zip(ema.module.buffers(), model.buffers()):
        assert torch.equal(average, current)
    with pytest.raises(ValueError, match="train.ema_decay=1.0"):
        ModelEMA(model, 1.0)


def _config(tmp_path, name, *extra):
    return load_config("demo.yaml", [f"output_dir={tmp_path / name}", *TINY, *extra])


@pytest.mark.slow
def test_resume_with_ema_equals_an_uninterrupted_run(tmp_path):
    common = ["train.iters=4", "train.val_interval=100", "train.ckpt_interval=100"]
    straight = Trainer.from_config(_config(tmp_path, "straight", *common), DistInfo(), progress=False)
    expected = straight.fit().losses
    final_average = straight.parts.ema.state_dict()
    straight.close()
    first = Trainer.from_config(_config(tmp_path, "split", *common), DistInfo(), progress=False)
    first.fit(stop_at=2)
    first.close()
    payload = load_checkpoint(tmp_path / "split" / "last.pt", required_keys=RESUME_KEYS)
    assert "ema" in payload
    second = Trainer.from_config(_config(tmp_path, "split", *common), DistInfo(), resume=payload, progress=False)
    resumed = second.fit().losses
    assert [resumed[i] for i in (3, 4)] == [expected[i] for i in (3, 4)]
    for name, tensor in second.parts.ema.state_dict().items():
        assert torch.equal(tensor, final_average[name]), name
    second.close()


@pytest.mark.slow
def test_validation_and_best_checkpoint_use_the_averaged_weights(tmp_path):
    trainer = Trainer.from_config(_config(tmp_path, "run", "train.iters=2", "train.val_interval=2"), DistInfo(),
                                  progress=False)
    trainer.fit()
    average, current = trainer.parts.ema.state_dict(), trainer.model.state_dict()
    assert trainer.parts.eval_model is trainer.parts.ema.module
    trainer.close()
    best = load_checkpoint(tmp_path / "run" / "best.pt")
    last = load_checkpoint(tmp_path / "run" / "last.pt")
    moved = [name for name in average if average[name].is_floating_point() and not torch.equal(average[name], current[name])]
    assert moved  # the average differs from the current weights, so the checks below tell them apart
    assert all(torch.equal(best["model"][name], average[name]) for name in average)
    assert all(torch.equal(last["model"][name], current[name]) for name in current)


def test_the_average_shares_what_cannot_be_copied():
    """A process group (model.syncbn_group_size) cannot be deep-copied: the average shares it."""
    from syncseg.model.sync_batchnorm import SynchronizedBatchNorm2d

    class Group:  # stands in for a torch.distributed ProcessGroup
        def __deepcopy__(self, memo):
            raise TypeError("cannot copy a process group")

    model = nn.Sequential(nn.Conv2d(3, 4, 1), SynchronizedBatchNorm2d(4))
    model[1].process_group = Group()
    assert ModelEMA(model, 0.9).module[1].process_group is model[1].process_group


@pytest.mark.parametrize("saved,decay,expected,said", [
    (0.5, 0.5, 0.4, None),
    (0.5, 0.9, 0.4, "changed on resume from 0.5 to 0.9"),
    (0.5, 0.0, -1.0, "best val mIoU 0.4000 was measured on the averaged weights, so the best is reset"),
    (0.0, 0.0, 0.4, None),
])
def test_a_changed_decay_on_resume_is_said_and_turning_it_off_resets_the_best(saved, decay, expected, said, caplog):
    """Issue 34 item 6: a changed decay was accepted without a word, and ema_decay=0 kept a best mIoU that was
    measured on averaged weights validation no longer uses."""
    from syncseg.engine.ema import best_after_decay_change

    assert best_after_decay_change(saved, decay, 0.4) == expected
    lines = [record.getMessage() for record in caplog.records]
    assert (lines == []) if said is None else (len(lines) == 1 and said in lines[0])


@pytest.mark.slow
def test_resuming_with_averaging_off_writes_best_from_the_plain_weights(tmp_path):
    common = ["train.iters=4", "train.val_interval=2", "train.ckpt_interval=2"]
    first = Trainer.from_config(_config(tmp_path, "run", *common), DistInfo(), progress=False)
    first.fit(stop_at=2)
    first.close()
    payload = load_checkpoint(tmp_path / "run" / "last.pt", required_keys=RESUME_KEYS)
    second = Trainer.from_config(_config(tmp_path, "run", *common, "train.ema_decay=0"), DistInfo(), resume=payload,
                                 progress=False)
    assert second.best_miou == -1.0 and second.parts.ema is None
    second.fit()
    current = second.model.state_dict()
    second.close()
    best = load_checkpoint(tmp_path / "run" / "best.pt")
    assert best["iteration"] == 4 and all(torch.equal(best["model"][name], current[name]) for name in current)
