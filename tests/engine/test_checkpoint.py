"""syncseg.engine.checkpoint_file (atomic save, checked load, weight files) and its users: the best.pt subset
(training_state), loading for inference (model_from_checkpoint), fine-tuning (build.init_from_weights), strict
loading (model.weights)."""
from __future__ import annotations

import errno
import os
import stat

import pytest
import torch
from torch import nn

from syncseg.engine.build import init_from_weights
from syncseg.engine.checkpoint_file import FORMAT_VERSION, load_checkpoint, load_weights_file, save_checkpoint
from syncseg.engine.config import Config, ModelConfig
from syncseg.engine.config import from_dict, load_config, to_dict
from syncseg.engine.model_from_checkpoint import load_inference_model
from syncseg.model.builder import build_model
from syncseg.model.weights import load_model_weights


def _payload(model: nn.Module) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return {
        "format_version": FORMAT_VERSION,
        "model": model.state_dict(),
        "config": to_dict(Config()),
        "classes": ["background", "thing"],
        "iteration": 7,
        "epoch": 1,
        "best_miou": 0.25,
        "optimizer": optimizer.state_dict(),
        "scheduler": {"last_epoch": 7},
        "scaler": {},
        "rng": {"torch": torch.get_rng_state()},
    }


def test_roundtrip_loads_with_weights_only(tmp_path):
    model = nn.Linear(3, 2)
    payload = _payload(model)
    path = tmp_path / "sub" / "last.pt"
    save_checkpoint(path, payload)
    raw = torch.load(path, map_location="cpu", weights_only=True)  # the DESIGN contract, independently
    loaded = load_checkpoint(path)
    for result in (raw, loaded):
        assert set(result) == set(payload)
        for key, value in payload["model"].items():
            assert torch.equal(result["model"][key], value)
        assert from_dict(result["config"]) == Config()
        assert torch.equal(result["rng"]["torch"], payload["rng"]["torch"])
        assert result["optimizer"]["state"].keys() == payload["optimizer"]["state"].keys()
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temporary left behind


def test_failed_save_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "best.pt"
    save_checkpoint(path, {"format_version": 1, "model": {"w": torch.ones(3)}, "config": {}, "classes": []})
    before = path.read_bytes()

    def broken_save(obj, file, *args, **kwargs):
        file.write(b"partial garbage")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"format_version": 1, "model": {"w": torch.zeros(3)}, "config": {}, "classes": []})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(3))


def test_a_disk_that_fills_up_mid_save_is_the_oserror_naming_the_file(small_disk):
    # torch.save's zip writer hides the OSError of a failed write and raises "[enforce fail at
    # inline_container.cc] unexpected pos ..." instead; the user must see the disk error and the file
    path = small_disk / "last.pt"
    save_checkpoint(path, {"format_version": 1, "model": {"w": torch.ones(3)}, "config": {}, "classes": []})
    before = path.read_bytes()
    with pytest.raises(OSError) as raised:  # 8 MB of weights on a 4 MiB disk
        save_checkpoint(path, {"format_version": 1, "model": {"w": torch.zeros(2_000_000)}, "config": {},
                               "classes": []})
    assert raised.value.errno == errno.ENOSPC
    assert str(raised.value) == (f"[Errno {errno.ENOSPC}] could not write checkpoint '{path}': No space left on "
                                 "device; the previous file there (if any) is unchanged")
    assert path.read_bytes() == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["last.pt"]  # the temporary file is gone


def test_missing_file_names_path(tmp_path):
    path = tmp_path / "nope.pt"
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_checkpoint(path)


def test_truncated_file_is_value_error(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(path, _payload(nn.Linear(3, 2)))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="last.pt"):
        load_checkpoint(path)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="last.pt"):
        load_checkpoint(path)


