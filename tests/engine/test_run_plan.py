"""syncseg.engine.run_plan: the run-dir lock, fresh / resumed / refused runs, and what a resume carries."""
from __future__ import annotations

import pytest
import torch

from syncseg.engine.checkpoint_file import FORMAT_VERSION, save_checkpoint
from syncseg.engine.config import load_config, to_dict
from syncseg.engine.distributed import DistInfo, Launch
from syncseg.engine.run_plan import RunDirBusyError, RunDirLock, dist_timeout, plan_run


def _checkpoint(path, config, *, iteration=4, best_miou=0.5, run_id="run-a", overrides=None):
    payload = {"format_version": FORMAT_VERSION, "model": {}, "config": to_dict(config), "classes": [],
               "iteration": iteration, "epoch": 0, "best_miou": best_miou, "optimizer": {}, "scheduler": {},
               "scaler": {}, "rng": {}, "run_id": run_id}
    if overrides is not None:
        payload["overrides"] = overrides
    save_checkpoint(path, payload)


def test_fresh_run_takes_the_lock_and_a_new_id(tmp_path):
    plan = plan_run("demo.yaml", None, [f"output_dir={tmp_path}"], dist_info=DistInfo())
    try:
        assert plan.resume is None and plan.config.run_dir == tmp_path and len(plan.run_id) == 32
        assert plan.overrides == {"output_dir": str(tmp_path)}
        with pytest.raises(RunDirBusyError, match=rf"'{tmp_path}' is in use by another training \(host .*pid"):
            RunDirLock(tmp_path).acquire()  # a second training, even in this process
    finally:
        plan.release()
    RunDirLock(tmp_path).acquire().release()  # free again


def test_a_run_dir_with_checkpoints_is_never_silently_replaced(tmp_path):
    config = load_config("demo.yaml", [f"output_dir={tmp_path}"])
    _checkpoint(tmp_path / "best.pt", config, iteration=2000)
    before = (tmp_path / "best.pt").read_bytes()
    with pytest.raises(ValueError, match=r"already holds a run \(best.pt, iteration 2000\).*--resume auto.*output_dir="
                                         r".*--overwrite"):
        plan_run("demo.yaml", None, [f"output_dir={tmp_path}"], dist_info=DistInfo())
    assert (tmp_path / "best.pt").read_bytes() == before
    plan = plan_run("demo.yaml", None, [f"output_dir={tmp_path}"], dist_info=DistInfo(), overwrite=True)
    plan.release()
    assert plan.resume is None and not (tmp_path / "best.pt").exists()


def test_auto_resume_keeps_the_run_id_and_every_override(tmp_path):
    config = load_config("demo.yaml", [f"output_dir={tmp_path}", "train.lr=0.002"])
    _checkpoint(tmp_path / "last.pt", config, overrides={"output_dir": str(tmp_path), "train.lr": "0.002"})
    plan = plan_run("demo.yaml", "auto", [f"output_dir={tmp_path}", "train.iters=3000"], dist_info=DistInfo())
    plan.release()
    assert plan.resume["iteration"] == 4 and plan.run_id == "run-a"
    assert plan.config.train.lr == 0.002 and plan.config.train.iters == 3000  # saved config + new overrides
    assert plan.overrides == {"output_dir": str(tmp_path), "train.lr": "0.002", "train.iters": "3000"}


def test_a_config_file_changed_since_the_checkpoint_is_an_error(tmp_path):
    base = tmp_path / "mine.yaml"
    base.write_text("base: demo.yaml\ntrain:\n  weight_decay: 0.0001\n")
    config = load_config(str(base), [f"output_dir={tmp_path / 'run'}"])
    _checkpoint(tmp_path / "run" / "last.pt", config, overrides={"output_dir": str(tmp_path / "run")})
    base.write_text("base: demo.yaml\ntrain:\n  weight_decay: 0.0005\n")
    with pytest.raises(ValueError, match=r"has changed since .*last.pt.*train.weight_decay \(0.0005 in the file, "
                                         r"0.0001 in the checkpoint\).*KEY=VALUE"):
        plan_run(str(base), "auto", [f"output_dir={tmp_path / 'run'}"], dist_info=DistInfo())
    plan = plan_run(None, str(tmp_path / "run" / "last.pt"), [], dist_info=DistInfo())  # the checkpoint alone
    plan.release()
    assert plan.config.train.weight_decay == 0.0001


def test_torchelastic_resumes_without_being_asked(tmp_path):
    config = load_config("demo.yaml", [f"output_dir={tmp_path}"])
    _checkpoint(tmp_path / "last.pt", config, overrides={"output_dir": str(tmp_path)})
    elastic = DistInfo(launch=Launch(launcher="torchrun", elastic=True, restart_count=1))
    plan = plan_run("demo.yaml", None, [f"output_dir={tmp_path}"], dist_info=elastic)
    plan.release()
    assert plan.resume is not None and plan.resume["iteration"] == 4


def test_resume_takes_the_best_miou_of_a_later_best_pt_and_removes_orphaned_temporaries(tmp_path):
    config = load_config("demo.yaml", [f"output_dir={tmp_path}"])
    _checkpoint(tmp_path / "last.pt", config, iteration=10, best_miou=0.4, overrides={})
    _checkpoint(tmp_path / "best.pt", config, iteration=10, best_miou=0.6)  # validated after last.pt was saved
    orphan = tmp_path / ".last.pt.abc123.tmp"
    orphan.write_bytes(b"half a checkpoint")
    plan = plan_run("demo.yaml", "auto", [f"output_dir={tmp_path}"], dist_info=DistInfo())
    plan.release()
    assert plan.resume["best_miou"] == 0.6 and not orphan.exists()
    _checkpoint(tmp_path / "best.pt", config, iteration=10, best_miou=0.9, run_id="another-run")
    plan = plan_run("demo.yaml", "auto", [f"output_dir={tmp_path}"], dist_info=DistInfo())
    plan.release()
    assert plan.resume["best_miou"] == 0.4  # another run's best.pt says nothing about this one


def test_dist_timeout_comes_from_the_file_the_overrides_or_the_checkpoint(tmp_path):
    assert dist_timeout("demo.yaml", None, []) == 300.0
    assert dist_timeout("demo.yaml", None, ["dist.timeout_s=20"]) == 20.0
    _checkpoint(tmp_path / "last.pt", load_config("demo.yaml", ["dist.timeout_s=45"]))
    assert dist_timeout(None, str(tmp_path / "last.pt"), []) == 45.0
    assert dist_timeout(None, str(tmp_path / "missing.pt"), []) == 300.0  # plan_run reports the missing file
    assert torch.load(tmp_path / "last.pt", map_location="cpu", weights_only=True)["run_id"] == "run-a"


@pytest.mark.parametrize("where", ["run", "run/inner"])
def test_a_run_dir_that_is_or_lies_under_a_file_is_bad_input(tmp_path, where):
    """output_dir pointing at a file was exit 1 with "rank 0: File exists" (issue 34 item 4): now a
    ValueError (exit 2) naming the file in the way, and the file is left as it was."""
    (tmp_path / "run").write_text("notes")
    with pytest.raises(ValueError, match=rf"'{tmp_path / 'run'}' is a file, not a folder; set output_dir="):
        RunDirLock(tmp_path / where).acquire()
    assert (tmp_path / "run").read_text() == "notes"
