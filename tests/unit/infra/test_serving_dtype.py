"""The serving dtype has one owner (InferenceSection.serving_dtype): vLLM serves it and the
trainer sends weights in it (issue 26, items 1 and 11)."""

from __future__ import annotations

import pytest

from rollflow.infra.config import InferenceSection, TrainerServiceSection, load_config
from rollflow.infra.errors import ConfigError
from rollflow.infra.placement import Machine
from rollflow.services.run_services import RunServices
from rollflow.services.trainer_life import trainer_args
from rollflow.services.vllm_server import InferenceServer


def test_auto_serves_bf16_on_gpus_and_fp32_on_cpu():
    assert InferenceSection().serving_dtype(on_gpu=True) == "bfloat16"
    assert InferenceSection().serving_dtype(on_gpu=False) == "float32"
    assert InferenceSection(dtype="bfloat16").serving_dtype(on_gpu=False) == "bfloat16"


def test_mixed_precision_auto_is_bf16_on_gpus_only():
    assert TrainerServiceSection().bf16(on_gpu=True) and not TrainerServiceSection().bf16(
        on_gpu=False
    )
    assert TrainerServiceSection(mixed_precision="bf16").bf16(on_gpu=False)
    assert not TrainerServiceSection(mixed_precision="off").bf16(on_gpu=True)


def test_deepspeed_runs_zero_1_where_the_stage_is_unset():
    assert TrainerServiceSection(backend="deepspeed").deepspeed_stage() == 1
    assert TrainerServiceSection(backend="deepspeed", zero_stage=3).deepspeed_stage() == 3


def test_a_recipe_cannot_set_the_dtype_behind_the_trainers_back():
    with pytest.raises(ConfigError, match="set inference.dtype instead"):
        load_config("configs/quickstart.toml", ["inference.extra_args=['--dtype', 'float16']"])


def test_the_server_serves_the_runs_dtype_and_fp32_by_default_on_cpu(tiny_model_dir):
    cmd = InferenceServer(tiny_model_dir, extra_args=["--dtype", "bfloat16"]).command()
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd.count("--dtype") == 1
    cmd = InferenceServer(tiny_model_dir).command()
    assert cmd[cmd.index("--dtype") + 1] == "float32"


@pytest.mark.parametrize(
    "gpus, overrides, want",
    [
        (0, [], "float32"),
        (0, ["inference.dtype=bfloat16"], "bfloat16"),
        (8, [], "bfloat16"),
    ],
)
def test_the_run_serves_and_sends_one_dtype(tmp_path, gpus, overrides, want):
    """What the plan gives every vLLM server (--dtype) is what the trainer is told to send."""
    cfg = load_config("configs/quickstart.toml", overrides)
    services = RunServices(cfg, "/m", None, tmp_path, machine=Machine(gpus=gpus, cpus=16))
    assert services.weight_dtype == want
    assert services.plan.server_args(0)[:2] == ["--dtype", want]
    assert trainer_args(cfg, "/m", None, services.weight_dtype).weight_dtype == want
