"""`rollflow export`: a committed checkpoint as a HF model folder that transformers loads."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollflow.cli import main
from rollflow.infra.export import InputError, export_checkpoint
from rollflow.infra.storage import RunStorage


@pytest.fixture
def run_with_checkpoints(tmp_path, tiny_model_dir):
    """A run whose steps 1-3 and 5 hold committed checkpoints (model + trainer state), step 6 a half-written one."""
    storage = RunStorage(str(tmp_path / "runs"), "r")
    for step in (1, 2, 3, 5, 6):
        folder = tmp_path / "runs/r/checkpoints" / f"step={step}"
        shutil.copytree(tiny_model_dir, folder)
        (folder / "trainer").mkdir()
        save_file({"exp_avg": torch.zeros(3)}, folder / "trainer/optimizer.safetensors")
        (folder / "trainer/state.json").write_text("{}")
        if step != 6:
            storage.commit("checkpoints", step)
    return storage


def test_export_is_a_hf_folder_without_trainer_state(
    run_with_checkpoints, tmp_path, tiny_model_dir
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_checkpoint(run_with_checkpoints, 5, tmp_path / "exported", show_progress=False)
    names = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    assert "model.safetensors" in names and "config.json" in names
    assert not any(n.startswith("trainer") for n in names) and "_SUCCESS" not in names
    model = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    saved = load_file(tiny_model_dir / "model.safetensors")
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())


def test_a_step_without_committed_checkpoint_names_the_steps_there_are(
    run_with_checkpoints, tmp_path
):
    for step in (4, 6):  # never written / half-written
        with pytest.raises(
            InputError, match=f"no committed checkpoint of step {step} .*committed steps: 1-3, 5"
        ):
            export_checkpoint(run_with_checkpoints, step, tmp_path / "x", show_progress=False)
    assert not (tmp_path / "x").exists()


def test_export_never_writes_into_a_folder_that_holds_something(run_with_checkpoints, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(
        InputError, match="already exists and is not an empty folder; pass another --out"
    ):
        export_checkpoint(run_with_checkpoints, 1, out, show_progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_cli_export_and_its_error(run_with_checkpoints, tmp_path, capsys):
    root = str(tmp_path / "runs")
    assert (
        main(["export", "r", "--step", "2", "--storage", root, "--out", str(tmp_path / "m")]) == 0
    )
    assert f"exported step 2 of run r to {tmp_path / 'm'}" in capsys.readouterr().out
    assert main(["export", "r", "--step", "9", "--storage", root]) == 2
    assert "committed steps: 1-3, 5" in capsys.readouterr().err
    assert main(["export", "nope", "--step", "1", "--storage", root]) == 2
    assert f"no run 'nope' in {root} (nothing at {root}/nope)" in capsys.readouterr().err


@pytest.mark.slow
def test_export_of_a_trained_run_loads_and_matches_its_checkpoint(deployed_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "quickstart-2"
    assert (
        main(
            [
                "export",
                "quickstart",
                "--step",
                "2",
                "--storage",
                str(deployed_run.storage),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    trained = load_file(deployed_run.run_dir / "checkpoints/step=2/model.safetensors")
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in trained.items())
    assert (deployed_run.run_dir / "checkpoints/step=2/trainer").is_dir() and not (
        out / "trainer"
    ).exists()


def test_a_lora_checkpoint_exports_its_adapter_or_the_merged_model(
    run_with_checkpoints, tmp_path, capsys
):
    folder = tmp_path / "runs/r/checkpoints/step=5/adapter"
    folder.mkdir()
    save_file(
        {"base_model.model.x.lora_A.weight": torch.ones(2, 2)}, folder / "adapter_model.safetensors"
    )
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    adapter = export_checkpoint(run_with_checkpoints, 5, tmp_path / "adapter", show_progress=False)
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    merged = export_checkpoint(
        run_with_checkpoints, 5, tmp_path / "merged", show_progress=False, merged=True
    )
    names = {p.relative_to(merged).as_posix() for p in merged.rglob("*")}
    assert "model.safetensors" in names and not any(n.startswith("adapter") for n in names)
    storage = ["--storage", str(tmp_path / "runs")]
    assert main(["export", "r", "--step", "5", "--out", str(tmp_path / "cli"), *storage]) == 0
    assert "exported the LoRA adapter of step 5" in capsys.readouterr().out
