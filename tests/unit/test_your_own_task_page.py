"""docs/guides/your-own-task.md: every block on the page is run. Here: its files are written as
the page gives them, its reward function scores as it says, `rollflow prepare gsm8k ...` runs as
written (offline, on a GSM8K hub cache made here), `rollflow run task.toml --dry-run` passes and
`rollflow serve` (dry run) would start the server a run starts.
`rollflow run task.toml` and `rollflow status --config task.toml` are run by
tests/integration/flows/test_your_own_task.py (a real run, on a tiny model)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from rollflow.cli import main

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guides" / "your-own-task.md"
RUN_BY_THE_INTEGRATION_TEST = {"rollflow run task.toml", "rollflow status --config task.toml"}


def page_files() -> dict[str, str]:
    return dict(re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', PAGE.read_text(), re.S))


def page_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def write_page_files(where: Path) -> None:
    for name, text in page_files().items():
        (where / name).write_text(text)


def test_the_page_is_in_the_site_nav():
    assert "guides/your-own-task.md" in (ROOT / "mkdocs.yml").read_text()


def test_every_command_is_run_by_a_test():
    here = {"rollflow run task.toml --dry-run", PREPARE, SERVE}
    assert set(page_commands()) == here | RUN_BY_THE_INTEGRATION_TEST


def test_the_reward_scores_as_the_page_says(tmp_path):
    write_page_files(tmp_path)
    namespace: dict = {}
    exec((tmp_path / "rewards.py").read_text(), namespace)
    completions = [
        [{"role": "assistant", "content": " Paris\n"}],
        [{"role": "assistant", "content": "Lyon"}],
    ]
    assert namespace["accuracy"](completions=completions, answer=["Paris", "Paris"]) == [1.0, 0.0]


def test_the_config_passes_the_dry_run(tmp_path, monkeypatch, capsys):
    write_page_files(tmp_path)
    # The page's two rows, and more of their form: a tenth of them is held out.
    with (tmp_path / "data.jsonl").open("a") as data:
        for i in range(100):
            row = {"prompt": [{"role": "user", "content": f"{i} + 1 = ?"}], "answer": str(i + 1)}
            data.write(json.dumps(row) + "\n")
    monkeypatch.chdir(tmp_path)
    command = shlex.split("rollflow run task.toml --dry-run")
    assert main(command[1:]) == 0
    out = capsys.readouterr()
    resolved = json.loads(out.out)
    assert resolved["prompt"]["chat_template"] == "auto"
    assert resolved["envs"][0]["rewards"][0]["fn"] == "rewards.py:accuracy"
    assert "env dataset: loads" in out.err


SERVE = "rollflow serve task.toml --port 8000"


def test_serve_starts_the_server_a_run_would(tmp_path, monkeypatch, capsys):
    """The page's `rollflow serve`, with --dry-run: the command line of the server it starts
    (the same ``InferenceServer`` every run starts; nothing is downloaded or started here)."""
    write_page_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ROLLFLOW_VLLM_URLS", raising=False)
    assert main([*shlex.split(SERVE)[1:], "--dry-run"]) == 0
    out = capsys.readouterr().out
    command = shlex.split(out.splitlines()[0])[1:]
    for flag, value in [
        ("--model", "Qwen/Qwen3-0.6B"),
        ("--port", "8000"),
        ("--served-model-name", "policy"),
        ("--worker-extension-cls", "rollflow.inference.worker_extension.WeightReceiver"),
    ]:
        assert command[command.index(flag) + 1] == value, command
    assert "ROLLFLOW_VLLM_URLS=http://127.0.0.1:8000" in out


PREPARE = "rollflow prepare gsm8k openai/gsm8k data/gsm8k-train.jsonl --subset main --split train"


def gsm8k_hub_cache(hf_home: Path) -> None:
    """What `load_dataset("openai/gsm8k", "main")` leaves in the datasets cache, from local rows
    (tests/unit/tasks/generate/test_dataset_sources.py's hub_cache, with the subset "main")."""
    from datasets.packaged_modules.json.json import Json

    rows = [
        {"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"{i}+2\n#### {i + 2}"}
        for i in range(5)
    ]
    hf_home.mkdir()
    data = hf_home / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = hf_home / "datasets"
    builder = Json(
        cache_dir=str(cache),
        dataset_name="gsm8k",
        config_name="main",
        config_id="main",
        hash="0123abcd",
        data_files={"train": str(data)},
    )
    builder.download_and_prepare()
    (cache / "gsm8k").rename(cache / "openai___gsm8k")


def test_prepare_runs_as_written(tmp_path):
    gsm8k_hub_cache(tmp_path / "hf")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", *shlex.split(PREPARE)[1:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "data/gsm8k-train.jsonl").read_text().splitlines()
    ]
    assert [r["answer"] for r in rows] == ["2", "3", "4", "5", "6"]
