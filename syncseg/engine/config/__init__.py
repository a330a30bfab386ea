"""The run configuration: the schema (syncseg.engine.config.schema: every key, choice, limit and default, stated
once) and its files (syncseg.engine.config.io: YAML with a `base:` chain, KEY=VALUE overrides, plain dicts).

Import what you need from here: `from syncseg.engine.config import Config, load_config`.
"""
from syncseg.engine.config.io import (
    RENAMED_KEYS,
    build_config,
    config_yaml,
    flatten,
    from_dict,
    inference_config,
    load_config,
    parse_overrides,
    read_yaml,
    resolve_config_path,
    save_config,
    to_dict,
)
from syncseg.engine.config.fields import Limit, SquareIfOne
from syncseg.engine.config.schema import (
    CONFIG_DIR,
    SECTIONS,
    Config,
    DataConfig,
    DistConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    Precision,
    TrainConfig,
    all_keys,
    choices,
    field_types,
    validate,
)

__all__ = [
    "CONFIG_DIR", "RENAMED_KEYS", "SECTIONS", "Config",
    "DataConfig", "DistConfig", "EvalConfig", "Limit", "LogConfig", "ModelConfig", "Precision", "SquareIfOne",
    "TrainConfig",
    "all_keys", "build_config", "choices", "config_yaml", "field_types", "flatten", "from_dict",
    "inference_config", "load_config", "parse_overrides", "read_yaml", "resolve_config_path", "save_config",
    "to_dict", "validate",
]
