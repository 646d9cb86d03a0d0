"""The run deployment's typed form (run_form.py): its schema, the parameters `rollflow deploy`
stores, and how a flow run's parameters become the run's config (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect.utilities.schema_tools import validate

from rollflow.flows.run_form import (
    SECTIONS,
    config_from_parameters,
    form_parameters,
    form_schema,
)
from rollflow.infra.config import resolve_config
from rollflow.infra.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "configs/quickstart.toml"


def test_the_form_has_every_section_typed_with_defaults_bounds_and_descriptions():
    schema = form_schema()
    props = schema["properties"]
    assert list(props) == [*SECTIONS, "overrides", "config"]
    assert [props[name]["position"] for name in props] == list(range(len(props)))
    assert "required" not in schema  # the deployment's parameters give every section
    defs = schema["definitions"]
    lr = defs["TrainSection"]["properties"]["lr"]
    assert lr["type"] == "number" and lr["exclusiveMinimum"] == 0 and lr["default"] == 1e-4
    assert lr["description"] == "AdamW learning rate."
    assert props["envs"]["type"] == "array" and props["envs"]["items"]["$ref"].startswith(
        "#/definitions/"
    )
    for name in SECTIONS:  # every $ref resolves in the schema Prefect keeps
        ref = props[name].get("$ref") or props[name].get("items", {}).get("$ref")
        if ref:
            assert ref.removeprefix("#/definitions/") in defs


def test_prefect_accepts_the_quickstarts_parameters_and_refuses_a_bad_value_by_name():
    schema = form_schema()
    params = form_parameters(QUICKSTART)
    assert validate(params, schema, raise_on_error=False) == []
    bad = {**params, "train": {**params["train"], "lr": -1}}
    (error,) = validate(bad, schema, raise_on_error=False)
    assert list(error.path) == ["train", "lr"]
    typo = {**params, "train": {"lrr": 1e-4}}  # a misspelt key is refused too
    assert validate(typo, schema, raise_on_error=False)


def test_the_stored_parameters_are_the_configs_sections_with_its_overrides_folded_in():
    params = form_parameters(QUICKSTART, ["run.num_steps=7"])
    assert set(params) == {*SECTIONS, "overrides"} and params["overrides"] == []
    assert params["run"]["num_steps"] == 7 and params["train"]["lr"] == 3e-4
    assert config_from_parameters(params) == resolve_config(QUICKSTART, ["run.num_steps=7"])


def test_a_section_given_in_part_is_laid_over_the_deployments_own():
    deployed = form_parameters(QUICKSTART)
    # What the server hands the flow run for `-p train='{"lr": 1e-5}'`: that dict in place of
    # the deployment's whole train section.
    given = {**deployed, "train": {"lr": 1e-5}, "overrides": ["run.num_steps=3"]}
    cfg = config_from_parameters(given, deployed)
    assert cfg.train.lr == 1e-5
    assert cfg.train.mini_batch_size == 16  # the quickstart's, not TrainSection's default
    assert cfg.run.num_steps == 3  # overrides last
    nested = {**deployed, "model": {"tiny": {"num_layers": 3}}}
    cfg = config_from_parameters(nested, deployed)
    assert cfg.model.tiny.num_layers == 3 and cfg.model.tiny.hidden_size == 128


def test_config_runs_that_file_instead_of_the_sections():
    deployed = form_parameters(QUICKSTART)
    given = {**deployed, "config": str(QUICKSTART), "overrides": ["run.name=other"]}
    given["train"] = {"lr": 1e-5}  # not used: the file is the run
    cfg = config_from_parameters(given, deployed)
    assert cfg.train.lr == 3e-4 and cfg.run.name == "other"


def test_bad_parameters_name_the_key_and_nothing_given_says_what_to_pass():
    deployed = form_parameters(QUICKSTART)
    with pytest.raises(ConfigError, match=r"train\.lrr"):
        config_from_parameters({"train": {"lrr": 1}}, deployed)
    with pytest.raises(ConfigError, match="-p config=configs/quickstart.toml"):
        config_from_parameters({"overrides": []}, {})


def test_a_config_with_credentials_is_refused_at_deploy_time_naming_them(tmp_path):
    config = tmp_path / "s3.toml"
    config.write_text(
        QUICKSTART.read_text().replace(
            'storage = "runs"',
            'storage = "s3://bucket/runs"\nstorage_options = { key = "AKIA-secret-id", '
            'secret = "do-not-show", client_kwargs = { endpoint_url = "http://minio:9000" } }',
        )
    )
    with pytest.raises(
        ConfigError,
        match=r"s3\.toml: run\.storage_options holds credentials "
        r"\(key, secret\).*run\.storage_secret",
    ):
        form_parameters(config)
    public = tmp_path / "public.toml"
    public.write_text(
        QUICKSTART.read_text().replace(
            'storage = "runs"',
            'storage = "s3://bucket/runs"\nstorage_secret = "minio-creds"\n'
            'storage_options = { client_kwargs = { endpoint_url = "http://minio:9000" } }',
        )
    )
    params = form_parameters(public)
    assert params["run"]["storage_options"] == {
        "client_kwargs": {"endpoint_url": "http://minio:9000"}
    }
    assert params["run"]["storage_secret"] == "minio-creds"  # its name, never its value
