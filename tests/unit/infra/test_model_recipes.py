"""The Qwen3 and Llama 3 math recipes (configs/recipes/qwen3-*.toml, llama3-*.toml): each states
its published target with a source, trains with the plain reward function beside it, and both of
its plans (the "1 GPU:" and "8 GPUs:" command lines of its header) load and place."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rollflow.cli import render_plan
from rollflow.infra.config import load_config
from rollflow.tasks.generate.reward_fns import load_reward_fn

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted(
    [
        *(ROOT / "configs/recipes").glob("qwen3-*.toml"),
        *(ROOT / "configs/recipes").glob("llama3-*.toml"),
    ]
)
PLAN = re.compile(r"^#\s+(\d+) GPUs?:\s+rollflow run (\S+)(.*)$", re.MULTILINE)


def test_qwen3_and_llama3_from_small_to_8b():
    models = {load_config(r).model.path for r in RECIPES}
    assert {"Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B"} <= models
    assert {"meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"} <= models


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_states_its_target_and_uses_a_plain_reward(recipe):
    text = recipe.read_text()
    assert re.search(r"Target \(a published figure, never run here\): GSM8K \d+\.\d%", text)
    assert "arXiv:2505.09388" in text or "model card" in text  # its source
    cfg = load_config(recipe)
    assert cfg.prompt.chat_template == "auto"
    [env] = cfg.envs
    [spec] = env.rewards
    fn = load_reward_fn(str(ROOT / spec.fn), spec.weight)
    assert fn.fn(completion="So she has \\boxed{18} eggs.", answer="18") == 1.0
    assert fn.fn(completion="She has 17 eggs.", answer="18") == 0.0


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_both_plans_place(recipe):
    plans = {
        int(n): (path, shlex.split(rest)) for n, path, rest in PLAN.findall(recipe.read_text())
    }
    assert sorted(plans) == [1, 8], f"{recipe.name}: its header names no 1- and 8-GPU plans"
    for gpus, (path, overrides) in plans.items():
        assert ROOT / path == recipe
        cfg = load_config(recipe, overrides)
        text = render_plan(cfg, gpus=gpus)
        assert "weight group:" in text, text
        if gpus == 1:
            assert cfg.inference.colocate
        else:  # vLLM and the trainer on GPUs of their own, every GPU used
            assert not cfg.inference.colocate and cfg.train.lora is None
            used = cfg.inference.num_servers * cfg.inference.tensor_parallel_size
            assert used + cfg.trainer.num_ranks == 8