def test_missing_keys_and_newer_version(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"format_version": 1, "model": {}}, path)
    with pytest.raises(ValueError, match="config, classes"):
        load_checkpoint(path)
    assert load_checkpoint(path, required_keys=("model",))["model"] == {}
    torch.save({"format_version": FORMAT_VERSION + 1, "model": {}, "config": {}, "classes": []}, path)
    with pytest.raises(ValueError, match="format_version"):
        load_checkpoint(path)
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match="x.pt"):
        load_checkpoint(path)


def test_unloadable_payload_rejected_before_writing(tmp_path):
    class Opaque:
        pass

    path = tmp_path / "bad.pt"
    with pytest.raises(ValueError, match=r"payload.rng.numpy"):
        save_checkpoint(path, {"format_version": 1, "rng": {"numpy": Opaque()}})
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_load_model_weights_is_strict_with_a_one_line_reason():
    source = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    target = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    saved, asked = ModelConfig(), ModelConfig(backbone="resnet18")
    load_model_weights(target, source.state_dict(), checkpoint="c.pt", saved_model_cfg=saved, model_cfg=saved)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))
    wider = nn.Sequential(nn.Conv2d(3, 5, 1), nn.BatchNorm2d(5))
    with pytest.raises(ValueError, match=r"c.pt.*model.backbone=resnet50.*model.backbone=resnet18.*shape mismatch") as error:
        load_model_weights(wider, source.state_dict(), checkpoint="c.pt", saved_model_cfg=saved, model_cfg=asked)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="1 missing tensor.*1.weight"):
        load_model_weights(target, {k: v for k, v in source.state_dict().items() if k != "1.weight"},
                           checkpoint="c.pt", saved_model_cfg=saved, model_cfg=saved)
    with pytest.raises(ValueError, match="unexpected tensor.*extra"):
        load_model_weights(target, {**source.state_dict(), "extra": torch.zeros(1)}, checkpoint="c.pt",
                           saved_model_cfg=saved, model_cfg=saved)


def _model_checkpoint(path, overrides=()):
    config = load_config("demo.yaml", ["model.head_channels=8", "model.channels_last=false", *overrides])
    model = build_model(config.model, 6)
    save_checkpoint(path, {"format_version": FORMAT_VERSION, "model": model.state_dict(), "config": to_dict(config),
                           "classes": [f"c{i}" for i in range(6)], "iteration": 12})
    return model


def test_load_inference_model_rebuilds_the_model_with_its_weights_in_eval_mode(tmp_path):
    path = tmp_path / "best.pt"
    source = _model_checkpoint(path)
    loaded = load_inference_model(path, device=torch.device("cpu"), overrides=["eval.stride=7"],
                                  flags={"eval.mode": "slide", "eval.amp": "off", "eval.flip": None})
    assert not loaded.model.training and loaded.iteration == 12 and loaded.classes[5] == "c5"
    assert loaded.config.eval.mode == "slide" and loaded.config.eval.stride == (7, 7) and loaded.config.eval.amp == "off"
    assert loaded.config.eval.flip is False  # None flags leave the stored value
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[key], value), key
    with pytest.raises(ValueError, match="best.pt.*trained as.*model.head_channels=8.*asks for.*model.head_channels=16"):
        load_inference_model(path, device=torch.device("cpu"), overrides=["model.head_channels=16"])


