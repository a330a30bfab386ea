"""Faults a long training meets, each a one-line error that keeps what was written: non-finite weights,
a full disk, a torn metrics.jsonl, a resume that changes the architecture or the config file, an
evaluation setting that cannot work, a fresh run into a finished run's folder."""
from __future__ import annotations

import errno
import importlib
import json

import pytest
import torch

import syncseg.engine.checkpoint_file
from syncseg.engine.checkpoint_file import load_checkpoint
from syncseg.engine.config import load_config
from syncseg.engine.distributed import DistInfo
from syncseg.engine.trainer import Trainer

TINY = [
    "data.synthetic_image_size=32", "data.crop_size=32", "data.synthetic_train_size=16", "data.synthetic_val_size=4",
    "data.num_workers=0", "model.backbone=resnet18", "model.head_channels=16", "model.aspp_rates=1",
    "train.batch_size=4", "train.warmup_iters=1", "train.log_interval=1", "eval.batch_size=4",
    "train.val_interval=1000", "train.ckpt_interval=1000",
]


def _train(*args: str, capsys) -> tuple[int, list[str]]:
    code = importlib.import_module("syncseg.commands.train").main(["--config", "demo.yaml", *TINY, *args])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    return code, errors


def _finite(path) -> bool:
    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    return all(torch.isfinite(tensor).all() for tensor in state.values() if tensor.is_floating_point())


@pytest.mark.slow
def test_a_diverging_run_saves_no_checkpoint_with_non_finite_tensors(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, errors = _train(f"output_dir={run_dir}", "train.lr=1e6", "train.iters=12", "train.ckpt_interval=1",
                          "train.amp=off", capsys=capsys)
    assert code == 1 and len(errors) == 1 and "non-finite" in errors[0], errors
    assert (run_dir / "last.pt").is_file()  # the first steps were still finite and saved
    assert _finite(run_dir / "last.pt")


def test_non_finite_weights_stop_before_saving_and_name_the_tensor(tmp_path):
    config = load_config("demo.yaml", [f"output_dir={tmp_path}", *TINY, "train.iters=3", "train.ckpt_interval=1"])
    trainer = Trainer.from_config(config, DistInfo(), progress=False)
    trainer.fit(stop_at=1)
    before = (tmp_path / "last.pt").read_bytes()
    with torch.no_grad():
        trainer.model.classifier.decoder[1].running_var[3] = float("inf")
    with pytest.raises(FloatingPointError, match=r"non-finite tensor classifier.decoder.1.running_var at iteration 1"):
        trainer.save(["last.pt"])
    trainer.close()
    assert (tmp_path / "last.pt").read_bytes() == before


def test_a_full_disk_is_one_line_naming_the_file_and_the_previous_checkpoint_stays(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    real_save, calls = torch.save, []

    def full_disk(obj, file, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second checkpoint: half written, then the disk is full
            file.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(syncseg.engine.checkpoint_file.torch, "save", full_disk)
    code, errors = _train(f"output_dir={run_dir}", "train.iters=4", "train.ckpt_interval=1", capsys=capsys)
    assert code == 1 and len(errors) == 1, errors
    assert f"could not write checkpoint '{run_dir / 'last.pt'}': No space left on device" in errors[0]
    assert load_checkpoint(run_dir / "last.pt")["iteration"] == 1  # the first save, intact
    assert not list(run_dir.glob(".*.tmp"))


@pytest.mark.slow
def test_resume_skips_a_torn_last_line_of_metrics_jsonl(tmp_path, capsys, caplog):
    run_dir = tmp_path / "run"
    assert _train(f"output_dir={run_dir}", "train.iters=4", "--stop-at", "2", capsys=capsys)[0] == 0
    with (run_dir / "metrics.jsonl").open("a") as file:
        file.write('{"type": "train", "iteration": 3, "lo')  # the process was killed mid-write
    with caplog.at_level("WARNING"):
        assert _train(f"output_dir={run_dir}", "train.iters=4", "--resume", "auto", capsys=capsys)[0] == 0
    assert any("metrics.jsonl: line 3 is not a JSON record" in record.getMessage() for record in caplog.records)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if r["type"] == "train"] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resume_errors_are_one_line_and_a_finished_run_is_never_replaced(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _train(f"output_dir={run_dir}", "train.iters=2", "train.val_interval=2", capsys=capsys)[0] == 0
    best = (run_dir / "best.pt").read_bytes()
    # a fresh run into the finished run's folder
    code, errors = _train(f"output_dir={run_dir}", "train.iters=2", capsys=capsys)
    assert code == 2 and len(errors) == 1 and "already holds a run" in errors[0] and "--overwrite" in errors[0]
    assert (run_dir / "best.pt").read_bytes() == best
    # a resume that changes the architecture
    code, errors = _train(f"output_dir={run_dir}", "train.iters=4", "model.head_channels=32", "--resume", "auto",
                          capsys=capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "does not fit the model" in errors[0] and "model.head_channels=16" in errors[0]
    assert (run_dir / "best.pt").read_bytes() == best


def test_an_evaluation_setting_the_dataset_cannot_serve_fails_at_start_up(tmp_path, capsys):
    from tests.data.conftest import make_voc_tree

    make_voc_tree(tmp_path / "voc")  # images of different sizes
    code, errors = _train(f"output_dir={tmp_path / 'run'}", "data.dataset=voc", f"data.root={tmp_path / 'voc'}",
                          "data.train_split=train", "eval.batch_size=2", "train.iters=2", capsys=capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "eval.batch_size=2 stacks several images per batch, but the images differ in size" in errors[0]
    assert "set eval.batch_size=1" in errors[0]
    assert not (tmp_path / "run" / "last.pt").exists()
