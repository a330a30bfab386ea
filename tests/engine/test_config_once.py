"""A config is validated once, after the command line (issue 29 item 5): a shared base file completed per
run by KEY=VALUE overrides is accepted, and an error still names the file or the command line that set the
keys it is about."""
from __future__ import annotations

import pytest

from syncseg.engine.config import load_config

FOLDER_WITH_LABEL_MAP = "base: demo.yaml\ndata:\n  dataset: folder\n  label_map: {255: 1}\n"
LABEL_MAP_ONLY = "base: demo.yaml\ndata:\n  label_map: {255: 1}\n"


def test_a_file_that_the_command_line_completes_is_valid(tmp_path):
    """Both examples of the issue: the rules over data.dataset, data.num_classes and data.label_map are
    checked on the merged config, not on the file alone."""
    first = tmp_path / "my.yaml"
    first.write_text(FOLDER_WITH_LABEL_MAP)
    config = load_config(first, ["data.root=/data/x", "data.num_classes=2"])
    assert (config.data.dataset, config.data.num_classes, config.data.label_map) == ("folder", 2, ((255, 1),))
    second = tmp_path / "my2.yaml"
    second.write_text(LABEL_MAP_ONLY)
    config = load_config(second, ["data.dataset=folder", "data.root=/data/x", "data.num_classes=2"])
    assert (config.data.dataset, config.data.label_map) == ("folder", ((255, 1),))


def test_errors_name_the_origin_of_the_keys_involved(tmp_path):
    path = tmp_path / "my2.yaml"
    path.write_text(LABEL_MAP_ONLY)
    # the file's label map with the base's synthetic dataset: the file set the key the rule names
    with pytest.raises(ValueError, match=rf"^{path}: data.label_map is set but the synthetic dataset"):
        load_config(path)
    # the command line's label map: the command line is named, not the file
    with pytest.raises(ValueError, match=r"^command line: data.label_map is set but the synthetic dataset"):
        load_config("demo.yaml", ["data.label_map=255:1"])
    # a rule over two keys set in two places names both (the hint after ';' names no origin)
    batch = tmp_path / "batch.yaml"
    batch.write_text("base: demo.yaml\ntrain:\n  batch_size: 4\n")
    with pytest.raises(ValueError, match=rf"^command line and {batch}: train.accumulate=8 > train.batch_size=4"):
        load_config(batch, ["train.accumulate=8"])
    # one key's own range: its origin alone
    with pytest.raises(ValueError, match=r"^command line: train.iters=0: must be >= 1|^command line: train.iters=0"):
        load_config(path, ["data.dataset=folder", "data.num_classes=2", "train.iters=0"])


def test_a_value_the_command_line_replaces_is_not_checked(tmp_path):
    """The command line's value wins before anything is converted: a file's bad value that the run
    overrides does not stop it."""
    path = tmp_path / "bad.yaml"
    path.write_text("base: demo.yaml\ntrain:\n  iters: many\n")
    with pytest.raises(ValueError, match=rf"^{path}: config key 'train.iters' expects int, got 'many'"):
        load_config(path)
    assert load_config(path, ["train.iters=5"]).train.iters == 5
