"""Config files: the base chain, shipped names, malformed files; and a config validated once, after the
command line (issue 29 item 5): a shared base file completed per run by KEY=VALUE overrides is accepted, and
an error still names the file or the command line that set the keys it is about."""
from __future__ import annotations

import pytest
import yaml

from syncseg.engine.config import load_config, resolve_config_path


def write(path, content: dict) -> str:
    path.write_text(yaml.safe_dump(content))
    return str(path)


def test_base_chain_merges_base_first_then_file_then_overrides(tmp_path):
    write(tmp_path / "root.yaml", {"name": "root", "train": {"iters": 10, "lr": 0.5}, "data": {"crop_size": 64}})
    write(tmp_path / "middle.yaml", {"base": "root.yaml", "train": {"iters": 20}, "model": {"backbone": "resnet18"}})
    leaf = write(tmp_path / "leaf.yaml", {"base": "middle.yaml", "name": "leaf", "data": {"hflip": False}})
    config = load_config(leaf, ["train.lr=0.25"])
    assert config.name == "leaf"
    assert config.train.iters == 20 and config.train.lr == 0.25  # middle over root; command line over all
    assert config.data.crop_size == (64, 64) and config.data.hflip is False  # sections merge key by key
    assert config.model.backbone == "resnet18" and config.model.arch == "deeplabv3plus"  # untouched default


def test_base_may_name_a_shipped_config(tmp_path):
    leaf = write(tmp_path / "mine.yaml", {"base": "demo.yaml", "train": {"iters": 3}})
    config = load_config(leaf)
    assert config.train.iters == 3 and config.name == "demo" and config.model.backbone == "resnet18"


def test_circular_base_chain_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", {"base": "b.yaml"})
    write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(ValueError, match="circular 'base:' chain"):
        load_config(str(tmp_path / "a.yaml"))


def test_config_names_resolve_in_configs_folder_and_missing_ones_list_what_exists(tmp_path):
    assert resolve_config_path("demo") == resolve_config_path("demo.yaml")
    with pytest.raises(FileNotFoundError, match="nothere.yaml.*available: .*demo.yaml"):
        resolve_config_path("nothere.yaml")


@pytest.mark.parametrize("text,message", [
    ("train: [1, 2\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("train: 5\n", "'train' must be a mapping"),
])
def test_malformed_files_name_the_file(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        load_config(str(path))
    assert "bad.yaml" in str(error.value)


# ------------------------------------------------------------------------------ validated once

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
