"""The schema (syncseg.engine.config) and its reading and writing (syncseg.engine.config.io): type conversion,
overrides, the dict round trip, renamed keys, and every validation error (files and the base chain:
test_config_files.py)."""
from __future__ import annotations

import dataclasses

import pytest
import yaml

from syncseg.engine.config import Config, DataConfig, EvalConfig, all_keys, choices, validate
from syncseg.engine.config import (
    build_config,
    from_dict,
    inference_config,
    load_config,
    parse_overrides,
    save_config,
    to_dict,
)


def write(path, content: dict) -> str:
    path.write_text(yaml.safe_dump(content))
    return str(path)


# ------------------------------------------------------------------------------------ one source
def test_choices_are_the_registries_names_or_the_literals():
    assert choices("data.dataset") == ("voc", "cityscapes", "ade20k", "synthetic", "folder", "coco", "labelme", "cvat",
                                       "yolo_seg", "label_studio", "cvat_mask", "raster")
    assert choices("model.arch") == ("deeplabv3", "deeplabv3plus") and choices("model.output_stride") == (8, 16, 32)
    with pytest.raises(KeyError, match="train.iters"):
        choices("train.iters")


def test_every_shipped_config_loads():
    for name in ("demo.yaml", "voc.yaml", "cityscapes.yaml", "cityscapes_512x1024.yaml", "ade20k.yaml",
                 "small_data.yaml", "scenes.yaml"):
        config = load_config(name)
        assert config.name and config.run_dir.name == config.name


# -------------------------------------------------------------------------------- files and bases
# -------------------------------------------------------------------------------------- conversion
def test_values_take_the_type_of_their_field():
    config = load_config(None, ["train.iters=200", "train.lr=1e-3", "data.scale_range=0.5,2.0", "data.hflip=no",
                                "model.output_stride=8", "model.aspp_rates=[1, 2, 3]", "eval.scales=1",
                                "data.class_names=", "train.warmup_iters=10.0", "name=run 1"])
    assert config.train.iters == 200 and isinstance(config.train.iters, int)
    assert config.train.lr == 1e-3
    assert config.data.scale_range == (0.5, 2.0) and config.data.hflip is False
    assert config.model.output_stride == 8 and isinstance(config.model.output_stride, int)
    assert config.model.aspp_rates == (1, 2, 3) and config.eval.scales == (1.0,)
    assert config.data.class_names == () and config.train.warmup_iters == 10 and config.name == "run 1"
    # model.channels_last: auto, or a bool in any of the spellings a bool takes (YAML or the command line)
    for value, expected in (("auto", "auto"), ("true", True), ("off", False), (True, True), (False, False)):
        assert build_config({"model.channels_last": value}).model.channels_last == expected
    assert load_config(None, ["model.channels_last=yes"]).model.channels_last is True


