"""One typed config tree, loaded from a YAML recipe plus dotted command-line overrides.

Each component owns its section. Loading validates every key and type: a misspelt key names its
dotted path and suggests the closest valid key; a wrong type names the path and the expected
type; a value out of its field's bounds, or at odds with another field, names its path and what
was expected. All raise :class:`treadle.core.errors.UserError`.

- :mod:`~treadle.config.sections`, :mod:`~treadle.config.data`,
  :mod:`~treadle.config.algorithm`, :mod:`~treadle.config.environment`: the section
  dataclasses, each field with its bounds.
- :mod:`~treadle.config.fields`: the one-field rules (``at_least``, ...) and their walk.
- :mod:`~treadle.config.checks`: the rules that relate fields to each other.
- :mod:`~treadle.config.loading`: recipes, ``base:``, overrides, and type coercion.
"""

from treadle.config.algorithm import (
    GROUP_BASELINES,
    AlgorithmConfig,
    CriticConfig,
    KLConfig,
    MismatchConfig,
)
from treadle.config.data import DataConfig, DataSource, MixConfig, SourceConfig
from treadle.config.environment import EnvironmentConfig
from treadle.config.loading import load_config, to_dict
from treadle.config.sections import (
    Config,
    DeepSpeedConfig,
    DPOConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    NoiseConfig,
    ParamValue,
    PlacementConfig,
    RewardConfig,
    RewardSpec,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    TinyModelConfig,
    TrainerConfig,
    routes_to,
)

__all__ = [
    "GROUP_BASELINES",
    "AlgorithmConfig",
    "Config",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "DataSource",
    "DeepSpeedConfig",
    "EnvironmentConfig",
    "EvalConfig",
    "KLConfig",
    "LoraConfig",
    "MismatchConfig",
    "MixConfig",
    "ModelConfig",
    "NoiseConfig",
    "ParamValue",
    "PlacementConfig",
    "RewardConfig",
    "RewardSpec",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SourceConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "load_config",
    "routes_to",
    "to_dict",
]
