"""The trainer launchers' exact command lines: which GPUs DeepSpeed's own launcher gives the ranks."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

from rollflow.infra.config import TrainerServiceSection, TrainSection
from rollflow.infra.errors import ConfigError
from rollflow.services.trainer_process import (
    TrainerProcess,
    deepspeed_world_info,
    launcher_argv,
    node_argv,
    node_command,
)
from rollflow.trainer.protocol import ServiceArgs

runner = pytest.importorskip("deepspeed.launcher.runner")


def deepspeed_devices(argv: list[str], gpus_on_host: int = 8) -> dict[str, list[int]]:
    """The GPU indices DeepSpeed's launcher hands each host's ranks for ``argv``, by its own code
    (runner.main: hostfile or all local GPUs, --include/--exclude, --num_nodes/--num_gpus; or, on
    several nodes, the per-node launcher's --world_info; launch.py then sets each node's ranks'
    CUDA_VISIBLE_DEVICES to exactly its entry)."""
    if "deepspeed.launcher.launch" in argv:
        from deepspeed.launcher import launch

        i = argv.index("deepspeed.launcher.launch")
        saved, sys.argv = sys.argv, ["launch", *argv[i + 1 :]]
        try:
            args = launch.parse_args()
        finally:
            sys.argv = saved
        return json.loads(base64.urlsafe_b64decode(args.world_info))
    i = argv.index("deepspeed.launcher.runner")
    args = runner.parse_args(argv[i + 1 :])
    pool = runner.fetch_hostfile(args.hostfile) or {"localhost": gpus_on_host}
    if args.include and (args.num_nodes >= 0 or args.num_gpus >= 0):
        raise ValueError("Cannot specify num_nodes/gpus with include/exclude")  # runner.main's
    active = runner.parse_inclusion_exclusion(pool, args.include, args.exclude)
    return dict(runner.apply_num_nodes_and_gpus(active, args.num_nodes, args.num_gpus))


def test_one_fsdp2_rank_on_one_node_starts_without_a_launcher():
    """Its command is the rank itself; two ranks, a second node or DeepSpeed keep a launcher."""
    alone = [sys.executable, "-m", "rollflow.trainer.rank_main", "a.json"]
    assert launcher_argv("fsdp2", 1, "a.json", 29500) == alone
    assert launcher_argv("fsdp2", 1, "a.json", 29500, gpus="3") == alone  # CUDA_VISIBLE_DEVICES
    assert "torch.distributed.run" in launcher_argv("fsdp2", 2, "a.json", 29500)
    assert "torch.distributed.run" in launcher_argv("fsdp2", 1, "a.json", 29500, num_nodes=2)
    assert "deepspeed.launcher.launch" in launcher_argv("deepspeed", 1, "a.json", 29500)


def test_deepspeed_ranks_get_the_plans_gpus_not_the_first_ones():
    argv = launcher_argv("deepspeed", 4, "a.json", 29500, gpus="4,5,6,7")
    assert deepspeed_devices(argv) == {"node-0": [4, 5, 6, 7]}
    # on CPU there are no GPUs to name: the rank count
    assert deepspeed_devices(launcher_argv("deepspeed", 2, "a.json", 29500)) == {"node-0": [0, 1]}


def test_one_deepspeed_node_gets_the_launcher_its_runner_would_start():
    """On one node the ``deepspeed`` command (its runner) only starts its per-node launcher with
    the world it read from ``--include`` (or ``--num_gpus``), then waits: the command starts that
    launcher itself, with the same devices and rank count."""
    for gpus, num_ranks, include in (("4,5,6,7", 4, "localhost:4,5,6,7"), (None, 2, "")):
        active = runner.parse_inclusion_exclusion({"localhost": 8}, include, "")
        active = runner.apply_num_nodes_and_gpus(active, -1, -1 if gpus else num_ranks)
        by_runner = json.loads(base64.urlsafe_b64decode(runner.encode_world_info(active)))
        ours = deepspeed_devices(launcher_argv("deepspeed", num_ranks, "a", 1, gpus=gpus))
        assert list(ours.values()) == list(by_runner.values()), (ours, by_runner)


def test_trainer_process_passes_the_plans_devices_to_deepspeed(tmp_path):
    args = ServiceArgs(
        model_path="m",
        storage_root=str(tmp_path),
        run="r",
        train=TrainSection(),
        trainer=TrainerServiceSection(backend="deepspeed", num_ranks=2, device="cuda"),
    )
    proc = TrainerProcess(
        args, token="t", log_dir=tmp_path, device_env={"CUDA_VISIBLE_DEVICES": "2,3"}
    )
    assert deepspeed_devices(proc.process.argv) == {"node-0": [2, 3]}


def test_two_node_deepspeed_names_each_nodes_gpus(tmp_path, monkeypatch):
    trainer = TrainerServiceSection(
        backend="deepspeed", num_ranks=2, num_nodes=2, master_addr="n0", device="cuda"
    )
    monkeypatch.chdir(tmp_path)  # nothing written anywhere: the commands hold it all
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}  # node 0: vLLM has 0 and 1
    node0 = node_argv(trainer, 0, tmp_path / "trainer-args.json", 29500, env)
    assert deepspeed_devices(node0) == {"node-0": [2, 3], "node-1": [0, 1]}
    node1 = node_argv(
        trainer, 1, tmp_path / "trainer-args.json", 29500, {"CUDA_VISIBLE_DEVICES": "0,1"}
    )
    assert deepspeed_devices(node1)["node-1"] == [0, 1]
    assert list(tmp_path.iterdir()) == []


def test_the_world_in_the_command_is_what_deepspeeds_runner_reads_from_a_hostfile():
    """The per-node launcher gets what DeepSpeed's runner would have handed it under --no_ssh
    after reading a hostfile and --include, byte for byte."""
    pool = runner._parse_hostfile(["node-0 slots=4", "node-1 slots=4", "node-2 slots=4"])
    active = runner.parse_inclusion_exclusion(pool, "node-0:0,1@node-1:2,3@node-2:0,1", "")
    assert runner.encode_world_info(active) == deepspeed_world_info("2,3", 2, 3, 1)
    cpu = runner.parse_inclusion_exclusion(
        runner._parse_hostfile(["node-0 slots=1", "node-1 slots=1"]), "", ""
    )
    assert runner.encode_world_info(cpu) == deepspeed_world_info(None, 1, 2, 1)


def test_another_hosts_deepspeed_node_starts_from_its_command_on_its_own_gpus(
    tmp_path, monkeypatch
):
    """Node 1 of a DeepSpeed trainer across hosts, its command made where it runs (a placed
    node's flow run) in a folder without any of node 0's files: DeepSpeed's launcher finds the
    world in the command, and this node's ranks on its host's first GPUs (the worker's 6,7).
    Before, the command named ``--hostfile=<node 0's folder>/trainer-hostfile``, which only node
    0 wrote: on another host DeepSpeed's runner fell back to localhost and raised "Hostname
    'node-0' not found in hostfile"."""
    trainer = TrainerServiceSection(
        backend="deepspeed", num_ranks=2, num_nodes=2, master_addr="n0", device="cuda"
    )
    args = ServiceArgs(model_path="m", storage_root="s3://b/r", run="r", trainer=trainer)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    argv, env = node_command(args.model_dump_json(), 1, [0, 1])
    assert env == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert deepspeed_devices(argv) == {"node-0": [0, 1], "node-1": [6, 7]}
    assert ServiceArgs.model_validate_json(argv[-1]) == args
    assert "--node_rank=1" in argv and "--master_addr=n0" in argv
    assert list(tmp_path.iterdir()) == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # a host that sets none: its first GPUs
    assert node_command(args.model_dump_json(), 1, [0, 1])[1] == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_deepspeed_cannot_name_gpus_by_uuid():
    with pytest.raises(ConfigError, match="names its GPUs by index"):
        launcher_argv("deepspeed", 1, "a.json", 1, gpus="GPU-8f2e2c1a-0000-1111-2222-333344445555")
    with pytest.raises(ConfigError, match="one rank per GPU"):
        launcher_argv("deepspeed", 2, "a.json", 1, gpus="4")


def test_deepspeed_under_a_work_pools_gpus_gets_the_physical_ones(tmp_path):
    """The plan's trainer GPU (local 1 of a pool's 4,5,6,7) reaches DeepSpeed as physical 5."""
    from rollflow.infra.config import load_config
    from rollflow.infra.placement import Machine, make_plan

    cfg = load_config(
        Path(__file__).resolve().parents[3] / "configs/quickstart.toml",
        ["trainer.backend='deepspeed'", "trainer.device='cuda'", "inference.device='cuda'"],
    )
    plan = make_plan(cfg, Machine(gpus=4, visible="4,5,6,7"))
    args = ServiceArgs(
        model_path="m", storage_root=str(tmp_path), run="r", train=cfg.train, trainer=cfg.trainer
    )
    proc = TrainerProcess(args, token="t", log_dir=tmp_path, device_env=plan.trainer_nodes[0].env)
    assert deepspeed_devices(proc.process.argv) == {"node-0": [5]}


def test_another_nodes_command_carries_its_arguments_not_a_path_on_node_0(tmp_path):
    from rollflow.trainer.protocol import ServiceArgs
    from rollflow.trainer.rank_main import _model_on_this_node

    trainer = TrainerServiceSection(num_ranks=1, num_nodes=2, master_addr="n0")
    args = ServiceArgs(
        model_path=str(tmp_path / "gone"),
        storage_root=str(tmp_path / "runs"),
        run="r",
        trainer=trainer,
        model_in_storage=("policy", 0),
    )
    node1 = node_argv(
        trainer, 1, tmp_path / "trainer-args.json", 29500, service_args=args.model_dump_json()
    )
    assert ServiceArgs.model_validate_json(node1[-1]) == args
    assert str(tmp_path / "trainer-args.json") not in node1
    # There, the policy folder is not: the ranks load the copy the run put in its storage.
    policy = tmp_path / "runs" / "r" / "policy" / "step=0"
    policy.mkdir(parents=True)
    (policy / "_SUCCESS").write_text("commit")
    assert _model_on_this_node(args).model_path == str(policy)
    here = args.model_copy(update={"model_path": str(tmp_path)})  # node 0: its own folder
    assert _model_on_this_node(here) is here