@pytest.mark.parametrize("override,message", [
    ("train.iters=many", "'train.iters' expects int, got 'many'"),
    ("train.iters=2.5", "'train.iters' expects int"),
    ("train.lr=fast", "'train.lr' expects float"),
    ("data.hflip=maybe", "'data.hflip' expects bool"),
    ("data.scale_range=1,2,3", "'data.scale_range' expects a comma-separated list of float"),
    ("model.output_stride=eight", "'model.output_stride' expects one of 8, 16, 32"),
    ("model.channels_last=sometimes", "'model.channels_last' expects one of auto, True, False, got 'sometimes'"),
])
def test_unconvertible_values_name_key_type_and_value(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_unknown_keys_suggest_the_closest_valid_one(tmp_path):
    with pytest.raises(ValueError, match="unknown config key 'train.iter'; did you mean 'train.iters'"):
        load_config(None, ["train.iter=5"])
    with pytest.raises(ValueError, match="unknown config key 'modle.arch'; did you mean 'model.arch'"):
        load_config(None, ["modle.arch=deeplabv3"])
    leaf = write(tmp_path / "typo.yaml", {"data": {"crop_sise": 3}})
    with pytest.raises(ValueError, match=r"typo.yaml: unknown config key 'data.crop_sise'; did you mean 'data.crop_size'"):
        load_config(leaf)
    with pytest.raises(ValueError, match="valid keys: name, output_dir"):
        load_config(None, ["zzzzzz=1"])
    with pytest.raises(ValueError, match="must look like KEY=VALUE"):
        parse_overrides(["train.iters"])


def test_dict_round_trip_and_yaml_file(tmp_path):
    config = load_config("demo.yaml", ["data.scale_range=0.75,1.5", "model.aspp_rates=1,2"])
    assert from_dict(to_dict(config)) == config
    save_config(config, tmp_path / "saved.yaml")
    assert load_config(str(tmp_path / "saved.yaml")) == config
    plain = to_dict(config)
    assert plain["data"]["scale_range"] == [0.75, 1.5]  # lists, not tuples: YAML/JSON/checkpoint safe
    with pytest.raises(ValueError, match="unknown config key 'train.bogus'"):
        from_dict({**plain, "train": {**plain["train"], "bogus": 1}})


def test_saving_config_yaml_on_a_full_disk_keeps_the_old_file(small_disk):
    from tests.conftest import fill_disk

    path = small_disk / "config.yaml"
    save_config(load_config("demo.yaml"), path)
    before = path.read_text()
    fill_disk(small_disk)
    with pytest.raises(OSError, match=f"could not write config '{path}': No space left on device"):
        save_config(load_config("demo.yaml", ["train.iters=7"]), path)  # a resume rewrites config.yaml
    assert path.read_text() == before


@pytest.mark.parametrize("value,expected", [
    ("513", (513, 513)), ("512,1024", (512, 1024)), ("[512, 1024]", (512, 1024)), ("(64)", (64, 64)),
    (96, (96, 96)), ([96], (96, 96)), ([512, 1024], (512, 1024)), (96.0, (96, 96)),
])
def test_pixel_sizes_are_height_width_and_one_integer_is_a_square(value, expected):
    assert build_config({"data.crop_size": value, "eval.window_size": value}).data.crop_size == expected
    assert build_config({"eval.window_size": value, "eval.stride": value}).eval.window_size == expected


@pytest.mark.parametrize("value", ["1,2,3", "a", "2.5", "true", "", True, [1, 2, 3], {"h": 1}])
def test_pixel_sizes_reject_anything_but_one_or_two_integers(value):
    with pytest.raises(ValueError, match=r"'data.crop_size' expects H,W \(two integers, or one for a square\)"):
        build_config({"data.crop_size": value})


def test_configs_and_checkpoints_with_one_integer_sizes_still_load(tmp_path):
    old = to_dict(Config())
    old["data"]["crop_size"], old["eval"]["window_size"], old["eval"]["stride"] = 96, 769, 513  # before H,W
    config = from_dict(old)
    assert (config.data.crop_size, config.eval.window_size, config.eval.stride) == ((96, 96), (769, 769), (513, 513))
    assert to_dict(config)["data"]["crop_size"] == [96, 96]
    leaf = write(tmp_path / "old.yaml", {"data": {"crop_size": 321}, "eval": {"crop_size": 400}})
    config = load_config(leaf)
    assert config.data.crop_size == (321, 321) and config.eval.window_size == (400, 400)


def test_renamed_key_still_reads_old_files_and_checkpoints():
    old = to_dict(Config())
    old["eval"] = {k: v for k, v in old["eval"].items() if k != "window_size"} | {"crop_size": 769}
    assert from_dict(old).eval.window_size == (769, 769)
    assert load_config(None, ["eval.crop_size=321"]).eval.window_size == (321, 321)


def test_inference_config_applies_overrides_then_flags_and_drops_weight_sources():
    saved = to_dict(load_config("demo.yaml", ["model.pretrained_backbone=imagenet", "model.init_checkpoint=x.pt",
                                              "eval.amp=bf16"]))
    config = inference_config(saved, ["eval.mode=slide", "eval.window_size=64", "eval.stride=32"], source="ckpt",
                              flags={"eval.flip": True, "eval.scales": "0.5,1.0", "eval.mode": None})
    assert config.model.pretrained_backbone == "none" and config.model.init_checkpoint == ""
    assert config.eval.mode == "slide" and config.eval.flip is True and config.eval.scales == (0.5, 1.0)
    assert config.eval.amp == "bf16"  # the checkpoint's eval.amp unless a flag says otherwise


# -------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("override,message", [
    ("data.dataset=imagenet", "data.dataset='imagenet' is not one of voc, cityscapes, ade20k, synthetic, folder"),
    ("model.arch=unet", "model.arch='unet' is not one of deeplabv3, deeplabv3plus"),
    ("model.backbone=resnet152", "model.backbone='resnet152' is not one of resnet18"),
    ("model.output_stride=4", "model.output_stride=4 is not one of 8, 16, 32"),
    ("model.norm=gn", "model.norm='gn' is not one of syncbn, bn, frozen_bn"),
    ("train.optimizer=lamb", "train.optimizer='lamb' is not one of sgd, adamw"),
    ("train.amp=fp8", "train.amp='fp8' is not one of auto, off, tf32, fp16, bf16"),
    ("eval.amp=int8", "eval.amp='int8' is not one of auto, off, tf32, fp16, bf16"),
    ("eval.mode=tiles", "eval.mode='tiles' is not one of whole, slide"),
    ("data.crop_size=0", "data.crop_size=0,0: every value must be >= 1"),
    ("data.crop_size=512,0", "data.crop_size=512,0: every value must be >= 1"),
    ("train.iters=0", "train.iters=0: must be >= 1"),
    ("train.batch_size=-2", "train.batch_size=-2: must be >= 1"),
    ("train.accumulate=0", "train.accumulate=0: must be >= 1"),
    ("train.lr=0", "train.lr=0.0: must be > 0"),
    ("train.ohem_thresh=1.5", "train.ohem_thresh=1.5: must be > 0 and <= 1"),
    ("train.class_weights=1,-1", "train.class_weights=1.0,-1.0: every value must be >= 0"),
    ("train.val_interval=0", "train.val_interval=0: must be >= 1"),
    ("train.precise_bn_batches=1000000", "train.precise_bn_batches=1000000: must be >= 0 and <= 10000"),
    ("data.num_workers=-1", "data.num_workers=-1: must be >= 0"),
    ("data.base_size=-1", "data.base_size=-1: must be >= 0"),
    ("data.ignore_index=256", "data.ignore_index=256: must be >= 0 and <= 255"),
    ("data.std=0.2,0,0.2", "data.std=0.2,0.0,0.2: every value must be > 0"),
    ("data.scale_range=0,1", "data.scale_range=0.0,1.0: every value must be > 0"),
    ("data.scale_range=2,1", "data.scale_range=2.0,1.0 must satisfy low <= high"),
    ("data.synthetic_image_size=8", "data.synthetic_image_size=8: must be >= 16"),
    ("data.synthetic_train_size=0", "data.synthetic_train_size=0: must be >= 1"),
    ("data.num_classes=9", "the synthetic dataset has 2 to 8 classes"),
    ("model.aspp_rates=0,2", "model.aspp_rates=0,2: every value must be >= 1"),
    ("model.head_channels=0", "model.head_channels=0: must be >= 1"),
    ("eval.scales=0.5,0", "eval.scales=0.5,0.0: every value must be > 0"),
    ("eval.scales=", "eval.scales is empty"),
    ("eval.batch_size=0", "eval.batch_size=0: must be >= 1"),
    ("data.in_channels=0", "data.in_channels=0: must be >= 1 and <= 128"),
    ("data.in_channels=129", "data.in_channels=129: must be >= 1 and <= 128"),
    ("data.max_value=65536", "data.max_value=65536: must be >= 1 and <= 65535"),
])
def test_every_invalid_value_names_key_value_and_expectation(override, message):
    with pytest.raises(ValueError) as error:
        load_config(None, [override])
    assert message in str(error.value) and str(error.value).startswith("command line: ")


