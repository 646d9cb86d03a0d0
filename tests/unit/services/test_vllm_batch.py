"""A run's vLLM servers hold every sequence the run keeps in flight in one batch: --max-num-seqs
is max_concurrency x group_size (within MAX_NUM_SEQS) unless inference.extra_args set it. vLLM's
own CPU default, 128, decoded the quickstart's 64 requests x 8 in 4 waves."""

from __future__ import annotations

import pytest

from rollflow.infra.config import RunConfig
from rollflow.infra.config.inference_section import MAX_NUM_SEQS, vllm_flag
from rollflow.services.vllm_supervisor import InferenceSupervisor


def _cfg(model_dir, inference: dict, group_size: int = 8) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "envs": [{"name": "math"}],
            "sampling": {"group_size": group_size},
            "inference": inference,
        }
    )


@pytest.mark.parametrize(
    ("inference", "group_size", "max_num_seqs"),
    [
        ({}, 8, "512"),  # the quickstart: 64 requests x 8
        ({"max_concurrency": 16}, 4, str(MAX_NUM_SEQS[0])),  # never below vLLM's usual 256
        ({"max_concurrency": 256}, 16, str(MAX_NUM_SEQS[1])),  # never above its largest default
        ({"extra_args": ["--max-num-seqs", "96"]}, 8, "96"),  # the user's, once
        ({"extra_args": ["--max-num-seqs=2000"]}, 8, "2000"),
    ],
)
def test_the_run_server_batches_what_the_run_keeps_in_flight(
    tiny_model_dir, tmp_path, inference, group_size, max_num_seqs
):
    cfg = _cfg(tiny_model_dir, inference, group_size)
    cmd = InferenceSupervisor(cfg, tiny_model_dir, tmp_path).server.command()
    assert vllm_flag(cmd, "--max-num-seqs") == max_num_seqs
    assert sum(a.startswith("--max-num-seqs") for a in cmd) == 1, cmd
