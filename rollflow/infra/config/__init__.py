"""One typed config tree for a run, loaded from TOML with ``key.path=value`` overrides.

Every section forbids unknown keys, so a misspelt key fails at load time with a message that
names it (and suggests the closest known key). Each section has its module; a default or a check
of one section lives beside its field, and the checks that span sections live in one validator on
``RunConfig`` (``root.py``) with messages a user can act on. Every field carries a one-line
description: the configuration reference is generated from them.

Owns: every default of the run's config. Everything is re-exported here, so callers import from
``rollflow.infra.config``.
"""

from rollflow.infra.config.base import Section
from rollflow.infra.config.inference_section import InferenceSection, vllm_flag
from rollflow.infra.config.loading import (
    UNSET_VALUES,
    apply_override,
    dump_config,
    load_config,
    resolve_config,
    validate_config,
)
from rollflow.infra.config.loss import VLLM_MAX_LORA_RANKS, LoraSection, LossConfig
from rollflow.infra.config.metrics_section import MetricsSection, MlflowOptions, WandbOptions
from rollflow.infra.config.model_section import DEFAULT_ALPHABET, ModelSection, TinyModelSpec
from rollflow.infra.config.root import RunConfig
from rollflow.infra.config.run_section import RunSection
from rollflow.infra.config.sampling_section import EnvSpec, PromptSection, SamplingSection
from rollflow.infra.config.train_section import TrainSection
from rollflow.infra.config.trainer_section import TrainerServiceSection
from rollflow.infra.errors import ConfigError
from rollflow.infra.staleness import STALENESS_EPS

__all__ = [
    "DEFAULT_ALPHABET",
    "STALENESS_EPS",
    "UNSET_VALUES",
    "VLLM_MAX_LORA_RANKS",
    "ConfigError",
    "EnvSpec",
    "InferenceSection",
    "vllm_flag",
    "LoraSection",
    "LossConfig",
    "MetricsSection",
    "MlflowOptions",
    "ModelSection",
    "PromptSection",
    "RunConfig",
    "RunSection",
    "SamplingSection",
    "Section",
    "TinyModelSpec",
    "TrainSection",
    "TrainerServiceSection",
    "WandbOptions",
    "apply_override",
    "dump_config",
    "load_config",
    "resolve_config",
    "validate_config",
]