@pytest.mark.parametrize("train_amp,eval_amp,expected", [("bf16", "off", True), ("off", "bf16", False)])
def test_inference_model_takes_the_layout_training_took(tmp_path, train_amp, eval_amp, expected):
    """model.channels_last=auto follows train.amp, not eval.amp: eval.py builds the network as training did."""
    path = tmp_path / "best.pt"
    _model_checkpoint(path, ["model.channels_last=auto", f"train.amp={train_amp}", f"eval.amp={eval_amp}"])
    loaded = load_inference_model(path, device=torch.device("cpu"))
    assert loaded.model.channels_last is expected
    assert loaded.model.backbone.conv1.weight.is_contiguous(memory_format=torch.channels_last) is expected


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_checkpoints_get_the_mode_the_umask_gives(tmp_path, umask, mode):
    from syncseg.engine.checkpoint_file import save_safetensors
    from syncseg.engine.atomic import current_umask

    previous = os.umask(umask)
    try:
        assert current_umask() == umask
        save_checkpoint(tmp_path / "last.pt", {"format_version": 1, "model": {"w": torch.ones(2)}})
        save_checkpoint(tmp_path / "last.pt", {"format_version": 1, "model": {"w": torch.zeros(2)}})  # replaced
        save_safetensors(tmp_path / "best.safetensors", {"model": {"w": torch.ones(2)}})
    finally:
        os.umask(previous)
    for name in ("last.pt", "best.safetensors"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name


def test_weights_payload_keeps_what_inference_needs_and_a_best_pt_cannot_be_resumed(tmp_path):
    from syncseg.engine.checkpoint_file import RESUME_KEYS, WEIGHTS_KEYS
    from syncseg.engine.training_state import weights_payload

    full = {**_payload(nn.Linear(3, 2)), "run_id": "r1", "overrides": {"train.iters": "5"}, "label_ids": [None, 7]}
    small = weights_payload(full, metrics={"miou": 0.5, "iou": [0.5, None]})
    assert set(small) == set(WEIGHTS_KEYS) | {"metrics"} and small["label_ids"] == [None, 7]
    assert not {"optimizer", "scheduler", "scaler", "rng", "overrides"} & set(small)
    assert small["model"] is full["model"] and small["metrics"]["iou"] == [0.5, None]
    save_checkpoint(tmp_path / "best.pt", small)
    assert load_checkpoint(tmp_path / "best.pt")["metrics"] == {"miou": 0.5, "iou": [0.5, None]}
    with pytest.raises(ValueError, match=r"best.pt' lacks required key\(s\) optimizer.*weights only.*last.pt"):
        load_checkpoint(tmp_path / "best.pt", required_keys=RESUME_KEYS)


def test_a_safetensors_release_file_loads_like_a_checkpoint(tmp_path):
    from syncseg.engine.checkpoint_file import peek_checkpoint, save_safetensors

    path = tmp_path / "best.pt"
    source = _model_checkpoint(path)
    payload = load_checkpoint(path)
    release = tmp_path / "best.safetensors"
    save_safetensors(release, {**payload, "best_miou": 0.75, "metrics": {"miou": 0.75}})
    loaded = load_checkpoint(release)
    assert loaded["classes"] == payload["classes"] and loaded["iteration"] == 12 and loaded["metrics"]["miou"] == 0.75
    assert from_dict(loaded["config"]) == from_dict(payload["config"])
    for key, value in source.state_dict().items():
        assert torch.equal(loaded["model"][key], value), key
    assert peek_checkpoint(release)["best_miou"] == 0.75  # the metadata alone
    model = load_inference_model(release, device=torch.device("cpu")).model
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source.state_dict().items())
    release.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="best.safetensors' could not be read"):
        load_checkpoint(release)


@pytest.mark.parametrize("name", ["release.pt", "release", "release.SAFETENSORS"])
def test_safetensors_are_written_only_under_the_name_the_loaders_read_as_safetensors(tmp_path, name):
    from syncseg.engine.checkpoint_file import save_safetensors

    with pytest.raises(ValueError, match=r"must be named \*\.safetensors.*e\.g\. '.*release\.safetensors'"):
        save_safetensors(tmp_path / name, {"model": {"w": torch.ones(2)}})
    assert list(tmp_path.iterdir()) == []  # nothing written: load_checkpoint would have taken it for torch.save's


# ------------------------------------------------------------------------------ fine-tuning files
def _small_model(num_classes: int, **settings) -> nn.Module:
    values = dict(arch="deeplabv3plus", backbone="resnet18", head_channels=8)
    values.update(settings)
    return build_model(ModelConfig(**values), num_classes)


