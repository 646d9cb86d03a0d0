"""Every recipe under configs/recipes passes `rollflow run --dry-run` without its model present."""

import json
import sys
from pathlib import Path

import pytest

from rollflow.cli import main

RECIPES = sorted(Path("configs/recipes").glob("*.toml"))


def test_there_are_recipes_for_one_node_and_for_several():
    assert {r.name for r in RECIPES} >= {"qwen2.5-1.5b-math-gspo.toml", "multi-node-math.toml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_passes_dry_run_without_the_model(recipe, capsys, tmp_path):
    # The recipes' storage is a placeholder (s3.example.internal): the preflight probes it.
    storage = [f"run.storage={tmp_path}", "~run.storage_options"]
    # GSM8K as `rollflow prepare gsm8k` writes it, in small: the recipes that name
    # data/gsm8k-*.jsonl read these instead (nothing is downloaded here).
    gsm8k = []
    for split, key, start in (("train", "path", 0), ("test", "eval_path", 10)):
        data = tmp_path / f"gsm8k-{split}.jsonl"
        rows = [
            {"problem": f"Tom has {i} apples and buys 2. How many now?", "answer": i + 2}
            for i in range(start, start + 10)
        ]
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        gsm8k.append(f"envs.0.args.{key}={data}")
    assert main(["run", str(recipe), "--dry-run", *storage, *gsm8k]) == 0
    out = capsys.readouterr()
    resolved = json.loads(out.out)
    assert not Path(resolved["model"]["path"]).exists()  # a hub id: the dry run never loads it
    assert [e["name"] for e in resolved["envs"]] == ["math"] and "env math: loads" in out.err
    train = resolved["train"]
    assert train["train_batch_size"] % train["mini_batch_size"] == 0


def test_dry_run_probes_the_storage():
    recipe = "configs/recipes/multi-node-math.toml"
    assert main(["run", recipe, "--dry-run"]) == 2


def write_config(tmp_path, body: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(
        f'[run]\nstorage = "{tmp_path}/runs"\n[model]\npath = "Qwen/Qwen2.5-0.5B-Instruct"\n' + body
    )
    return str(path)


def test_dry_run_names_a_missing_dataset(tmp_path, capsys):
    config = write_config(
        tmp_path, f'[[envs]]\nname = "math"\nargs = {{ path = "{tmp_path}/none.jsonl" }}\n'
    )
    assert main(["run", config, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"dataset {tmp_path}/none.jsonl: no such file" in err


def test_dry_run_reports_malformed_rows_and_a_sink_without_its_package(
    tmp_path, capsys, monkeypatch
):
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(30))
        + "{broken\n"
    )
    config = write_config(tmp_path, f'[[envs]]\nname = "dataset"\nargs = {{ path = "{data}" }}\n')
    assert main(["run", config, "--dry-run"]) == 0
    assert "env dataset: loads, 1 malformed dataset rows skipped" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main(["run", config, "--dry-run", 'metrics.sinks=["wandb"]']) == 2
    assert (
        "the wandb package is not installed: pip install 'rollflow[wandb]'"
        in capsys.readouterr().err
    )
