"""A stop between steps (issue 34): a signal during PreciseBN, a validation or the TensorBoard grid is answered
within a batch and saved; a stop that skips or cuts short a due validation leaves it due in last.pt, and the
resume runs it first (PreciseBN recomputed), so metrics.jsonl and best.pt are an uninterrupted run's.

One process, in-process Trainers on a tiny model; the signal is sent to this process from inside the call it
is about (a step, a PreciseBN batch, a validation batch, a grid image), as tests/e2e/test_stop.py does under
torchrun.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

import syncseg.engine.evaluate
import syncseg.engine.precise_bn
import syncseg.engine.visualize
from syncseg.engine.checkpoint_file import RESUME_KEYS, load_checkpoint
from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.trainer import Trainer

TINY = ["data.synthetic_image_size=32", "data.crop_size=32", "data.synthetic_train_size=16",
        "data.synthetic_val_size=4", "data.num_workers=0", "model.backbone=resnet18", "model.head_channels=8",
        "model.aspp_rates=1", "model.aux_loss=false", "model.channels_last=false", "train.batch_size=4",
        "train.warmup_iters=1", "train.amp=off", "eval.amp=off", "eval.batch_size=1", "train.iters=4",
        "train.val_interval=2", "train.ckpt_interval=100", "train.log_interval=1", "train.num_vis_images=3"]
TIMING_FIELDS = ("images_per_s", "data_wait_fraction", "peak_memory_mb")
# where a signal can come: the function called once per step / batch / image there (module, attribute)
HOOKS = {"precise_bn": (syncseg.engine.precise_bn, "normalize_batch"),
         "validation": (syncseg.engine.evaluate, "predict_batch"),
         "grid": (syncseg.engine.visualize, "predict_batch")}


def _train(run_dir: Path, extra: tuple[str, ...], monkeypatch=None, *, where: str = "", count: int = 0,
           signals: tuple[int, ...] = (signal.SIGTERM,), resume: bool = False) -> dict:
    """Train (or resume) in `run_dir`, sending `signals` from inside call `count` of `where` at iteration 2;
    returns the result and the times of every call of `where` and of the signal, fit's return and saves."""
    config = load_config("demo.yaml", [f"output_dir={run_dir}", *TINY, *extra])
    payload = load_checkpoint(run_dir / "last.pt", required_keys=RESUME_KEYS) if resume else None
    trainer = Trainer.from_config(config, DistInfo(), resume=payload, progress=False)
    seen = {"calls": [], "signal": None, "saves": []}

    def signalling(function):
        def wrapped(*args, **kwargs):
            if trainer.iteration == 2 or where == "step":
                seen["calls"].append(time.perf_counter())
            value = function(*args, **kwargs)
            if len(seen["calls"]) == count and seen["signal"] is None:
                seen["signal"] = time.perf_counter()
                for signum in signals:  # an impatient user: Ctrl-C twice
                    os.kill(os.getpid(), signum)
            return value
        return wrapped

    def timed(function):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            function(*args, **kwargs)
            seen["saves"].append((start, time.perf_counter()))
        return wrapped

    if where == "step":
        trainer.train_step = signalling(trainer.train_step)
    elif where:
        module, name = HOOKS[where]
        monkeypatch.setattr(module, name, signalling(getattr(module, name)))
    trainer.checkpointer.save = timed(trainer.checkpointer.save)
    try:
        seen["result"] = trainer.fit()
        seen["returned"] = time.perf_counter()
    finally:
        trainer.close()
        if monkeypatch is not None:
            monkeypatch.undo()
    return seen


def _records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if key not in TIMING_FIELDS} for record in records]


