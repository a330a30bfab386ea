"""build_training: the parts a Trainer runs, each built once from the config."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from syncseg.engine.build import build_training
from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.samplers import train_steps
from syncseg.engine.seeding import capture_rng_state, mix_seed
from syncseg.engine.trainer import Trainer

TINY = [
    "data.synthetic_image_size=32", "data.crop_size=32", "data.synthetic_train_size=16", "data.synthetic_val_size=2",
    "data.num_workers=0", "model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1",
    "train.batch_size=4", "train.num_vis_images=0",
]


def _parts(tmp_path, *overrides: str):
    return build_training(load_config("demo.yaml", [f"output_dir={tmp_path}", *TINY, *overrides]), DistInfo())


def test_parts_follow_the_config(tmp_path):
    parts = _parts(tmp_path, "train.accumulate=2", "train.amp=off", "train.head_lr_mult=10", "train.lr=0.01")
    assert parts.train_model is parts.model and parts.forward_model is parts.model  # one process, no compile
    assert parts.sampler.accumulate == 2 and len(parts.classes) == 6
    assert parts.precision == "off" and not parts.scaler.is_enabled()
    rates = {group["name"]: group["lr"] for group in parts.optimizer.param_groups}
    assert rates == {"backbone": pytest.approx(0.01 / 30), "head": pytest.approx(0.1 / 30)}  # warmup step 1 of 30
    steps = train_steps(parts.train_loader, 0)
    micro_batches = next(steps)  # the step groups the sampler's micro-batches (train.accumulate read once)
    assert len(micro_batches) == 2 and [images.shape[0] for images, _ in micro_batches] == [2, 2]
    steps.close()


def test_training_sets_its_precisions_tf32_flags_process_wide(tmp_path, monkeypatch):
    """The backward runs outside autocast_for, so build_training sets train.amp's TF32 choice for the process."""
    from syncseg.engine import build

    applied = []
    monkeypatch.setattr(build, "apply_fp32_precision", lambda chosen, device: applied.append((chosen, device.type)))
    _parts(tmp_path, "train.amp=tf32")
    assert applied == [("off", "cpu")]  # a CPU has no TF32: it runs (and logs) as fp32


@pytest.mark.parametrize("channels_last", [True, False])
def test_channels_last_is_the_model_builders_alone(tmp_path, channels_last):
    """build_model converts the weights and DeepLab the input; the trainer converts nothing, and a step
    trains the same either way."""
    parts = _parts(tmp_path, f"model.channels_last={str(channels_last).lower()}", "train.amp=off")
    conv = parts.model.backbone.conv1.weight if hasattr(parts.model.backbone, "conv1") else next(
        module.weight for module in parts.model.modules() if isinstance(module, nn.Conv2d))
    assert conv.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert parts.model.channels_last == channels_last


@pytest.mark.parametrize("amp,expected", [("bf16", True), ("off", False)])
def test_auto_channels_last_follows_train_amp(tmp_path, amp, expected):
    parts = _parts(tmp_path, "model.channels_last=auto", f"train.amp={amp}")
    assert parts.model.channels_last is expected
    assert parts.model.backbone.conv1.weight.is_contiguous(memory_format=torch.channels_last) is expected


def test_trainer_state_round_trips_through_load_state_dict(tmp_path):
    """Trainer.state_dict / load_state_dict are one pair: a new trainer loaded from the state continues with
    the same weights, optimizer, schedule and iteration."""
    config = load_config("demo.yaml", [f"output_dir={tmp_path}", *TINY, "train.amp=off", "train.val_interval=100",
                                       "train.ckpt_interval=100", "train.log_interval=1"])
    first = Trainer.from_config(config, DistInfo(), progress=False)
    first.fit(stop_at=2)
    state = first.state_dict()
    state["rng"] = {"per_rank": []}  # no RNG states to restore: reseeded (a warning)
    first.close()
    second = Trainer(build_training(config, DistInfo(), init_weights=False), resume=state, progress=False)
    assert second.iteration == 2 and second.parts.scheduler.iteration == 2
    for name, tensor in second.model.state_dict().items():
        assert torch.equal(tensor, state["model"][name]), name
    assert second.optimizer.state_dict()["state"].keys() == state["optimizer"]["state"].keys()
    assert second.state_dict()["iteration"] == 2 and second.state_dict()["best_miou"] == state["best_miou"]
    second.close()