def test_weights_files_of_every_accepted_shape_give_the_same_state_dict(tmp_path):
    torch.manual_seed(0)
    state = _small_model(21).state_dict()
    files = {
        "plain": state,  # torchvision's deeplabv3_*_coco-*.pth files are this
        "data_parallel": {f"module.{key}": value for key, value in state.items()},
        "under_state_dict": {"state_dict": state, "meta": {"epoch": 3}},
        "under_model": {"model": state, "optimizer": {}},
        "syncseg": {"format_version": FORMAT_VERSION, "model": state, "config": to_dict(Config()), "classes": [],
                    "iteration": 40},
    }
    kinds = {}
    for name, content in files.items():
        torch.save(content, tmp_path / f"{name}.pth")
        model = _small_model(6)
        report = init_from_weights(model, tmp_path / f"{name}.pth", model_cfg=ModelConfig())
        assert sorted(report.skipped) == ["classifier.to_logits.bias", "classifier.to_logits.weight"], name
        assert all(torch.equal(model.state_dict()[key], state[key]) for key in report.loaded), name
        kinds[name] = load_weights_file(tmp_path / f"{name}.pth")[1]
    assert kinds == {"plain": "a plain state dict", "data_parallel": "a plain state dict",
                     "under_state_dict": "a state dict under 'state_dict'", "under_model": "a state dict under 'model'",
                     "syncseg": "a syncseg checkpoint, iteration 40"}


def test_weights_file_errors_name_the_file_and_what_was_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="'.*nope.pth' not found.*deeplabv3_resnet101_coco-586e9e4e.pth.*"
                                                "nothing is downloaded"):
        load_weights_file(tmp_path / "nope.pth")
    (tmp_path / "text.pth").write_text("hello")
    with pytest.raises(ValueError, match="text.pth' could not be read"):
        load_weights_file(tmp_path / "text.pth")
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "nothing.pth")
    with pytest.raises(ValueError, match="nothing.pth' holds no state dict"):
        load_weights_file(tmp_path / "nothing.pth")


def test_a_wrong_architecture_is_one_line_naming_file_and_both_architectures(tmp_path, caplog):
    torch.save(_small_model(21, backbone="resnet34").state_dict(), tmp_path / "r34.pth")
    with pytest.raises(ValueError) as error:
        init_from_weights(_small_model(6), tmp_path / "r34.pth", model_cfg=ModelConfig(backbone="resnet18"))
    message = str(error.value)
    assert "\n" not in message and "r34.pth' (a plain state dict) does not fit the model" in message
    assert "model.backbone=resnet18" in message and "96 unexpected tensor(s) (e.g. backbone.layer1.2.conv1.weight)" in message
    # a good file logs exactly what was loaded, skipped and left fresh, in one record
    torch.save(_small_model(21, aux_loss=True).state_dict(), tmp_path / "aux.pth")
    with caplog.at_level("INFO", logger="syncseg.engine.build"):
        init_from_weights(_small_model(6), tmp_path / "aux.pth", model_cfg=ModelConfig())
    (record,) = [r.getMessage() for r in caplog.records if "aux.pth" in r.getMessage()]
    assert ("loaded 174 of the model's 176 tensors: backbone.*, classifier.aspp.*, classifier.low_level_project.*, "
            "classifier.decoder.*;") in record
    assert "classifier.to_logits.* (21 classes in the file, 6 in the model)" in record
    assert "aux_classifier.* (the model has no aux classifier" in record
    assert "not in the file (kept freshly initialized): none" in record


def test_the_non_finite_line_says_whether_a_good_checkpoint_exists(tmp_path):
    """A run that fails at iteration 1 has no last.pt: the line must not promise one (issue 34 item 4)."""
    from syncseg.engine.training_state import non_finite_error

    early = str(non_finite_error("loss", iteration=1, run_dir=tmp_path))
    assert "No checkpoint was written yet" in early and "left untouched" not in early
    (tmp_path / "last.pt").write_bytes(b"saved")
    later = str(non_finite_error("loss", iteration=9, run_dir=tmp_path))
    assert f"The last good checkpoint ({tmp_path / 'last.pt'}) was left untouched" in later