def _assert_same_run(run_dir: Path, reference: Path) -> None:
    """metrics.jsonl (timings aside), best.pt and the final last.pt's weights equal the reference run's."""
    assert _records(run_dir) == _records(reference)
    for name in ("best.pt", "last.pt"):
        ours, theirs = (torch.load(folder / name, map_location="cpu", weights_only=True) for folder in (run_dir, reference))
        assert ours["iteration"] == theirs["iteration"] and ours.get("metrics") == theirs.get("metrics")
        for key in ("model", "ema"):
            assert ours.get(key, {}).keys() == theirs.get(key, {}).keys()
            for tensor_name, tensor in ours.get(key, {}).items():  # running statistics included: PreciseBN's
                assert torch.equal(tensor, theirs[key][tensor_name]), (name, key, tensor_name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """extra overrides -> the run dir of an uninterrupted run with them (one run per `extra`, shared)."""
    runs: dict[tuple[str, ...], Path] = {}

    def run_dir(extra: tuple[str, ...]) -> Path:
        if extra not in runs:
            runs[extra] = tmp_path_factory.mktemp("uninterrupted")
            _train(runs[extra], extra)
        return runs[extra]
    return run_dir


def _stopped_and_resumed(tmp_path: Path, extra: tuple[str, ...], monkeypatch, reference: Path, **stop) -> dict:
    """Stop at iteration 2 as `stop` says, check last.pt holds iteration 2 with its validation due, resume and
    compare with the uninterrupted run in `reference`."""
    stopped = _train(tmp_path / "run", extra, monkeypatch, **stop)
    result = stopped["result"]
    assert result.reason == "signal" and result.iteration == 2 and result.signal == stop.get("signals", [15])[0]
    last = load_checkpoint(tmp_path / "run" / "last.pt", required_keys=RESUME_KEYS)
    assert last["iteration"] == 2 and last["validation_due"]
    assert not [record for record in _records(tmp_path / "run") if record.get("type") == "val"]
    resumed = _train(tmp_path / "run", extra, monkeypatch, resume=True)
    assert resumed["result"].reason == "finished" and resumed["result"].iteration == 4
    _assert_same_run(tmp_path / "run", reference)
    return stopped


PRECISE_BN = ("train.precise_bn_batches=3",)


@pytest.mark.slow
@pytest.mark.parametrize("where, count, extra", [
    ("step", 2, ()), ("step", 2, PRECISE_BN), ("step", 2, (*PRECISE_BN, "train.ema_decay=0.5")), ("grid", 1, ()),
], ids=["step", "step_precise_bn", "step_precise_bn_ema", "grid"])
def test_a_stop_that_skips_or_ends_a_due_validation_leaves_it_due_for_the_resume(tmp_path, monkeypatch, uninterrupted,
                                                                                 where, count, extra):
    # "step": the signal comes inside step 2, which is due to validate; before, last.pt said validation_due
    # false and iteration 2 was never validated. "grid": rank 0 draws it alone and stops at its next image;
    # every process agrees after it (before, the validation was logged and the run stopped a step later).
    stopped = _stopped_and_resumed(tmp_path, extra, monkeypatch, uninterrupted(extra), where=where, count=count)
    assert len(stopped["calls"]) == count  # nothing more of that loop ran


@pytest.mark.slow
def test_a_stop_during_precise_bn_is_answered_within_a_batch_even_after_a_second_ctrl_c(tmp_path, monkeypatch,
                                                                                        uninterrupted):
    # 20 PreciseBN batches of the averaged weights, two SIGINTs inside the 4th: before, the pass ran to its
    # end and the second SIGINT raised KeyboardInterrupt (exit 130, no last.pt). The pass ends with the
    # statistics it found; the resume recomputes them.
    extra = ("train.precise_bn_batches=20", "train.ema_decay=0.5")
    stopped = _stopped_and_resumed(tmp_path, extra, monkeypatch, uninterrupted(extra), where="precise_bn", count=4,
                                   signals=(signal.SIGINT, signal.SIGINT))
    calls = stopped["calls"]
    assert len(calls) == 4  # the 4th batch finished, the 5th never began
    batch_seconds = max(later - earlier for earlier, later in zip(calls, calls[1:]))
    save_seconds = sum(end - start for start, end in stopped["saves"] if start >= stopped["signal"])
    signal_to_return = stopped["returned"] - stopped["signal"]
    # about one batch plus the save; the 16 batches left would take ~16 batch times more
    assert signal_to_return <= save_seconds + 3 * batch_seconds, (signal_to_return, save_seconds, batch_seconds)