def test_a_resume_by_another_world_size_reseeds_and_says_what_changed(tmp_path, caplog):
    """RNG states saved by 2 processes cannot be dealt out to 1: its streams come from (seed, rank, iteration),
    and one INFO line says what the new split changes and keeps."""
    config = load_config("demo.yaml", [f"output_dir={tmp_path}", *TINY, "train.amp=off"])
    first = Trainer.from_config(config, DistInfo(), progress=False)
    state = first.state_dict()
    first.close()
    state["iteration"] = 3
    state["rng"] = {"per_rank": [capture_rng_state(), capture_rng_state()]}
    with caplog.at_level(logging.INFO, logger="syncseg.engine.training_state"):
        second = Trainer(build_training(config, DistInfo(), init_weights=False), resume=state, progress=False)
    assert torch.initial_seed() == mix_seed(config.train.seed, "train", 0, 3)
    assert ("resumed from world size 2 at world size 1: per-device batch 4 (was 2), global batch 4 unchanged; data "
            "order unchanged") in caplog.text
    assert "BN statistics still those of the whole (micro-)batch" in caplog.text
    second.close()


def test_a_bad_mask_value_stops_training_before_the_batch_reaches_the_device(tmp_path, monkeypatch):
    """The loss checks mask values only where that costs no host synchronization, so on CUDA a value outside
    the classes reached cross-entropy as a device-side assert (every later CUDA call fails). The loss is made
    to skip its check as on CUDA; the batch must be refused on the CPU, before the model runs, with the
    loss's own one-line error."""
    from syncseg.engine import loss

    monkeypatch.setattr(loss, "mask_check_is_free", lambda device: False, raising=False)  # as on CUDA
    config = load_config("demo.yaml", [f"output_dir={tmp_path}", *TINY, "train.amp=off", "train.val_interval=100",
                                       "train.ckpt_interval=100", "train.precise_bn_batches=0"])
    trainer = Trainer.from_config(config, DistInfo(), progress=False)
    dataset_class = type(trainer.parts.train_set)
    original = dataset_class.__getitem__

    def with_a_bad_value(self, index):
        image, mask = original(self, index)
        mask = mask.clone()
        mask[0, 0] = 9  # the demo has 6 classes
        return image, mask

    monkeypatch.setattr(dataset_class, "__getitem__", with_a_bad_value)
    forwards = []
    trainer.model.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=r"^mask value 9 is not a class index in 0\.\.5 nor ignore_index=255$"):
            trainer.fit(stop_at=1)
    finally:
        trainer.close()
    assert forwards == []  # refused in the loader, not by the loss after the forward


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_masks_travel_as_uint8_and_train_as_the_int64_masks_do(tmp_path, accumulate):
    """The training loader keeps masks uint8 (labels fit in 8 bits) and Trainer.train_step widens them on the
    device: the step's loss and every gradient equal those of the same batch with int64 masks, bit for bit,
    also through the multi-micro-batch normalizer. (The public dataset default stays int64.)"""
    config = load_config("demo.yaml", [f"output_dir={tmp_path}", *TINY, "train.amp=off", f"train.accumulate={accumulate}"])
    trainer = Trainer.from_config(config, DistInfo(), progress=False)
    try:
        steps = train_steps(trainer.parts.train_loader, 0)
        micro_batches = next(steps)
        steps.close()
        assert all(masks.dtype == torch.uint8 for _, masks in micro_batches)
        assert any(bool((masks == 255).any()) for _, masks in micro_batches)  # crop padding: the ignore label
        start = {key: value.clone() for key, value in trainer.model.state_dict().items()}
        results = []
        for batches in (micro_batches, [(images, masks.long()) for images, masks in micro_batches]):
            trainer.model.load_state_dict(start)
            torch.manual_seed(0)  # dropout draws alike
            loss = trainer.train_step(batches)
            results.append((float(loss), {name: p.grad.clone() for name, p in trainer.model.named_parameters()
                                          if p.grad is not None}))
    finally:
        trainer.close()
    (compact_loss, compact_grads), (wide_loss, wide_grads) = results
    assert compact_loss == wide_loss and compact_grads.keys() == wide_grads.keys() and len(wide_grads) > 50
    assert all(torch.equal(compact_grads[name], wide_grads[name]) for name in wide_grads)


def test_validation_masks_travel_as_uint8_and_count_as_the_int64_masks_do(tmp_path):
    """The trainer's validation loader (and eval.py's, built the same way) keeps masks uint8; evaluate() counts
    them on the device as they are: every metric equals that of the same batches with int64 masks."""
    from syncseg.engine.evaluate import evaluate

    parts = _parts(tmp_path)
    batches = list(parts.val_loader)
    assert batches and all(masks.dtype == torch.uint8 for _, masks in batches)
    assert any(bool((masks > 0).any()) for _, masks in batches)  # not all background
    results = []
    for loader in (batches, [(images, masks.long()) for images, masks in batches]):
        results.append(evaluate(parts.eval_model, loader, num_classes=len(parts.classes), device="cpu",
                                data_cfg=parts.config.data, eval_cfg=parts.config.eval, progress=False))
    ignore = parts.config.data.ignore_index
    assert results[0] == results[1]
    assert results[0]["num_pixels"] == sum(int((masks != ignore).sum()) for _, masks in batches)