def test_cross_field_rules():
    with pytest.raises(ValueError, match="eval.stride=600,600 > eval.window_size=513,513"):
        load_config(None, ["eval.mode=slide", "eval.stride=600"])
    with pytest.raises(ValueError, match=r"eval.stride=300,600 > eval.window_size=512,512 \(height,width\)"):
        load_config(None, ["eval.mode=slide", "eval.window_size=512", "eval.stride=300,600"])
    assert load_config(None, ["eval.mode=slide", "eval.window_size=512,1024", "eval.stride=300,600"])
    assert load_config(None, ["eval.mode=whole", "eval.stride=600"]).eval.stride == (600, 600)  # only slide uses it
    with pytest.raises(ValueError, match="train.accumulate=5 > train.batch_size=4"):
        load_config(None, ["train.batch_size=4", "train.accumulate=5"])
    with pytest.raises(ValueError, match="train.ohem with train.accumulate=2: OHEM picks its pixels"):
        load_config(None, ["train.ohem=true", "train.accumulate=2"])
    assert load_config(None, ["train.ohem=true", "train.accumulate=1"]).train.ohem
    with pytest.raises(ValueError, match="dataset 'voc' has a fixed class list"):
        load_config(None, ["data.dataset=voc", "data.num_classes=5"])
    with pytest.raises(ValueError, match="dataset 'folder' needs data.num_classes"):
        load_config(None, ["data.dataset=folder"])
    with pytest.raises(ValueError, match="data.class_names has 2 names but data.num_classes=3"):
        load_config(None, ["data.dataset=folder", "data.num_classes=3", "data.class_names=a,b"])
    with pytest.raises(ValueError, match="data.num_classes=300: must be >= 0 and <= 255"):
        load_config(None, ["data.dataset=folder", "data.num_classes=300"])


