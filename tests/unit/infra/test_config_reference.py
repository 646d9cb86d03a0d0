"""Every key of the config tree documents itself: the configuration reference is generated from
the models' ``Field(description=...)``, so a key without one would be a hole in the docs."""

import typing

from pydantic import BaseModel

from rollflow.infra.config import RunConfig


def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``X``, ``X | None``, ``list[X]``, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Literal,):
        return []
    found = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def config_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> dict[str, object]:
    """Every key reachable from ``model`` as ``section.key`` -> its pydantic FieldInfo."""
    keys = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        keys[path] = field
        for sub in _models_in(field.annotation):
            keys |= config_keys(sub, f"{path}.")
    return keys


def test_every_config_key_has_a_description():
    missing = [
        path for path, field in config_keys().items() if not (field.description or "").strip()
    ]
    assert not missing, f"config keys without Field(description=...): {', '.join(missing)}"


def test_the_walk_reaches_every_section():
    keys = config_keys()
    for path in ("run.name", "model.tiny.hidden_size", "envs.weight", "train.loss.kind"):
        assert path in keys
    for path in ("train.lora.rank", "metrics.wandb.project", "trainer.num_ranks"):
        assert path in keys
