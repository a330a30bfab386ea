"""Trainer as its loop (syncseg/engine/trainer.py): what is due after each step, the losses read back, one stop
exception caught in fit, and the training_state module's resume and reseed. One process, in-process Trainers on a
tiny model; signals in the middle of PreciseBN, a validation or the grid: tests/engine/test_stop_between_steps.py;
under torchrun: tests/e2e/."""
from __future__ import annotations

import inspect
import json
import logging
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from syncseg.engine.checkpoint_file import RESUME_KEYS, load_checkpoint
from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.trainer import Due, StopTraining, Trainer, read_back_losses
from syncseg.engine.training_state import ResumePoint, reseed_for_world_size, resume_training, training_payload
from tests.engine.test_stop_between_steps import TIMING_FIELDS, TINY


def _config(run_dir: Path, *extra: str):
    return load_config("demo.yaml", [f"output_dir={run_dir}", *TINY, "train.num_vis_images=0", *extra])


def _trainer(run_dir: Path, *extra: str, resume: bool = False) -> Trainer:
    payload = load_checkpoint(run_dir / "last.pt", required_keys=RESUME_KEYS) if resume else None
    return Trainer.from_config(_config(run_dir, *extra), DistInfo(), resume=payload, progress=False)


def _records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if key.split("/")[-1] not in TIMING_FIELDS}
            for record in records]


class Train:
    iters, log_interval, ckpt_interval, val_interval = 10, 2, 4, 5


@pytest.mark.parametrize("iteration,stop_at,requested,expected", [
    # record, log, checkpoint, validate, stop
    (1, 10, False, (False, False, False, False, False)),
    (2, 10, False, (True, True, False, False, False)),
    (4, 10, False, (True, True, True, False, False)),
    (5, 10, False, (True, False, False, True, False)),
    (3, 3, False, (True, False, True, False, False)),   # the fit's last step writes last.pt
    (10, 10, False, (True, True, True, True, False)),   # the run's end validates and writes last.pt
    (3, 10, True, (True, False, True, False, True)),    # an agreed stop before stop_at writes last.pt and stops
    (3, 3, True, (True, False, True, False, False)),    # ... but at stop_at the fit ends anyway
    (5, 10, True, (True, False, True, True, True)),     # a stop keeps the due validation, to leave it due
])
def test_what_is_due_after_a_step(iteration, stop_at, requested, expected):
    due = Due.after(iteration, Train, stop_at=stop_at, stop_requested=requested)
    assert (due.record, due.log, due.checkpoint, due.validate, due.stop) == expected


def test_losses_are_read_back_at_once_and_a_non_finite_one_names_its_iteration(tmp_path):
    pending = [(1, torch.tensor(0.5)), (2, torch.tensor(0.25, dtype=torch.float64))]
    assert read_back_losses(pending, run_dir=tmp_path) == {1: 0.5, 2: 0.25} and pending == []
    assert read_back_losses(pending, run_dir=tmp_path) == {}
    pending = [(3, torch.tensor(1.0)), (4, torch.tensor(math.inf))]
    with pytest.raises(FloatingPointError, match=r"non-finite loss \(inf\) at iteration 4; .*No checkpoint was "
                                                 r"written yet"):
        read_back_losses(pending, run_dir=tmp_path)
    assert len(pending) == 2  # kept: nothing was taken as read


def test_a_fit_in_parts_is_an_uninterrupted_fit(tmp_path):
    whole = _trainer(tmp_path / "whole")
    try:
        result = whole.fit()
    finally:
        whole.close()
    assert result.reason == "finished" and result.iteration == 4 and sorted(result.losses) == [1, 2, 3, 4]
    assert result.last_val is not None and result.best_miou >= result.last_val["miou"]  # validated at 2 and 4

    parts = _trainer(tmp_path / "parts")
    try:
        first, second = parts.fit(stop_at=3), parts.fit()
    finally:
        parts.close()
    assert (first.reason, first.iteration, second.reason, second.iteration) == ("stopped", 3, "finished", 4)
    assert {**first.losses, **second.losses} == result.losses  # the same data stream and weights, bit for bit
    assert _records(tmp_path / "parts") == _records(tmp_path / "whole")