def test_validate_checks_dataclasses_built_directly():
    with pytest.raises(ValueError, match="direct: eval.window_size=0"):
        validate(Config(eval=EvalConfig(window_size=0)), source="direct")
    with pytest.raises(ValueError, match="direct: eval.stride=9,9 > eval.window_size=8,8"):
        validate(Config(eval=EvalConfig(mode="slide", window_size=8, stride=9)), source="direct")
    validate(Config(data=DataConfig(dataset="folder", num_classes=3)))


def test_all_keys_are_exactly_the_keys_a_config_writes():
    """all_keys() (unknown-key errors, --print-config) and to_dict (checkpoints, config.yaml) agree: a section
    missing from SECTIONS, or a field to_dict leaves out, fails here."""
    def dotted(raw, prefix=""):
        for name, value in raw.items():
            if not prefix and isinstance(value, dict):  # a section (data.label_map's value is a mapping too)
                yield from dotted(value, f"{name}.")
            else:
                yield f"{prefix}{name}"

    keys = all_keys()
    assert len(keys) == len(set(keys)) and sorted(keys) == sorted(dotted(to_dict(Config())))
    assert "eval.window_size" in keys and "eval.crop_size" not in keys
    fields = {f.name for f in dataclasses.fields(EvalConfig)}
    assert {key.split(".")[1] for key in keys if key.startswith("eval.")} == fields


def test_build_config_starts_from_a_base_config():
    base = load_config("demo.yaml")
    config = build_config({"train.iters": "7"}, base=base)
    assert config.train.iters == 7 and config.model == base.model


# ------------------------------------------------------------------ mapping-valued keys (issue 21)
FOLDER = ["data.dataset=folder", "data.root=/data", "data.num_classes=4"]


@pytest.mark.parametrize("yaml_value,override", [
    ({255: 1, 128: "ignore"}, "data.label_map=255:1,128:ignore"),
    ({"255": "1", "128": "IGNORE"}, "data.label_map={255: 1, 128: ignore}"),
])
def test_label_map_reads_from_yaml_and_the_command_line(tmp_path, yaml_value, override):
    from_file = load_config(write(tmp_path / "c.yaml", {"data": {"dataset": "folder", "root": "/data",
                                                                 "num_classes": 4, "label_map": yaml_value}}))
    from_line = load_config(None, [*FOLDER, override])
    assert from_file.data.label_map == from_line.data.label_map == ((128, "ignore"), (255, 1))


def test_class_colors_read_rgb_triples_and_hex_and_write_hex(tmp_path):
    expected = (((0, 0, 0), 0), ((128, 0, 64), 2), ((255, 255, 255), "ignore"))
    from_file = load_config(write(tmp_path / "c.yaml", {"data": {
        "dataset": "folder", "root": "/data", "num_classes": 4,
        "class_colors": {"0,0,0": 0, "#800040": 2, "255, 255, 255": "ignore"}}}))
    from_line = load_config(None, [*FOLDER, "data.class_colors=0,0,0:0,#800040:2,255,255,255:ignore"])
    assert from_file.data.class_colors == from_line.data.class_colors == expected
    assert to_dict(from_line)["data"]["class_colors"] == {"#000000": 0, "#800040": 2, "#ffffff": "ignore"}


@pytest.mark.parametrize("yaml_value,override", [
    ([{"ce": 1.0}, {"dice": 0.5}], "train.loss=ce:1,dice:0.5"),
    ({"ce": 1, "dice": 0.5}, "train.loss=[ce: 1, dice: 0.5]"),
])
def test_loss_reads_weighted_names_in_order(tmp_path, yaml_value, override):
    from_file = load_config(write(tmp_path / "c.yaml", {"train": {"loss": yaml_value}}))
    assert from_file.train.loss == load_config(None, [override]).train.loss == (("ce", 1.0), ("dice", 0.5))
    assert load_config(None, ["train.loss=lovasz,ce"]).train.loss == (("lovasz", 1.0), ("ce", 1.0))
    assert Config().train.loss == (("ce", 1.0),)


