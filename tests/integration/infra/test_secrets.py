"""Credentials never reach the stored config: not the run flow's parameters, not config.json.

A whole run given credentials, checked for them everywhere it writes: the LoRA run on S3
(``tests/integration/flows/test_run.py``, ``assert_no_planted_secret``)."""

from __future__ import annotations

import json

from rollflow.infra import secrets
from rollflow.infra.config import load_config
from rollflow.infra.storage import RunStorage

from run_support import PLANTED_KEY, PLANTED_SECRET


def test_split_finds_secrets_at_any_depth():
    options = {
        "endpoint_url": "http://s3",
        "key": "k",
        "secret": "s",
        "client_kwargs": {"region_name": "x", "aws_secret_access_key": "deep"},
        "anon": False,
    }
    public, hidden = secrets.split_secrets(options)
    assert public == {
        "endpoint_url": "http://s3",
        "client_kwargs": {"region_name": "x"},
        "anon": False,
    }
    assert hidden == {"key": "k", "secret": "s", "client_kwargs": {"aws_secret_access_key": "deep"}}
    assert secrets.merge(public, hidden) == options


def test_moved_secrets_reach_storage_of_that_root_only(monkeypatch, s3_endpoint, tmp_path):
    monkeypatch.delenv(secrets.SECRETS_ENV, raising=False)
    root = f"s3://rollflow/{tmp_path.name}"
    cfg = load_config(
        "configs/quickstart.toml",
        [
            f"run.storage={root}",
            f'run.storage_options={{endpoint_url="{s3_endpoint}", key="{PLANTED_KEY}", secret="{PLANTED_SECRET}"}}',
        ],
    )
    assert secrets.take_secrets_out(cfg.run) == ["key", "secret"]
    assert cfg.run.storage_options == {"endpoint_url": s3_endpoint}
    assert PLANTED_SECRET not in json.dumps(cfg.model_dump(mode="json"))
    storage = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options)
    assert storage.options["secret"] == PLANTED_SECRET  # handed over through the environment
    assert "secret" not in RunStorage("s3://other", "r", {"endpoint_url": s3_endpoint}).options