def test_a_signal_ends_fit_with_one_exception_caught_there_and_a_resume_continues_exactly(tmp_path, monkeypatch):
    reference = _trainer(tmp_path / "reference")
    try:
        uninterrupted = reference.fit()
    finally:
        reference.close()

    run_dir = tmp_path / "run"
    trainer = _trainer(run_dir)
    step, raised = trainer.train_step, []

    def signalling(micro_batches):
        loss = step(micro_batches)
        if trainer.iteration == 2:  # during step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    stop_here = trainer._stop_here

    def recording(**kwargs):
        try:
            stop_here(**kwargs)
        except StopTraining as error:
            raised.append(error)
            raise

    trainer.train_step, trainer._stop_here = signalling, recording
    try:
        stopped = trainer.fit()  # returns: fit catches the one StopTraining
    finally:
        trainer.close()
    assert len(raised) == 1
    assert (stopped.reason, stopped.signal, stopped.iteration) == ("signal", signal.SIGTERM, 3)
    saved = load_checkpoint(run_dir / "last.pt", required_keys=RESUME_KEYS)
    assert saved["iteration"] == 3 and saved["validation_due"] is False

    resumed = _trainer(run_dir, resume=True)
    try:
        assert resumed.iteration == 3
        rest = resumed.fit()
    finally:
        resumed.close()
    assert rest.reason == "finished" and {**stopped.losses, **rest.losses} == uninterrupted.losses
    assert _records(run_dir) == _records(tmp_path / "reference")


def test_the_payload_and_the_resume_point_round_trip(tmp_path):
    trainer = _trainer(tmp_path / "run", "train.iters=2", "train.val_interval=100")
    try:
        trainer.fit()
        payload = trainer.state_dict()
    finally:
        trainer.close()
    assert set(RESUME_KEYS) - {"rng"} <= set(payload) and payload["iteration"] == 2
    assert payload["validation_due"] is False and payload["epoch"] == 2 // trainer.parts.sampler.batches_per_epoch
    again = training_payload(trainer.parts, iteration=2, best_miou=trainer.best_miou, run_id=trainer.run_id,
                             overrides={}, validation_due=False)
    assert again.keys() == payload.keys()
    assert all(again[key] == payload[key] for key in ("format_version", "config", "classes", "iteration", "epoch",
                                                      "best_miou", "scheduler", "scaler", "run_id", "overrides"))
    assert all(torch.equal(again["model"][key], value) for key, value in payload["model"].items())

    fresh = _trainer(tmp_path / "fresh", "train.iters=2", "train.val_interval=100")
    try:
        saved = load_checkpoint(tmp_path / "run" / "last.pt", required_keys=RESUME_KEYS)
        saved = {**saved, "best_miou": 0.25, "validation_due": True}
        point = resume_training(fresh.parts, saved, checkpointer=fresh.checkpointer)
        assert point == ResumePoint(2, 0.25, True)
        for key, value in fresh.parts.model.state_dict().items():
            assert torch.equal(value, saved["model"][key]), key
        assert fresh.parts.scheduler.state_dict() == saved["scheduler"]
    finally:
        fresh.close()


def test_a_resume_by_another_number_of_processes_is_reseeded_and_says_so(tmp_path, caplog):
    config = _config(tmp_path)
    caplog.set_level(logging.INFO, logger="syncseg.engine.training_state")
    reseed_for_world_size(config, DistInfo(), iteration=7, saved_world_size=4)
    first = torch.rand(3)
    assert any("4" in record.getMessage() for record in caplog.records)  # describe_world_change's line
    reseed_for_world_size(config, DistInfo(), iteration=7, saved_world_size=0)
    assert torch.equal(torch.rand(3), first)  # a function of (train.seed, rank, iteration) only
    assert "holds no RNG states" in caplog.records[-1].getMessage()
    reseed_for_world_size(config, DistInfo(), iteration=8, saved_world_size=0)
    assert not torch.equal(torch.rand(3), first)


def test_the_trainer_stays_its_loop():
    """docs/design.md: the class holds the loop; the payload, resume, validation logging and records live in their
    modules. A class past 180 lines is growing rooms of its own again."""
    source = inspect.getsource(Trainer)
    assert len(source.splitlines()) <= 180, f"Trainer is {len(source.splitlines())} lines"
    assert "except StopTraining" in inspect.getsource(Trainer.fit) and source.count("except StopTraining") == 1