def test_mapping_keys_round_trip_through_dicts_yaml_and_checkpoint_configs(tmp_path):
    config = load_config("demo.yaml", [*FOLDER, "data.label_map=255:1,7:ignore", "train.loss=ce:1,lovasz:0.5"])
    plain = to_dict(config)
    assert plain["data"]["label_map"] == {7: "ignore", 255: 1} and plain["train"]["loss"] == [{"ce": 1.0},
                                                                                                {"lovasz": 0.5}]
    assert from_dict(plain) == config
    save_config(config, tmp_path / "saved.yaml")
    assert load_config(str(tmp_path / "saved.yaml")) == config
    colours = load_config("demo.yaml", [*FOLDER, "data.class_colors=#ff0000:1", "data.reduce_zero_label=false"])
    assert from_dict(to_dict(colours)) == colours
    # a checkpoint written as JSON has string keys
    assert from_dict({"data": {**plain["data"], "label_map": {"7": "ignore", "255": 1}}}).data.label_map == (
        (7, "ignore"), (255, 1))


@pytest.mark.parametrize("overrides,message", [
    (["data.label_map=255"], "'data.label_map' expects raw value -> class index or ignore"),
    (["data.label_map=a:1"], "'data.label_map' expects raw value -> class index or ignore"),
    (["data.label_map=256:1"], "data.label_map has the raw value 256; masks are 8-bit"),
    (["data.label_map=255:4"], "data.label_map maps 255 to 4; expected a class index 0..3 (dataset 'folder' has "
                               "4 classes) or ignore"),
    (["data.label_map=255:1,255:2"], "data.label_map lists the raw value 255 twice"),
    (["data.class_colors=1,2:3"], "'data.class_colors' expects colour -> class index"),
    (["data.class_colors=1,2,300:1"], "data.class_colors has the colour 1,2,300; expected R,G,B, each 0..255"),
    (["data.class_colors=#ff0000:1,255,0,0:2"], "data.class_colors lists the colour 255,0,0 twice"),
    (["data.class_colors=#ff0000:9"], "data.class_colors maps 255,0,0 to 9"),
    (["data.class_colors=#ff0000:1", "data.label_map=255:1"], "data.class_colors and data.label_map are both set"),
    (["data.class_colors=#ff0000:1", "data.reduce_zero_label=true"], "data.class_colors and data.reduce_zero_label"),
    (["data.num_classes=255", "data.reduce_zero_label=true"], "reaches data.ignore_index=255"),
    (["train.loss="], "train.loss is empty"),
    (["train.loss=ce:x"], "'train.loss' expects loss name -> weight"),
    (["train.loss=ce,bce"], "train.loss names 'bce', which is not one of ce, dice, focal, lovasz"),
    (["train.loss=ce,ce:2"], "train.loss lists 'ce' twice"),
    (["train.loss=ce:0"], "train.loss gives 'ce' the weight 0; expected a weight > 0"),
    (["train.loss=dice", "train.ohem=true"], "train.ohem selects the hard pixels of the ce loss, but train.loss "
                                             "(dice) has no ce"),
    (["train.loss=dice,lovasz", "train.class_weights=1,2,1,1"], "train.class_weights weigh the ce and focal losses"),
    (["train.focal_gamma=-1"], "train.focal_gamma=-1.0: must be >= 0"),
])
def test_mapping_keys_errors_name_the_key_the_value_and_what_is_expected(overrides, message):
    with pytest.raises(ValueError) as error:
        load_config(None, [*FOLDER, *overrides])
    assert message in str(error.value) and str(error.value).startswith("command line: ")


def test_mask_encodings_are_for_datasets_with_mask_files_and_check_fixed_class_counts():
    with pytest.raises(ValueError, match="data.label_map is set but the synthetic dataset has no mask files"):
        load_config(None, ["data.label_map=255:1"])
    with pytest.raises(ValueError, match="data.reduce_zero_label is for dataset 'folder'"):
        load_config(None, ["data.dataset=ade20k", "data.reduce_zero_label=true"])
    with pytest.raises(ValueError, match=r"expected a class index 0\.\.20 \(dataset 'voc' has 21 classes\)"):
        load_config(None, ["data.dataset=voc", "data.label_map=255:21"])
    assert load_config(None, ["data.dataset=cityscapes", "data.label_map=9:0"]).data.label_map == ((9, 0),)


