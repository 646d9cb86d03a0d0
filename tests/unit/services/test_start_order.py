"""The order the run starts its services in (RunServices.start), on plans for GPU machines; no
process is started: the trainer's and vLLM's starts are recorded instead."""

from __future__ import annotations

import pytest

from rollflow.infra.config import load_config
from rollflow.infra.placement import Machine
from rollflow.services.run_services import RunServices


class Started(Exception):
    """The trainer's start, recorded: nothing after it is needed here."""


class Supervisor:
    def __init__(self, calls: list[str], slot: int):
        self.calls, self.slot = calls, slot

    def spawn(self) -> None:
        self.calls.append(f"vllm-{self.slot} spawned")

    def wait_ready(self) -> None:
        self.calls.append(f"vllm-{self.slot} ready")


class Maker:
    placed = False

    def __init__(self, calls: list[str]):
        self.calls = calls

    def check(self, *args) -> None:
        pass

    def prepare(self, *args) -> None:
        pass

    def __call__(self, slot: int) -> Supervisor:
        return Supervisor(self.calls, slot)


def start_order(tmp_path, *overrides: str) -> list[str]:
    cfg = load_config(
        "configs/quickstart.toml", [f"run.storage='{tmp_path}'", "run.name='order'", *overrides]
    )
    calls: list[str] = []
    run = RunServices(cfg, "unused", None, tmp_path / "logs", lambda _: None, Machine(gpus=2))
    run.maker = run.servers.maker = Maker(calls)

    def trainer_start(*args) -> None:
        calls.append("trainer started")
        raise Started

    run.life.start = trainer_start
    run.stop = lambda: None
    with pytest.raises(Started):
        run.start()
    return calls


def test_colocated_on_a_gpu_vllm_is_ready_before_the_trainer_loads_beside_it(tmp_path):
    """vLLM sizes its KV cache from the GPU memory free while it profiles: the trainer, on the
    same GPU, loaded at the same time and its memory was counted against vLLM's cache."""
    calls = start_order(tmp_path, "inference.colocate=true", "inference.num_servers=2")
    assert calls == [
        "vllm-0 spawned",
        "vllm-1 spawned",
        "vllm-0 ready",
        "vllm-1 ready",
        "trainer started",
    ]


def test_on_gpus_of_their_own_the_trainer_loads_while_vllm_starts(tmp_path):
    assert start_order(tmp_path) == ["trainer started"]  # first: the two load at once
