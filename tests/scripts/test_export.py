"""`python -m syncseg export`: the CLI on a checkpoint it is given (the formats' numerics: tests/engine/test_export.py)."""
from __future__ import annotations

import importlib
import json
import re
import sys
import zipfile

import pytest
import torch

from syncseg.engine.checkpoint_file import FORMAT_VERSION, load_checkpoint, save_checkpoint
from syncseg.engine.config import load_config, to_dict

TINY = ["model.backbone=resnet18", "model.head_channels=8", "model.aspp_rates=1,2,3", "data.crop_size=32"]


def _script():
    return importlib.import_module("syncseg.commands.export")


def _error_lines(capsys) -> list[str]:
    """stderr's lines, each an error line, without its HH:MM:SS stamp (which each must have)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d syncseg-export: error: ", line) for line in lines), lines
    return [line.split(" ", 1)[1] for line in lines]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from syncseg.model.builder import build_model

    config = load_config(None, TINY)
    torch.manual_seed(0)
    model = build_model(config.model, 3)
    path = tmp_path_factory.mktemp("ckpt") / "best.pt"
    save_checkpoint(path, {"format_version": FORMAT_VERSION, "model": model.state_dict(), "config": to_dict(config),
                           "classes": ["background", "a", "b"], "iteration": 5, "best_miou": 0.5})
    return path


def test_torchscript_beside_the_checkpoint_with_metadata_and_a_check(checkpoint, caplog):
    with caplog.at_level("INFO"):
        assert _script().main(["--checkpoint", str(checkpoint), "--format", "torchscript", "--size", "32,48"]) == 0
    output = checkpoint.with_name("best.torchscript.pt")
    with zipfile.ZipFile(output) as archive:
        name = next(n for n in archive.namelist() if n.endswith("extra/syncseg.json"))
        metadata = json.loads(archive.read(name))
    assert metadata["classes"] == ["background", "a", "b"] and metadata["mean"] == [0.485, 0.456, 0.406]
    messages = [record.getMessage() for record in caplog.records]
    assert any("checked against PyTorch" in m and "2x3x32x48, 1x3x24x60" in m for m in messages), messages


def test_safetensors_release_copy_reads_back_identical(checkpoint, tmp_path):
    output = tmp_path / "release.safetensors"
    assert _script().main(["--checkpoint", str(checkpoint), "--format", "safetensors", "--output", str(output)]) == 0
    original, release = load_checkpoint(checkpoint), load_checkpoint(output)
    assert release["classes"] == original["classes"] and release["best_miou"] == 0.5
    assert all(torch.equal(release["model"][k], v) for k, v in original["model"].items())


def test_onnx_without_onnxruntime_writes_the_file_and_says_it_was_not_checked(checkpoint, tmp_path, monkeypatch,
                                                                              caplog):
    import syncseg.engine.export_formats

    def fake_export(module, fmt, path, *, sample, metadata):  # the real exporter: tests/engine/test_export.py
        path.write_bytes(b"onnx")
        return "dynamic"

    monkeypatch.setattr(syncseg.engine.export_formats, "export_model", fake_export)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with caplog.at_level("WARNING"):
        assert _script().main(["--checkpoint", str(checkpoint), "--format", "onnx", "--output",
                               str(tmp_path / "m.onnx")]) == 0
    assert (tmp_path / "m.onnx").is_file()
    assert any("onnxruntime is not installed" in r.getMessage() and "not checked" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("args,fragment", [
    (["--size", "8,8"], "--size '8,8'"),
    (["--output", "{checkpoint}"], "is the checkpoint itself"),
])
def test_bad_arguments_are_one_line(checkpoint, args, fragment, capsys):
    args = [arg.replace("{checkpoint}", str(checkpoint)) for arg in args]
    assert _script().main(["--checkpoint", str(checkpoint), "--format", "torchscript", *args]) == 2
    error = _error_lines(capsys)
    assert len(error) == 1 and fragment in error[0]


def test_a_missing_checkpoint_names_it(tmp_path, capsys):
    assert _script().main(["--checkpoint", str(tmp_path / "nope.pt"), "--format", "onnx"]) == 2
    assert "nope.pt" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["torchscript", "exported", "onnx", "safetensors"])
def test_a_full_disk_is_one_line_naming_the_file_and_an_earlier_export_there_stays(checkpoint, small_disk, fmt,
                                                                                   capsys):
    # the tiny model's ~45 MB of weights on a 4 MiB filesystem: every format's real writer runs out of space
    from syncseg.engine.export_formats import SUFFIXES

    output = small_disk / f"model{SUFFIXES[fmt]}"
    output.write_bytes(b"an earlier export")
    assert _script().main(["--checkpoint", str(checkpoint), "--format", fmt, "--output", str(output),
                           "--size", "32,32"]) == 1
    what = "safetensors file" if fmt == "safetensors" else "export"
    assert _error_lines(capsys) == [f"syncseg-export: error: could not write {what} '{output}': No space left on "
                                    "device; the previous file there (if any) is unchanged"]
    assert output.read_bytes() == b"an earlier export"
    assert sorted(p.name for p in small_disk.iterdir()) == [output.name]  # no temporary file left


@pytest.mark.parametrize("fmt,name,fragment", [
    ("safetensors", "release.pt", "--output '{output}' ends in '.pt', not '.safetensors'"),
    ("safetensors", "release", "use a .safetensors name, e.g. '{folder}/release.safetensors'"),
    ("torchscript", "model.safetensors", "read as safetensors weights: use another name, e.g. "
                                         "'{folder}/model.torchscript.pt'"),
    ("exported", "x.exported", "ends in '.exported', but torch.export files must end in '.pt2': use e.g. "
                               "'{folder}/x.pt2'"),
])
def test_a_name_the_loaders_would_misread_is_refused_before_anything_is_written(checkpoint, tmp_path, capsys,
                                                                                 monkeypatch, fmt, name, fragment):
    import syncseg.engine.checkpoint_file
    import syncseg.engine.model_from_checkpoint

    def never(*args, **kwargs):
        raise AssertionError("read the checkpoint although the output name is refused")

    monkeypatch.setattr(syncseg.engine.checkpoint_file, "load_checkpoint", never)
    monkeypatch.setattr(syncseg.engine.model_from_checkpoint, "load_inference_model", never)
    folder = tmp_path / "out"
    output = folder / name
    assert _script().main(["--checkpoint", str(checkpoint), "--format", fmt, "--output", str(output)]) == 2
    (error,) = _error_lines(capsys)
    assert error.startswith(f"syncseg-export: error: --format {fmt}: ")
    assert fragment.format(output=output, folder=folder) in error
    assert not folder.exists()  # nothing written, not even the folder


def test_a_safetensors_file_that_does_not_read_back_is_removed(checkpoint, tmp_path, capsys, monkeypatch):
    import syncseg.engine.checkpoint_file

    real = syncseg.engine.checkpoint_file.load_checkpoint

    def corrupting(path, **kwargs):
        payload = real(path, **kwargs)
        if str(path).endswith(".safetensors"):
            first = next(iter(payload["model"]))
            payload["model"][first] = payload["model"][first] + 1
        return payload

    monkeypatch.setattr(syncseg.engine.checkpoint_file, "load_checkpoint", corrupting)
    output = tmp_path / "release.safetensors"
    assert _script().main(["--checkpoint", str(checkpoint), "--format", "safetensors", "--output", str(output)]) == 1
    assert _error_lines(capsys) == [f"syncseg-export: error: '{output}' does not hold the checkpoint's tensors; removed it"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["torchscript", "safetensors"])
def test_an_unwritable_output_names_the_path_before_reading_the_checkpoint(checkpoint, tmp_path, capsys,
                                                                           monkeypatch, fmt):
    import syncseg.engine.checkpoint_file
    import syncseg.engine.model_from_checkpoint

    def never(*args, **kwargs):
        raise AssertionError("read the checkpoint although the output cannot be written")

    monkeypatch.setattr(syncseg.engine.checkpoint_file, "load_checkpoint", never)
    monkeypatch.setattr(syncseg.engine.model_from_checkpoint, "load_inference_model", never)
    blocker = tmp_path / "file.txt"  # writing under a regular file fails, also as root (unlike chmod)
    blocker.write_text("not a folder")
    output = blocker / "sub" / f"model{'.safetensors' if fmt == 'safetensors' else '.pt'}"
    assert _script().main(["--checkpoint", str(checkpoint), "--format", fmt, "--output", str(output)]) == 1
    what = "safetensors file" if fmt == "safetensors" else "export"
    assert _error_lines(capsys) == [f"syncseg-export: error: could not write {what} '{output}': Not a directory: "
                                    f"'{blocker / 'sub'}'"]
    output = blocker / output.name  # in the regular file's place: mkdir says "File exists"
    assert _script().main(["--checkpoint", str(checkpoint), "--format", fmt, "--output", str(output)]) == 1
    assert _error_lines(capsys) == [f"syncseg-export: error: could not write {what} '{output}': '{blocker}' exists and is "
                                    "not a folder"]