TWO_CLASS_FOLDER = ["data.dataset=folder", "data.num_classes=2"]


def test_rot90_needs_a_square_crop():
    assert load_config(None, ["data.rot90=true", "data.crop_size=64"]).data.rot90 is True
    with pytest.raises(ValueError, match=r"^command line: data\.rot90 with data\.crop_size=64,96 \(height,width\): a "
                                         r"rotation by 90 degrees swaps height and width.*data\.crop_size=64\)"):
        load_config(None, ["data.rot90=true", "data.crop_size=64,96"])


def test_the_tool_that_measures_mean_and_std_loads_a_config_without_them(tmp_path):
    """Issue 32 item 1: verify_dataset loads with normalization_unknown, so data.in_channels=N without a mean or
    std of N values (what it prints) is no error there; what the file or the command line does set is kept and
    checked, and training's load still requires one value per channel."""
    six = [*TWO_CLASS_FOLDER, "data.in_channels=6"]
    config = load_config(None, six, normalization_unknown=True)
    assert (config.data.mean, config.data.std) == ((0.0,) * 6, (1.0,) * 6)
    with pytest.raises(ValueError, match=r"data\.mean has 3 value\(s\)"):
        load_config(None, six)
    partial = load_config(None, [*six, "data.mean=0.1,0.2,0.3,0.4,0.5,0.6"], normalization_unknown=True)
    assert (partial.data.mean, partial.data.std) == ((0.1, 0.2, 0.3, 0.4, 0.5, 0.6), (1.0,) * 6)
    with pytest.raises(ValueError, match=r"command line: data\.mean has 2 value\(s\) but data\.in_channels=6"):
        load_config(None, [*six, "data.mean=0.1,0.2"], normalization_unknown=True)
    in_file = tmp_path / "six.yaml"
    in_file.write_text("data:\n  dataset: folder\n  num_classes: 2\n  in_channels: 6\n")
    assert load_config(in_file, normalization_unknown=True).data.std == (1.0,) * 6
    assert load_config(None, TWO_CLASS_FOLDER, normalization_unknown=True).data.mean == (0.485, 0.456, 0.406)


def test_images_beyond_8_bit_rgb_are_folder_datasets_with_a_mean_and_std_per_channel():
    config = load_config(None, [*TWO_CLASS_FOLDER, "data.in_channels=4", "data.max_value=4095",
                                "data.mean=0.1,0.2,0.3,0.4", "data.std=0.5,0.5,0.5,0.5"])
    assert (config.data.in_channels, config.data.max_value, config.data.mean) == (4, 4095, (0.1, 0.2, 0.3, 0.4))
    assert from_dict(to_dict(config)).data == config.data
    with pytest.raises(ValueError, match=r"command line: data\.mean has 3 value\(s\) \(ImageNet's RGB values, the "
                                         r"default\) but data\.in_channels=1; give one value per channel, in units "
                                         r"of data\.max_value \(`python -m syncseg verify` prints them\)"):
        load_config(None, [*TWO_CLASS_FOLDER, "data.in_channels=1"])
    with pytest.raises(ValueError, match=r"data\.std has 2 value\(s\) but data\.in_channels=1"):
        load_config(None, [*TWO_CLASS_FOLDER, "data.in_channels=1", "data.mean=0.5", "data.std=0.2,0.2"])
    with pytest.raises(ValueError, match="data.in_channels=1 and data.max_value=255: images other than 8-bit RGB are "
                                         "read by dataset 'folder', 'coco', 'labelme', 'cvat', 'yolo_seg', 'label_studio', "
                                         "'cvat_mask', 'raster'; "
                                         "dataset 'synthetic' has 8-bit RGB images"):
        load_config(None, ["data.in_channels=1", "data.mean=0.5", "data.std=0.2"])
    with pytest.raises(ValueError, match="dataset 'voc' has 8-bit RGB images"):
        load_config(None, ["data.dataset=voc", "data.max_value=4095"])
    with pytest.raises(ValueError, match=r"data\.photometric \(colour jitter and blur\) works on 8-bit RGB images, not "
                                         r"on these \(data\.in_channels=3 and data\.max_value=65535\); set "
                                         r"data\.photometric=false"):
        load_config(None, [*TWO_CLASS_FOLDER, "data.max_value=65535", "data.photometric=true"])
    # 8-bit RGB of a smaller full scale stays every dataset's, photometric included
    assert load_config(None, ["data.max_value=100", "data.photometric=true"]).data.max_value == 100
