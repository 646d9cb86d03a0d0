"""The run deployment's parameters as a typed form: the run configuration's own sections.

Owns: the deployment's parameter schema (``form_schema``), the parameters ``rollflow deploy``
stores from a config file (``form_parameters``), and how a flow run's parameters become a
``RunConfig`` (``config_from_parameters``). Imports no torch and no flow: ``rollflow deploy``
uses it without loading the run's code.

The form is one field per setting, grouped by section (``run``, ``model``, ``envs``, ``train``,
...), with the types, defaults, bounds and descriptions of the config models, so the Prefect UI
renders it and Prefect validates a flow run's parameters against it before the run is created.
The deployment's parameters are the config file's values (the form starts from them). Two more
parameters:

- ``overrides``: ``key.path=value`` strings applied last, exactly as on ``rollflow run``;
- ``config``: a TOML path (relative to the deployment's working directory) or a whole config as a
  dict, run *instead of* the form's sections (what deployments registered before the form, and
  ``prefect deploy`` from prefect.yaml alone, pass).

A section given in part (``prefect deployment run … -p train='{"lr": 1e-4}'``: Prefect replaces
the deployment's whole ``train`` by that dict) is laid over the deployment's own section, so only
the keys given change. Credentials never travel as parameters: a config whose
``run.storage_options`` holds any is refused at deploy time (they stay in a Prefect Secret block,
``run.storage_secret``, or the worker's environment).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollflow.infra.config import dump_config, resolve_config
from rollflow.infra.config.root import RunConfig
from rollflow.infra.errors import ConfigError
from rollflow.infra.secrets import secret_option_names

SECTIONS: tuple[str, ...] = tuple(RunConfig.model_fields)  # run, model, envs, prompt, ...
EXTRA = ("overrides", "config")  # after the sections, in this order


def form_schema() -> dict[str, Any]:
    """The deployment's parameter schema (Prefect's form): every section of ``RunConfig`` with
    its fields' types, defaults, bounds and descriptions; then ``overrides`` and ``config``.
    Nothing is required: the deployment's parameters give every section."""
    schema = RunConfig.model_json_schema(ref_template="#/definitions/{model}")
    properties: dict[str, Any] = {}
    for position, name in enumerate(SECTIONS):
        prop = dict(schema["properties"][name])
        prop["position"] = position  # the order the UI shows them in
        properties[name] = prop
    properties["overrides"] = {
        "title": "overrides",
        "description": (
            "key.path=value strings applied last, as on `rollflow run` "
            '(e.g. "train.lr=1e-4", "envs.0.weight=2")'
        ),
        "type": "array",
        "items": {"type": "string"},
        "default": [],
        "position": len(SECTIONS),
    }
    properties["config"] = {
        "title": "config",
        "description": (
            "Run this TOML file (a path relative to the deployment's working directory) instead "
            "of the sections above; leave empty to run the form"
        ),
        "anyOf": [{"type": "string"}, {"type": "object"}, {"type": "null"}],
        "default": None,
        "position": len(SECTIONS) + 1,
    }
    return {
        "title": "Parameters",
        "type": "object",
        "properties": properties,
        "definitions": schema.get("$defs", {}),
    }


def form_parameters(config_path: Path, overrides: list[str] = ()) -> dict[str, Any]:
    """A deployment's parameters from a config file: its sections as resolved (overrides
    folded in), ``overrides`` empty. Raise ``ConfigError`` when the file puts credentials in
    ``run.storage_options``: a flow run's parameters are shown in the UI and kept by the API."""
    cfg = resolve_config(config_path, list(overrides))
    moved = secret_option_names(cfg.run.storage_options)
    if moved:
        raise ConfigError(
            f"{config_path}: run.storage_options holds credentials ({', '.join(moved)}); a "
            "deployment's parameters are shown in the Prefect UI, so they cannot travel there. "
            "Put them in a Prefect Secret block named by run.storage_secret, or in the worker's "
            "environment (AWS_ACCESS_KEY_ID, ...), and remove them from the file"
        )
    return {**dump_config(cfg), "overrides": []}


def config_from_parameters(
    parameters: Mapping[str, Any], deployment_parameters: Mapping[str, Any] | None = None
) -> RunConfig:
    """The run a flow run's ``parameters`` describe: ``config`` if given (the sections are then
    not used), else the sections, each given in part laid over the deployment's own; then
    ``overrides``. Raise ``ConfigError`` naming the key that is wrong."""
    overrides = list(parameters.get("overrides") or [])
    if parameters.get("config") is not None:
        return resolve_config(parameters["config"], overrides)
    base = deployment_parameters or {}
    data: dict[str, Any] = {}
    for name in SECTIONS:
        given = parameters.get(name)
        if given is None:
            if base.get(name) is not None:
                data[name] = copy.deepcopy(base[name])
            continue
        data[name] = _laid_over(base.get(name), given)
    if not data:
        raise ConfigError(
            "the run deployment got neither its sections (run, model, envs, ...) nor a config: "
            "pass -p config=configs/quickstart.toml, or register it with "
            "`rollflow deploy CONFIG`, which stores the config's sections as its parameters"
        )
    return resolve_config(data, overrides)


def _laid_over(base: Any, given: Any) -> Any:
    """``given`` laid over ``base``: mappings key by key (recursively), anything else replaced
    (a list, such as ``envs``, is taken whole)."""
    if isinstance(base, Mapping) and isinstance(given, Mapping):
        out = dict(copy.deepcopy(base))
        for key, value in given.items():
            out[key] = _laid_over(out.get(key), value)
        return out
    return copy.deepcopy(given)
