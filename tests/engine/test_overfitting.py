"""Overfitting shows (issue 32 item 3): OverfittingWatch fed (training loss, val mIoU) sequences warns once, when
the loss is under 1% of its start and validation made no new best for 2 validations; and the Trainer logs it
once, with best.pt still the best validation."""
from __future__ import annotations

import logging

import pytest

from syncseg.engine.overfitting import ADVICE, LOSS_FRACTION, PATIENCE, OverfittingWatch


def _feed(watch: OverfittingWatch, schedule: list[tuple[float, float | None]]) -> list[tuple[int, str]]:
    """(iteration, warning) for a schedule of (step loss, val mIoU or None: no validation after that step)."""
    warnings = []
    for iteration, (loss, miou) in enumerate(schedule, 1):
        watch.add_losses({iteration: loss})
        if miou is not None:
            warning = watch.after_validation(iteration, miou)
            if warning is not None:
                warnings.append((iteration, warning))
    return warnings


def test_constants_are_the_documented_ones():
    assert (LOSS_FRACTION, PATIENCE) == (0.01, 2)


def test_memorizing_while_validation_stalls_warns_once_naming_the_keys_that_help():
    watch = OverfittingWatch(start_steps=2, recent_steps=2)
    schedule = [(2.0, None), (2.0, 0.20), (0.5, 0.30), (0.05, 0.35),  # both still improving
                (0.015, 0.34), (0.015, 0.33),  # two validations without a best, the loss at 0.75% of its start
                (0.01, 0.30), (0.005, 0.31), (0.001, 0.2)]  # still so: said once only
    warnings = _feed(watch, schedule)
    assert [iteration for iteration, _ in warnings] == [6]
    message = warnings[0][1]
    assert message.startswith("overfitting: at iteration 6 the training loss (0.015) is 0.75% of its start (2), but "
                              "val mIoU has made no new best for 2 validations (best 0.3500 since iteration 4; "
                              "best.pt holds it)")
    assert message.endswith(ADVICE)
    for key in ("data.scale_range", "data.hflip", "data.rot90", "data.crop_size", "train.weight_decay",
                "model.aspp_dropout",
                "train.iters", "configs/small_data.yaml"):
        assert key in message


@pytest.mark.parametrize("schedule", [
    # the loss falls under 1% but validation keeps improving: learning, not memorizing
    [(2.0, None), (2.0, 0.1), (0.01, 0.2), (0.01, 0.3), (0.01, 0.4), (0.005, 0.5)],
    # validation stalls but the loss stays above 1% of its start: no sign of memorizing
    [(2.0, None), (2.0, 0.3), (0.03, 0.2), (0.03, 0.2), (0.021, 0.2), (0.021, 0.1)],
    # one validation without a best is not enough
    [(2.0, None), (2.0, 0.3), (0.001, 0.4), (0.001, 0.3), (0.001, 0.5), (0.001, 0.4)],
], ids=["still-improving", "loss-not-low-enough", "one-flat-validation"])
def test_no_warning_without_both_signs(schedule):
    assert _feed(OverfittingWatch(start_steps=2, recent_steps=2), schedule) == []


def test_the_start_and_recent_losses_are_window_means_and_a_resume_brings_its_best():
    watch = OverfittingWatch(best_miou=0.6, start_steps=3, recent_steps=2)
    watch.add_losses({2: 4.0, 1: 2.0})  # any order within a call
    watch.add_losses({3: 3.0, 4: 0.02, 5: 0.01})
    assert watch.start_loss == pytest.approx(3.0) and watch.recent_loss == pytest.approx(0.015)
    assert watch.after_validation(5, 0.5) is None  # below the resumed best: one validation without a best
    warning = watch.after_validation(6, 0.55)
    assert warning is not None and "no new best for 2 validations (best 0.6000; best.pt holds it)" in warning


def test_the_trainer_logs_it_once_and_best_pt_stays_the_best_validation(tmp_path, caplog, monkeypatch):
    """The Trainer's wiring, with the steps' losses and the validations' mIoU scripted (a real run that memorizes
    takes minutes on 2 CPU cores): the warning is logged once, at the first validation where both signs
    hold, and best.pt is the best validation's, not the last one's."""
    import torch

    from syncseg.engine.checkpoint_file import load_checkpoint
    from syncseg.engine.config import load_config
    from syncseg.engine.distributed import DistInfo
    from syncseg.engine.trainer import Trainer
    from tests.e2e.common import TINY_BASE

    config = load_config("demo.yaml", [*TINY_BASE, "data.synthetic_val_size=2", "model.aux_loss=false",
                                       "train.iters=30", "train.val_interval=5", "train.ckpt_interval=1000",
                                       "train.log_interval=5", "train.num_vis_images=0", "train.amp=off",
                                       "eval.amp=off", f"output_dir={tmp_path / 'run'}"])
    losses = [2.0] * 3 + [0.5] * 7 + [0.01] * 20  # the start: 2 (the first 3 steps); from step 11 on: 0.5% of it
    mious = {5: 0.20, 10: 0.35, 15: 0.30, 20: 0.33, 25: 0.34, 30: 0.31}  # the best at 10; warned at 20, once
    trainer = Trainer.from_config(config, DistInfo(), progress=False)
    monkeypatch.setattr(trainer, "train_step", lambda micro_batches: torch.tensor(losses[trainer.iteration]))
    monkeypatch.setattr("syncseg.engine.trainer.validate_during_training",
                        lambda parts, **kwargs: {"miou": mious[kwargs["iteration"]]})
    with caplog.at_level(logging.WARNING, logger="syncseg.engine.trainer"):
        try:
            trainer.fit()
        finally:
            trainer.close()
    said = [record.getMessage() for record in caplog.records if record.getMessage().startswith("overfitting:")]
    assert len(said) == 1 and said[0].startswith("overfitting: at iteration 20 the training loss (0.01) is 0.5% of "
                                                 "its start (2), but val mIoU has made no new best for 2 "
                                                 "validations (best 0.3500 since iteration 10"), said
    best = load_checkpoint(tmp_path / "run" / "best.pt")
    assert (best["iteration"], best["best_miou"], best["metrics"]) == (10, 0.35, {"miou": 0.35})
