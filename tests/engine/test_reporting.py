"""metrics.jsonl / TensorBoard bookkeeping and the helpers that format what a run reports."""
from __future__ import annotations

import errno
import json

import numpy as np
import pytest

from syncseg.engine.reporting import MetricsLog, flat_numbers, format_seconds, progress_bar, validation_markdown
from tests.conftest import fill_disk


def test_metrics_log_restarts_for_a_fresh_run_and_trims_for_a_resume(tmp_path):
    lines = [{"type": "train", "iteration": i, "loss": float(i)} for i in (1, 2, 3, 4)]
    path = tmp_path / "metrics.jsonl"

    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    log = MetricsLog(tmp_path, enabled=True, resume_iteration=2)  # resumed from a checkpoint at 2
    log.scalars({"loss": 9.0}, step=3, prefix="train")
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["iteration"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 9.0)]

    log = MetricsLog(tmp_path, enabled=True)  # a fresh run in the same directory
    log.scalars({"loss": 5.0, "lr": {"head": 0.1}}, step=1, prefix="train")
    log.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [{"type": "train", "iteration": 1, "loss": 5.0, "lr": {"head": 0.1}}]


def test_flat_numbers_keeps_numbers_only_with_nested_names():
    record = {"loss": 1.5, "lr": {"head": 0.1, "backbone": 0.01}, "note": "x", "flag": True, "none": None, "n": 3}
    assert dict(flat_numbers(record)) == {"loss": 1.5, "lr/head": 0.1, "lr/backbone": 0.01, "n": 3.0}


def test_format_seconds():
    assert format_seconds(59.9) == "0m59s" and format_seconds(61) == "1m01s" and format_seconds(3 * 3600 + 120) == "3h02m"
    assert format_seconds(-5) == "0m00s"


def _events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_events_sit_in_the_run_dir_without_constant_cards_and_with_a_summary(tmp_path):
    log = MetricsLog(tmp_path, enabled=True)
    metrics = {"miou": 0.5, "pixel_acc": 0.75, "mean_acc": 0.6, "fwiou": 0.55, "num_images": 4,
               "iou": [0.25, None, 0.75]}
    log.validation(metrics, classes=["bg", "absent", "thing"], step=2)
    log.close()
    assert list(tmp_path.glob("events.out.tfevents.*")) and not (tmp_path / "tensorboard").exists()
    events = _events(tmp_path)
    scalars = set(events.Tags()["scalars"])
    assert {"val/miou", "val/pixel_acc", "val/iou/bg", "val/iou/thing"} <= scalars
    assert "val/num_images" not in scalars and "val/iou/absent" not in scalars  # constant / undefined: no card
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["num_images"] == 4 and record["type"] == "val"  # kept in metrics.jsonl
    summary = events.Tensors("val/summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert summary == validation_markdown(metrics, classes=["bg", "absent", "thing"], step=2)
    assert "| mIoU | 50.00 |" in summary and "| absent | n/a |" in summary and "| thing | 75.00 |" in summary


def test_a_resumed_run_keeps_writing_to_its_old_tensorboard_folder(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    legacy = tmp_path / "tensorboard"  # where runs of earlier versions wrote their events
    old = SummaryWriter(str(legacy))
    old.add_scalar("train/loss", 1.0, 1)
    old.add_scalar("train/loss", 9.0, 2)  # logged after the checkpoint the run resumes from
    old.close()
    # TensorBoard reads a folder's files in name order, and names start with the creation second: date
    # the old run's file back, as it would be (in one process within one second the order could flip)
    for path in legacy.glob("events.out.tfevents.*"):
        stamp = path.name.split(".")[3]
        path.rename(path.with_name(path.name.replace(f".{stamp}.", f".{int(stamp) - 100}.", 1)))
    resumed = MetricsLog(tmp_path, enabled=True, resume_iteration=1)
    resumed.scalars({"loss": 2.0}, step=2, prefix="train")
    resumed.close()
    assert [(e.step, e.value) for e in _events(legacy).Scalars("train/loss")] == [(1, 1.0), (2, 2.0)]  # purged
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    fresh = MetricsLog(tmp_path, enabled=True)  # a new run in that folder starts in the run dir itself
    fresh.scalars({"loss": 3.0}, step=1, prefix="train")
    fresh.close()
    assert [e.value for e in _events(tmp_path).Scalars("train/loss")] == [3.0]


def test_log_lines_go_above_the_progress_bar(capsys):
    import logging

    logger = logging.getLogger("tests.run_log")
    handler = logging.StreamHandler()  # a console handler on the root logger, as train.py's basicConfig
    logging.root.addHandler(handler)
    try:
        with progress_bar(enabled=True, total=3, initial=0) as bar:
            bar.update(1)
            during = list(logging.root.handlers)
            logger.warning("a message")
        assert handler in logging.root.handlers  # restored after the bar
    finally:
        logging.root.removeHandler(handler)
    assert handler not in during and any(type(h).__name__ == "_TqdmLoggingHandler" for h in during)
    err = capsys.readouterr().err
    assert "a message\n" in err  # a whole line of its own (tqdm.write clears the bar first)
    with progress_bar(enabled=False, total=3, initial=0) as bar:
        assert bar is None


def test_a_full_disk_names_metrics_jsonl_and_a_resume_keeps_the_old_file(small_disk, capfd):
    run_dir = small_disk / "run"
    run_dir.mkdir()
    path = run_dir / "metrics.jsonl"
    history = "".join(json.dumps({"type": "train", "iteration": i, "loss": float(i)}) + "\n" for i in (1, 2, 3))
    path.write_text(history)
    fill_disk(small_disk)
    # the resume's trim of metrics.jsonl: the old file stays whole when the new one cannot be written
    with pytest.raises(OSError, match=rf"could not write metrics log '{path}': No space left on device"):
        MetricsLog(run_dir, enabled=True, resume_iteration=2)
    assert path.read_text() == history
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]  # nor a temporary file left
    (small_disk / "filler").unlink()
    log = MetricsLog(run_dir, enabled=True, resume_iteration=3)
    log.flush()
    fill_disk(small_disk)
    with pytest.raises(OSError) as raised:
        for step in range(4, 200):  # the first line that finds no free block
            log.scalars({"loss": 0.5}, step=step, prefix="train")
    assert str(raised.value) in (f"[Errno {errno.ENOSPC}] could not append to '{path}': No space left on device",
                                 f"[Errno {errno.ENOSPC}] could not write TensorBoard events in '{run_dir}': No "
                                 "space left on device")
    log.close()  # does not raise: the events that could not be written are a warning
    assert "Traceback" not in capfd.readouterr().err  # TensorBoard's thread printed nothing
    assert path.read_text().startswith(history)


def test_tensorboard_errors_are_one_line_naming_the_folder_without_the_thread_traceback(small_disk, capfd,
                                                                                        caplog):
    log = MetricsLog(small_disk, enabled=True)
    log.flush()
    fill_disk(small_disk)
    (small_disk / "metrics.jsonl").write_text("")  # metrics.jsonl keeps its block; the events find none
    with pytest.raises(OSError, match=rf"could not write TensorBoard events in '{small_disk}': No space left"):
        for step in range(1, 200):
            log.image("val/image", np.zeros((256, 256, 3), np.uint8), step=step)
            log.flush()
    with caplog.at_level("WARNING"):
        log.close()
    assert "Traceback" not in capfd.readouterr().err
