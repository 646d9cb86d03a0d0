"""Every error a user can cause is one line on the terminal, never a traceback.

The table lists each case with the line it prints (a prefix where the line goes on with a
list of known keys). Errors found before anything starts (config, overrides, preflight) exit
with 2 in well under 5 s; an error met while the run runs exits with 1, prints one line and
where its traceback is (run.log), and prints the traceback itself only with --debug.
Storage cases (S3 unreachable, no credentials, no bucket) are in tests/integration/flows/test_preflight.py;
an error met while the run runs (weights vLLM cannot load) is checked on the failing run of
tests/integration/infra/test_secrets.py.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollflow.cli import main

QUICKSTART = "configs/quickstart.toml"
ROOT = Path(__file__).resolve().parents[2]


def bad_model_config(tmp: Path) -> str:
    folder = tmp / "bad-model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{not json")
    (folder / "model.safetensors").write_bytes(b"x")
    return str(folder)


# (case, argv after `rollflow run`, the error lines: exact, or a prefix ending in "...")
CASES = [
    ("config file missing", ["nope.toml"], ["config file not found: nope.toml"]),
    (
        "misspelt key",
        [QUICKSTART, "train.lrr=1e-4"],
        [f"{QUICKSTART}: unknown key 'train.lrr'; did you mean 'train.lr'? (known: ..."],
    ),
    (
        "value out of bounds",
        [QUICKSTART, "train.lr=-1"],
        [f"{QUICKSTART}: train.lr: Input should be greater than 0"],
    ),
    (
        "two problems at once",
        [QUICKSTART, "train.lr=-1", "sampling.group_size=1"],
        [
            f"{QUICKSTART}: sampling.group_size: Input should be greater than or equal to 2",
            f"{QUICKSTART}: train.lr: Input should be greater than 0",
        ],
    ),
    (
        "cross-field check",
        [QUICKSTART, "train.mini_batch_size=256"],
        [f"{QUICKSTART}: <root>: Value error, train.mini_batch_size (256) must be <= ..."],
    ),
    (
        "override without a value",
        [QUICKSTART, "train.lr"],
        ["override 'train.lr' is not of the form key.path=value (or ~key.path to remove it)"],
    ),
    (
        "unset of an unknown key",
        [QUICKSTART, "~model.tinny"],
        ["override '~model.tinny': unknown key 'model.tinny'; did you mean 'model.tiny'? ..."],
    ),
    (
        "model folder missing",
        [QUICKSTART, "~model.tiny", "model.path=/nonexistent/model"],
        [
            "model.path = '/nonexistent/model': no such folder; give a Hugging Face model "
            "folder (config.json + *.safetensors) or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
        ],
    ),
    (
        "model config not JSON",
        [QUICKSTART, "~model.tiny", "model.path={bad_model}"],
        [
            "model.path = '{bad_model}': its config.json is not a Hugging Face model config "
            "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); ..."
        ],
    ),
    (
        "storage not writable",
        [QUICKSTART, "run.storage=/proc/rollflow"],
        [
            "run.storage = '/proc/rollflow': cannot write in /proc (No such file or directory); "
            "choose a writable folder"
        ],
    ),
    (
        "unknown environment",
        [QUICKSTART, 'envs=[{name="nope"}]'],
        ["envs[0].name = 'nope': unknown env 'nope' in [[envs]]: use one of ..."],
    ),
    (
        "dataset file missing",
        [QUICKSTART, 'envs=[{name="math", args={path="/nonexistent/math.jsonl"}}]'],
        ["envs[0].name = 'math': dataset /nonexistent/math.jsonl: no such file..."],
    ),
]


@pytest.mark.parametrize("case,argv,lines", CASES, ids=[c[0] for c in CASES])
def test_user_error_is_one_line(case, argv, lines, tmp_path, capsys):
    bad_model = bad_model_config(tmp_path)
    argv = [a.replace("{bad_model}", bad_model) for a in argv]
    if "run.storage" not in " ".join(argv):
        argv.append(f"run.storage={tmp_path / 'runs'}")
    start = time.monotonic()
    assert main(["run", *argv]) == 2
    assert time.monotonic() - start < 5.0
    out = capsys.readouterr()
    errors = [line for line in out.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == len(lines), out.err
    for got, want in zip(errors, lines, strict=True):
        want = "error: " + want.replace("{bad_model}", bad_model)
        if want.endswith("..."):
            assert got.startswith(want[:-3]), got
        else:
            assert got == want
    assert "Traceback" not in out.err + out.out


def test_cli_subprocess_prints_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", "run", QUICKSTART, "train.lr=-1"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {QUICKSTART}: train.lr: Input should be greater than 0"
    ]
