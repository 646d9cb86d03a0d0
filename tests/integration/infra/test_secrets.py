"""Credentials never reach the stored config: not the run flow's parameters, not config.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.infra import secrets
from rollflow.infra.config import load_config
from rollflow.infra.storage import RunStorage

ROOT = Path(__file__).resolve().parents[3]
PLANTED_KEY = "AKIAPLANTEDKEY000001"
PLANTED_SECRET = "planted-secret-value-7f3a9c"


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


@pytest.mark.slow
def test_a_planted_secret_is_in_neither_the_flow_parameters_nor_config_json(tmp_path, s3_endpoint):
    """A run given S3 credentials in run.storage_options, on a Prefect server the test can read:
    the run writes config.json and registers its flow run, then fails (vLLM cannot load the
    weights); the secret is in neither, nor in run.log, nor on the terminal.

    The same run is the error met while a run runs (weights that pass the preflight, a file is
    there, but that vLLM cannot load): exit 1, one error line and where its traceback is."""
    import shutil

    import fsspec

    from rollflow.infra.config import TinyModelSpec
    from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama, save_hf_dir

    from deployed_run import prefect_api
    from run_support import session_prefect_api

    tok = build_char_tokenizer()
    model = save_hf_dir(
        build_tiny_llama(
            TinyModelSpec(hidden_size=64, num_heads=2, intermediate_size=64), vocab_size=len(tok)
        ),
        tok,
        tmp_path / "model",
    )
    (model / "model.safetensors").write_bytes(b"broken on purpose")  # fails after config.json
    root = f"s3://rollflow/{tmp_path.name}"
    options = (
        f'run.storage_options={{endpoint_url="{s3_endpoint}", key="{PLANTED_KEY}", '
        f'secret="{PLANTED_SECRET}"}}'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"),
        AWS_DEFAULT_REGION="us-east-1",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
        AWS_CONFIG_FILE="/nonexistent",
        AWS_EC2_METADATA_DISABLED="true",
    )
    env.pop(secrets.SECRETS_ENV, None)
    api = session_prefect_api()
    env["PREFECT_API_URL"] = api
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollflow.cli",
            "run",
            "configs/quickstart.toml",
            "~model.tiny",
            f"model.path={model}",
            f"run.storage={root}",
            "run.name=planted",
            options,
            "metrics.sinks=[]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "note: run.storage_options key, secret kept out of the stored config" in proc.stderr
    # One line, no traceback; the traceback is in run.log (here local: the storage is S3).
    log = Path("~/.cache/rollflow/logs/planted/run.log").expanduser()
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"  (traceback in {log}; --debug prints it here)"
    print(errors[0])
    assert "Traceback" in log.read_text()
    runs = prefect_api(api, "/flow_runs/filter", {"flow_runs": {"name": {"any_": ["planted"]}}})
    assert runs, "the run flow never reached the Prefect API"
    parameters = json.dumps([r["parameters"] for r in runs])
    assert "planted" in parameters and s3_endpoint in parameters
    assert PLANTED_SECRET not in parameters and PLANTED_KEY not in parameters
    fs = fsspec.filesystem(
        "s3", endpoint_url=s3_endpoint, key="testing", secret="testing", skip_instance_cache=True
    )
    stored = fs.cat_file(f"rollflow/{tmp_path.name}/planted/config.json").decode()
    assert s3_endpoint in stored
    assert PLANTED_SECRET not in stored and PLANTED_KEY not in stored
    assert PLANTED_SECRET not in proc.stdout + proc.stderr
    assert PLANTED_SECRET not in log.read_text()
    shutil.rmtree(log.parent, ignore_errors=True)
