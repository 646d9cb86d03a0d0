"""The placement plan: which process runs where, on which devices, as which weight-group rank.

One function, ``make_plan(cfg, machine)``, turns the config and a machine (GPUs per node,
nodes) into every process of the run: the vLLM servers and the trainer's launcher on each
node, with its ``CUDA_VISIBLE_DEVICES``, its ranks in the weight group and its command line.
``rollflow plan`` prints it, ``--dry-run`` checks it and the run starts what it says, so what
is printed is what runs. An impossible plan raises ``PlanError`` before anything starts, naming
the key to change.

Layout (node 0 runs rollflow, the vLLM servers and the trainer's rank 0):

    weight group rank 0         trainer rank 0 (the broadcast root, hosts the group's store)
    ranks 1 .. TP               server 0's tensor-parallel workers
    ranks TP+1 .. 2 TP          server 1's, and so on

GPUs of node 0 go to the servers first (``inference.devices``, else the first
``num_servers × tensor_parallel_size``), then to the trainer (``trainer.devices``, else the
next ``trainer.num_ranks``). Other trainer nodes give their first ``num_ranks`` GPUs to the
trainer. Colocated mode (``inference.colocate``) puts vLLM on the trainer's GPUs with its memory
share capped, for one-GPU nodes; its weight group meets on gloo (NCCL refuses two members on one
GPU), and a ``--gpu-memory-utilization`` in ``inference.extra_args`` may not override the share.
Servers placed by Prefect (``inference.server_deployment``) run on hosts of their own: each
gets its host's first ``tensor_parallel_size`` GPUs (or its slice of ``inference.devices``),
node 0's all go to the trainer, and the group's store is ``trainer.master_addr``. Trainer
nodes placed by Prefect (``trainer.node_deployment``), node 0 included, are hosts of their own
too: each gives the trainer its first ``num_ranks`` GPUs (or ``trainer.devices``), and node 0's
address (``trainer.master_addr``; ``auto``: found by node 0's flow run) holds the group's store.
A placed process's GPUs are positions in its own host's list, resolved where it runs
(``devices_on_this_host``, called by its flow run): this process's ``CUDA_VISIBLE_DEVICES`` says
nothing of another host's, so the plan neither maps a placed process's GPUs through it nor puts
a ``CUDA_VISIBLE_DEVICES`` in its environment.

``choose_backend`` is the single decision of the weight group's transport: both the trainer's
sender and every vLLM worker take backend and device from the plan, never from a default.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollflow.infra.config import RunConfig
from rollflow.infra.errors import ConfigError

Device = Literal["cpu", "cuda"]
CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
COLOCATED_GPU_MEMORY_UTILIZATION = 0.45
# requirements/gpu.lock's torch is built for CUDA 13.0, the Dockerfile's base image is CUDA 13.0:
# the host's NVIDIA driver must be 580 or newer (an older one: torch sees no GPU at all).
CUDA_DRIVER = "CUDA 13.0 needs NVIDIA driver 580 or newer"


class PlanError(ConfigError):
    """The config cannot be placed on the machine; the message names what to change."""


@dataclass(frozen=True)
class Machine:
    """What the plan places processes on: GPUs per node (0: CPU only), trainer nodes, cores."""

    gpus: int = 0
    nodes: int = 1
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    # The cores this process may run on (its affinity): the ones inference.cpus and trainer.cpus
    # may name.
    cores: tuple[int, ...] = field(default_factory=lambda: _allowed_cores())
    # The CUDA_VISIBLE_DEVICES this process was given (a GPU work pool sets it for the flow run);
    # None: every GPU of the node. The plan's indices of the processes it starts here count
    # within it (``physical_gpus``); a placed process's count within its own host's.
    visible: str | None = None
    # NVIDIA GPUs the kernel driver lists (/proc/driver/nvidia/gpus), seen by torch or not: more
    # than ``gpus`` sees means a driver too old for the wheels' CUDA, not a CPU machine.
    driver_gpus: int = 0

    @classmethod
    def here(cls, nodes: int = 1) -> Machine:
        """This host (GPUs visible to CUDA), assumed ``nodes`` times."""
        return cls(
            gpus=_visible_gpus(),
            nodes=nodes,
            visible=os.environ.get(CUDA_VISIBLE),
            driver_gpus=_driver_gpus(),
        )

    def describe(self) -> str:
        gpus = f"{self.gpus} GPU(s)" if self.gpus else "no GPU"
        return f"{self.nodes} node(s) × {gpus}, {self.cpus} CPU core(s) on this one"


@dataclass(frozen=True)
class WeightWire:
    """The weight group's transport: process-group backend and where the buckets live."""

    backend: Literal["gloo", "nccl"]
    device: Device

    def describe(self) -> str:
        where = "GPU memory" if self.device == "cuda" else "host memory"
        return f"{self.backend} ({where})"


def choose_backend(
    trainer_device: Device,
    inference_device: Device,
    requested: str = "auto",
    shared_gpu: bool = False,
) -> WeightWire:
    """The one decision of the weight group's transport, for both sides.

    NCCL needs both sides on GPUs, each member on a GPU of its own: ``shared_gpu`` (colocated
    mode, the trainer's rank 0 on a vLLM worker's GPU) is a pair NCCL refuses ("Duplicate GPU
    detected"), so it meets on gloo. gloo works for every pair (a GPU side stages its weights
    through host memory: correct, slower). ``requested`` is ``trainer.weight_backend``.
    """
    for side, device in (("trainer", trainer_device), ("inference", inference_device)):
        if device not in ("cpu", "cuda"):
            raise PlanError(f"{side} device {device!r} is neither 'cpu' nor 'cuda'")
    both_gpu = trainer_device == inference_device == "cuda"
    if requested == "nccl" and not both_gpu:
        raise PlanError(
            f"trainer.weight_backend = 'nccl' needs the trainer and vLLM on GPUs (trainer: "
            f"{trainer_device}, vLLM: {inference_device}); set trainer.weight_backend = 'auto' "
            "(gloo through host memory) or put both on GPUs"
        )
    if requested not in ("auto", "gloo", "nccl"):
        raise PlanError(
            f"trainer.weight_backend = {requested!r}: expected 'auto', 'gloo' or 'nccl'"
        )
    if both_gpu and shared_gpu:
        if requested == "nccl":
            raise PlanError(
                "trainer.weight_backend = 'nccl' with inference.colocate = true: the trainer's "
                "rank 0 shares a GPU with a vLLM worker and NCCL refuses two members of one group "
                "on one GPU; set trainer.weight_backend = 'auto' (gloo through host memory) or "
                "give vLLM and the trainer separate GPUs"
            )
        return WeightWire("gloo", "cpu")
    if both_gpu and requested != "gloo":
        return WeightWire("nccl", "cuda")
    return WeightWire("gloo", "cpu")


@dataclass(frozen=True)
class PlannedProcess:
    """One process of the plan (a vLLM server, or one node's trainer launcher)."""

    name: str
    role: Literal["inference", "trainer"]
    node: int
    device: Device
    # Indices among the GPUs its host gives it (() on CPU): mapped through this process's
    # CUDA_VISIBLE_DEVICES into ``env`` here, or by the process itself on a host of its own
    # (``resolved_where_it_runs``).
    gpus: tuple[int, ...]
    weight_ranks: tuple[int, ...]  # its ranks in the weight group; () for trainer nodes > 0
    env: dict[str, str]
    # "prefect": a flow run of a deployment (trainer.node_deployment, inference.server_deployment)
    # that a worker of its pool runs, on another host
    started_by: Literal["rollflow", "you", "prefect"] = "rollflow"
    cpus: tuple[int, ...] = ()  # the cores it is pinned to (inference.cpus, trainer.cpus); ()
    # where nothing pins it
    queue: str | None = None  # started by Prefect: its work queue ("" the deployment's own)
    url: str | None = None  # a server started before the run (inference.urls): its address

    @property
    def first_weight_rank(self) -> int:
        return self.weight_ranks[0]

    @property
    def resolved_where_it_runs(self) -> bool:
        """A flow run on a host of its own: ``gpus`` are positions in that host's
        ``CUDA_VISIBLE_DEVICES``, which its flow run maps (``devices_on_this_host``); ``env``
        names no device."""
        return self.started_by == "prefect"


@dataclass(frozen=True)
class Plan:
    """Every process of a run, the weight group's size and transport."""

    machine: Machine
    processes: tuple[PlannedProcess, ...]
    weight_world_size: int
    wire: WeightWire
    group_host: str
    colocated: bool
    tensor_parallel_size: int
    gpu_memory_utilization: float | None
    serving_dtype: str  # what every server serves and the trainer sends (inference.dtype)

    @property
    def servers(self) -> list[PlannedProcess]:
        return [p for p in self.processes if p.role == "inference"]

    @property
    def trainer_nodes(self) -> list[PlannedProcess]:
        return [p for p in self.processes if p.role == "trainer"]

    def server_args(self, index: int) -> list[str]:
        """The `vllm serve` arguments the plan adds for server ``index`` (dtype, TP, memory
        share)."""
        args = ["--dtype", self.serving_dtype]
        if self.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.gpu_memory_utilization is not None and self.servers[index].device == "cuda":
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return args

    def render(self, commands: dict[str, list[str]] | None = None) -> str:
        """A table of the plan, then the command of every process you start yourself."""
        commands = commands or {}
        # Node 0 is the run's host unless trainer node 0 is placed (then on a host of its own).
        elsewhere = any(p.started_by == "prefect" for p in self.trainer_nodes if p.node == 0)
        rows = [("process", "node", "device", "CUDA_VISIBLE_DEVICES", "weight ranks", "started by")]
        for p in self.processes:
            ranks = _ranges(p.weight_ranks) if p.weight_ranks else "-"
            if p.url is not None:
                where = p.url
            elif p.queue is not None:
                where = f"queue {p.queue or '(pool)'}"
            else:
                where = "run's host" if elsewhere and p.started_by == "rollflow" else str(p.node)
            rows.append(
                (
                    p.name,
                    where,
                    p.device + (f" (cores {','.join(map(str, p.cpus))})" if p.cpus else ""),
                    _shown_devices(p),
                    ranks,
                    p.started_by,
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"machine: {self.machine.describe()}"]
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]
        mode = ", vLLM colocated with the trainer" if self.colocated else ""
        lines.append(
            f"weight group: {self.weight_world_size} ranks over {self.wire.describe()}, "
            f"store on {_found(self.group_host)}{mode}"
        )
        for p in self.processes:
            if p.started_by == "you" and p.name in commands:
                env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p.env.items()))
                cmd = shlex.join(commands[p.name])
                lines.append(f"\non node {p.node}, run:\n  {env + ' ' if env else ''}{cmd}")
        return "\n".join(lines)


def resolve_addresses(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``trainer.master_addr = "auto"`` made this host's own address
    (``network.own_address``): what the other hosts are given. Other configs as they are, and
    one whose node 0 is a flow run (``trainer.node_deployment``): its flow run finds the address
    of its own host."""
    if cfg.trainer.master_addr != "auto" or cfg.trainer.node_deployment:
        return cfg
    from rollflow.infra.network import own_address

    trainer = cfg.trainer.model_copy(update={"master_addr": own_address()})
    return cfg.model_copy(update={"trainer": trainer})


@dataclass(frozen=True)
class Sites:
    """Where the run's processes run: beside the run, on this machine (whose devices the plan
    knows and checks), or each on a host of its own as a Prefect flow run (whose devices it
    does not: each uses its host's own first GPUs)."""

    servers_placed: bool  # inference.server_deployment: each server a flow run
    node0_placed: bool  # trainer.node_deployment: every trainer node a flow run, node 0 too
    servers_started: bool = False  # inference.urls: servers started elsewhere, before the run

    @classmethod
    def of(cls, cfg: RunConfig) -> Sites:
        inf = cfg.inference
        return cls(bool(inf.server_deployment), bool(cfg.trainer.node_deployment), bool(inf.urls))

    @property
    def servers_away(self) -> bool:
        """The servers' devices are their hosts' own, which this machine cannot see."""
        return self.servers_placed or self.servers_started

    @property
    def all_here(self) -> bool:
        """vLLM and trainer node 0 share this machine (and may share its GPUs)."""
        return not (self.servers_away or self.node0_placed)

    def trainer_node_here(self, node: int) -> bool:
        return node == 0 and not self.node0_placed


def make_plan(cfg: RunConfig, machine: Machine) -> Plan:
    """Place the run's processes on ``machine``; raise ``PlanError`` naming the fix if impossible.

    The steps: where each process runs (``Sites``) → the device kind of vLLM and of the trainer
    → vLLM's GPUs → the trainer's GPUs (what vLLM left, or its own) → the weight group's wire →
    the planned processes (devices, cores, weight ranks) → vLLM's memory share."""
    inf, tr = cfg.inference, cfg.trainer
    if tr.num_nodes > machine.nodes:
        raise PlanError(
            f"trainer.num_nodes = {tr.num_nodes} but the machine has {machine.nodes} node(s): "
            f"lower trainer.num_nodes or plan with --nodes {tr.num_nodes}"
        )
    sites = Sites.of(cfg)
    inf_device = (
        _placed_device("inference", inf.device, machine, placed=sites.servers_placed)
        if sites.servers_away
        else _device("inference", inf.device, inf.devices, machine)
    )
    tr_device = (
        _placed_device("trainer", tr.device, machine, placed=True)
        if sites.node0_placed
        else _device("trainer", tr.device, tr.devices, machine)
    )
    choose_backend(tr_device, inf_device, tr.weight_backend)  # a bad pair fails before the GPUs
    _check_vllm_build(inf_device, machine, sites.servers_away)
    _check_tensor_parallel(cfg, inf.tensor_parallel_size)
    inference_gpus = _inference_gpus(cfg, machine, sites, inf_device)
    trainer_gpus = _trainer_gpus(cfg, machine, sites, tr_device, inference_gpus)
    # The weight group's members on node 0: trainer rank 0 (its first GPU) and every vLLM worker.
    shared = (
        sites.all_here
        and bool(trainer_gpus)
        and any(trainer_gpus[0] in server for server in inference_gpus)
    )
    wire = choose_backend(tr_device, inf_device, tr.weight_backend, shared_gpu=shared)
    servers = _planned_servers(cfg, machine, sites, inf_device, inference_gpus, tr_device)
    nodes = _planned_trainer_nodes(cfg, machine, sites, tr_device, trainer_gpus)
    memory = inf.gpu_memory_utilization
    if memory is None and inf.colocate:
        memory = COLOCATED_GPU_MEMORY_UTILIZATION
    _check_memory_flag(inf.extra_args, memory, inf.colocate)
    return Plan(
        machine=machine,
        processes=(*servers, *nodes),
        weight_world_size=1 + sum(len(s.weight_ranks) for s in servers),
        wire=wire,
        # other hosts join the weight group's store: node 0's address as they reach it
        group_host=tr.master_addr if tr.num_nodes > 1 or not sites.all_here else "127.0.0.1",
        colocated=inf.colocate,
        tensor_parallel_size=inf.tensor_parallel_size,
        gpu_memory_utilization=memory,
        serving_dtype=inf.serving_dtype(on_gpu=inf_device == "cuda"),
    )


def _inference_gpus(
    cfg: RunConfig, machine: Machine, sites: Sites, device: str
) -> list[tuple[int, ...]]:
    """Each server slot's GPUs (none on CPU): ``inference.devices`` in slot order, else the
    machine's first ones; a placed server's are its own host's first ones."""
    inf = cfg.inference
    tp, n_servers = inf.tensor_parallel_size, inf.fleet_slots()
    if device != "cuda" or sites.servers_started:  # (a started server's GPUs are its own)
        return [() for _ in range(n_servers)]
    wanted = n_servers * tp
    gpus = list(inf.devices) if inf.devices is not None else list(range(wanted))
    if len(gpus) != wanted:
        raise PlanError(
            f"inference.devices lists {len(gpus)} GPU(s) but {_servers_key(inf)} × "
            f"tensor_parallel_size = {n_servers} × {tp} = {wanted}: list {wanted}"
        )
    if not sites.servers_placed:
        _check_exist("inference.devices", gpus, machine)
    elif inf.devices is None:  # each its host's first ones
        gpus = list(range(tp)) * n_servers
    return [tuple(gpus[i * tp : (i + 1) * tp]) for i in range(n_servers)]


def _trainer_gpus(
    cfg: RunConfig,
    machine: Machine,
    sites: Sites,
    device: str,
    inference_gpus: list[tuple[int, ...]],
) -> tuple[int, ...]:
    """Node 0's GPUs (none on CPU): ``trainer.devices``, else the first ones vLLM left (all of
    them where vLLM shares them: ``inference.colocate``; a placed node 0's host's first ones)."""
    inf, tr = cfg.inference, cfg.trainer
    if device != "cuda":
        return ()
    used = {g for s in inference_gpus for g in s} if sites.all_here else set()
    if tr.devices is not None:
        gpus = tuple(tr.devices)
    elif inf.colocate or sites.node0_placed:
        gpus = tuple(range(tr.num_ranks))
    else:
        gpus = tuple([g for g in range(machine.gpus) if g not in used][: tr.num_ranks])
    if len(gpus) != tr.num_ranks:
        raise PlanError(
            f"the trainer needs trainer.num_ranks = {tr.num_ranks} GPU(s) on node 0 but "
            f"{len(gpus)} are left after vLLM's {sorted(used)} of {machine.gpus}: "
            f"lower trainer.num_ranks or {_servers_key(inf)} / tensor_parallel_size, list "
            "trainer.devices, or set inference.colocate = true to share GPUs"
        )
    if not sites.node0_placed:
        _check_exist("trainer.devices", gpus, machine)
    overlap = used & set(gpus)
    if overlap and not inf.colocate:
        raise PlanError(
            f"GPU(s) {sorted(overlap)} are given to both vLLM (inference.devices) and the "
            "trainer (trainer.devices): separate them, or set inference.colocate = true "
            "(vLLM's memory share is then capped)"
        )
    return gpus


def _planned_servers(
    cfg: RunConfig,
    machine: Machine,
    sites: Sites,
    device: str,
    inference_gpus: list[tuple[int, ...]],
    trainer_device: str,
) -> list[PlannedProcess]:
    """Each server slot: its devices, its cores (on a CPU machine, pinned apart), its weight
    ranks (after the trainer's rank 0, in slot order) and who starts it."""
    inf, tp = cfg.inference, cfg.inference.tensor_parallel_size
    placed = sites.servers_away
    cores = [] if placed else _pinned_cores(cfg, machine, device, trainer_device)
    servers = []
    for i, gpus in enumerate(inference_gpus):
        env = _device_env(
            device, gpus, tp, machine.cpus, machine.visible, placed, hide_gpus=_has_gpus(machine)
        )
        if cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = _threads_bind(cores[i], tp)
        servers.append(
            PlannedProcess(
                name=f"vllm-{i}",
                role="inference",
                node=0,
                device=device,
                gpus=gpus,
                weight_ranks=tuple(range(1 + i * tp, 1 + (i + 1) * tp)),
                env=env,
                cpus=cores[i] if cores else (),
                started_by="you" if inf.urls else "prefect" if placed else "rollflow",
                queue=(inf.server_queues[i] if inf.server_queues else "")
                if sites.servers_placed
                else None,
                url=inf.urls[i] if inf.urls else None,
            )
        )
    return servers


def _planned_trainer_nodes(
    cfg: RunConfig, machine: Machine, sites: Sites, device: str, node0_gpus: tuple[int, ...]
) -> list[PlannedProcess]:
    """Each trainer node: node 0 with ``node0_gpus`` beside the run (or a flow run), the others
    on hosts of their own (flow runs, or started by a person), each with its host's GPUs."""
    tr = cfg.trainer
    nodes = []
    for node in range(tr.num_nodes):
        here = sites.trainer_node_here(node)  # on this machine, beside the run
        gpus = node0_gpus if here or tr.devices is not None else tuple(range(tr.num_ranks))
        if device == "cuda" and node > 0 and not sites.node0_placed:  # (placed: another host)
            _check_exist("trainer.devices", gpus, machine)
        gpus = gpus if device == "cuda" else ()
        nodes.append(
            PlannedProcess(
                name=f"trainer-node-{node}",
                role="trainer",
                node=node,
                device=device,
                gpus=gpus,
                weight_ranks=(0,) if node == 0 else (),
                # this process's CUDA_VISIBLE_DEVICES says nothing of another node's GPUs; a
                # placed node resolves its own on its host
                env=_device_env(
                    device,
                    gpus,
                    visible=machine.visible if here else None,
                    placed=sites.node0_placed,
                    hide_gpus=here and _has_gpus(machine),
                ),
                started_by="prefect" if sites.node0_placed else "rollflow" if here else "you",
                queue=_queue(tr, node) if sites.node0_placed else None,
                # another node is another host, whose cores this plan does not know
                cpus=tuple(tr.cpus) if tr.cpus and device == "cpu" and here else (),
            )
        )
    return nodes


# ----------------------------------------------------------------------------- helpers


def _allowed_cores() -> tuple[int, ...]:
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def _pinned_cores(
    cfg: RunConfig, machine: Machine, inf_device: Device, tr_device: Device
) -> list[tuple[int, ...]]:
    """Each server's cores from ``inference.cpus`` (an even share, at least one per
    tensor-parallel worker), after checking both keys' cores; [] where vLLM is not pinned."""
    inf, tr = cfg.inference, cfg.trainer
    for key, cores, device in (
        ("inference.cpus", inf.cpus, inf_device),
        ("trainer.cpus", tr.cpus, tr_device),
    ):
        if cores is None:
            continue
        if device != "cpu":
            raise PlanError(
                f"{key} pins processes to CPU cores, but they run on GPUs here: leave {key} "
                "unset (GPUs are placed with inference.devices / trainer.devices)"
            )
        if not cores or len(set(cores)) != len(cores):
            raise PlanError(f"{key} = {cores}: list each core once, at least one")
        missing = sorted(set(cores) - set(machine.cores))
        if missing:
            raise PlanError(
                f"{key} names core(s) {missing}, but this process may run on "
                f"{list(machine.cores)} only: name cores among those"
            )
    if inf.cpus is None:
        return []
    slots = inf.fleet_slots()
    per_server = len(inf.cpus) // slots
    if per_server < inf.tensor_parallel_size:
        raise PlanError(
            f"inference.cpus lists {len(inf.cpus)} core(s) for {_servers_key(inf)} × "
            f"tensor_parallel_size = {slots} × {inf.tensor_parallel_size} workers: "
            "list at least one core per worker"
        )
    cores = list(inf.cpus)
    return [tuple(cores[i * per_server : (i + 1) * per_server]) for i in range(slots)]


def _servers_key(inf) -> str:
    """The key that sets how many servers the plan places, for its errors."""
    return "inference.max_servers" if inf.max_servers else "inference.num_servers"


def _threads_bind(cores: tuple[int, ...], tp: int) -> str:
    """vLLM's CPU thread binding for one server on ``cores``: its workers' shares, "|"-separated."""
    share = len(cores) // tp
    return "|".join(",".join(map(str, cores[r * share : (r + 1) * share])) for r in range(tp))


def _found(host: str) -> str:
    """The group's host as the plan shows it: ``auto`` is found by node 0's flow run."""
    return "node 0's host (auto: its flow run finds the address)" if host == "auto" else host


def _queue(tr, node: int) -> str:
    """The work queue of trainer node ``node`` ("": the deployment's)."""
    return tr.node_queues[node] if tr.node_queues else ""


def _has_gpus(machine: Machine) -> bool:
    """Whether this host has GPUs, visible to this process or only to the driver."""
    return machine.gpus > 0 or machine.driver_gpus > 0


def vllm_build() -> str | None:
    """Which vLLM build is installed here: "cpu" (the ``vllm-cpu`` package), "cuda" (``vllm``),
    None when neither is."""
    from importlib.metadata import PackageNotFoundError, distribution

    for package, build in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            distribution(package)
            return build
        except PackageNotFoundError:
            continue
    return None


def _check_vllm_build(device: Device, machine: Machine, placed: bool) -> None:
    """vLLM planned on CPU on a host with GPUs needs vLLM's CPU build: the CUDA build has no CPU
    path (it fails with no GPU visible, and took GPU 0 beside the trainer when one was)."""
    if device == "cpu" and not placed and _has_gpus(machine) and vllm_build() == "cuda":
        raise PlanError(
            "inference.device = 'cpu' on a host with GPUs, but the vLLM installed here is its "
            "CUDA build, which cannot serve on CPU: serve on the GPUs (inference.device = "
            "'auto'), or install vLLM's CPU build (vllm-cpu) in this environment"
        )


PLACING = {"inference": "inference.server_deployment", "trainer": "trainer.node_deployment"}
WHO = {"inference": "vLLM servers", "trainer": "trainer's nodes"}


def _placed_device(section: str, value: str, machine: Machine, placed: bool) -> Device:
    """The device of a process on a host of its own, whose GPUs only the config can say:
    ``auto`` is CUDA where this machine has GPUs (a cluster of one kind). Where it has none,
    ``auto`` cannot say: a GPU pool's hosts would be told CPU (and a pool asked for no GPU), so a
    ``placed`` process (a flow run Prefect places) needs the device named; a server started
    before the run keeps what it was started with, and only the trainer's side (CPU here) sets
    the wire."""
    if value != "auto":
        return value  # type: ignore[return-value]
    if machine.gpus:
        return "cuda"
    if placed:
        raise PlanError(
            f"{section}.device = 'auto' with {PLACING[section]}: the {WHO[section]} run on "
            "hosts of their own, whose GPUs this host (which has none) cannot see; set "
            f"{section}.device = 'cuda' where their hosts have GPUs, or 'cpu'"
        )
    return "cpu"


def _device(section: str, value: str, devices, machine: Machine) -> Device:
    """``auto`` is CPU only on a machine without GPUs where the config asks for none: a config
    that asks for GPUs (``device = 'cuda'``, or a ``devices`` list) never falls back to CPU."""
    if machine.gpus > 0:
        return "cuda" if value == "auto" else value  # type: ignore[return-value]
    if value == "cuda":
        raise PlanError(f"{section}.device = 'cuda' but {no_gpu_hint(section)}")
    if value == "auto" and devices is not None:
        raise PlanError(
            f"{section}.devices = {list(devices)} asks for GPUs but {no_gpu_hint(section)}"
        )
    if value == "auto" and machine.driver_gpus and machine.visible != "":
        raise PlanError(
            f"{section}.device = 'auto' on a host whose NVIDIA driver lists "
            f"{machine.driver_gpus} GPU(s), but {no_gpu_hint(section)}; to run on CPU anyway "
            f"set {section}.device = 'cpu' (or CUDA_VISIBLE_DEVICES='')"
        )
    return "cpu"


def no_gpu_hint(section: str) -> str:
    """Why a machine shows no GPU and what to check: the driver against torch's CUDA."""
    try:
        import torch

        build = (
            f"torch {torch.__version__}, built for CUDA {torch.version.cuda or '- (a CPU build)'}"
        )
    except ImportError:  # pragma: no cover - torch is a dependency
        build = "torch is not installed"
    return (
        f"the machine has no GPU that torch can see ({build}): check that nvidia-smi lists the "
        f"GPUs and that its driver supports the wheels' CUDA ({CUDA_DRIVER}; docs/install.md); "
        f"for CPU set {section}.device = 'auto' and drop {section}.devices, or plan for another "
        "machine with --gpus N"
    )


def _check_memory_flag(extra_args, memory: float | None, colocate: bool) -> None:
    """vLLM reads its arguments last-wins: a recipe's own ``--gpu-memory-utilization`` after the
    plan's would silently take the share the plan gave the trainer."""
    flag = "--gpu-memory-utilization"
    given = [a for a in extra_args if a == flag or a.startswith(flag + "=")]
    if given and memory is not None:
        source = (
            "inference.colocate = true (vLLM's share of a GPU it shares with the trainer)"
            if colocate
            else "inference.gpu_memory_utilization"
        )
        raise PlanError(
            f"inference.extra_args sets {flag} but the plan gives vLLM {memory} of each GPU from "
            f"{source}: remove {flag} from inference.extra_args and set "
            "inference.gpu_memory_utilization instead"
        )


def _check_exist(key: str, gpus, machine: Machine) -> None:
    bad = [g for g in gpus if not 0 <= g < machine.gpus]
    if bad:
        raise PlanError(
            f"{key}: GPU(s) {bad} do not exist on a node with {machine.gpus} GPU(s) "
            f"(indices 0..{machine.gpus - 1}); use fewer or plan with --gpus N"
        )
    if len(set(gpus)) != len(gpus):
        raise PlanError(f"{key} repeats a GPU: {list(gpus)}; give each once")


def _check_tensor_parallel(cfg: RunConfig, tp: int) -> None:
    if tp == 1:
        return
    heads = model_heads(cfg)
    if heads is None:
        return
    for name, count in heads.items():
        if count % tp:
            raise PlanError(
                f"inference.tensor_parallel_size = {tp} does not divide the model's {name} "
                f"({count}): choose a divisor of {count}"
            )


def model_heads(cfg: RunConfig) -> dict[str, int] | None:
    """The model's attention and key/value head counts, when readable without a download."""
    if cfg.model.tiny is not None:
        return {"num_attention_heads": cfg.model.tiny.num_heads}
    path = Path(cfg.model.path or "")
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    heads = {"num_attention_heads": data.get("num_attention_heads")}
    heads["num_key_value_heads"] = data.get("num_key_value_heads") or heads["num_attention_heads"]
    return {k: int(v) for k, v in heads.items() if v}


def physical_gpus(local: tuple[int, ...] | list[int], visible: str | None) -> tuple[str, ...]:
    """The plan's GPU indices (0..N-1 of the GPUs this process sees) as the entries a child's
    ``CUDA_VISIBLE_DEVICES`` must hold: a child reads that variable against the whole node, so
    under a parent given ``4,5,6,7`` the plan's 0 and 1 are ``4`` and ``5``. The parent's entries
    are taken as they are (indices, ``GPU-<uuid>``, ``MIG-<uuid>``); unset: the indices."""
    if visible is None:
        return tuple(str(g) for g in local)
    entries = [e.strip() for e in visible.split(",")]
    entries = entries[: entries.index("")] if "" in entries else entries  # CUDA stops at a gap
    bad = [g for g in local if not 0 <= g < len(entries)]
    if bad:
        raise PlanError(
            f"GPU(s) {bad} of the plan are not among the {len(entries)} this process was given "
            f"({CUDA_VISIBLE}={visible!r}): list fewer devices, or give the process more GPUs"
        )
    return tuple(entries[g] for g in local)


def devices_on_this_host(
    gpus: Sequence[int], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """A placed process's ``CUDA_VISIBLE_DEVICES``, resolved by the process on the host it runs
    on: the plan's ``gpus`` ("this many GPUs, the host's first ones": positions in the host's
    list) mapped through this host's own ``CUDA_VISIBLE_DEVICES`` (``environ``, default this
    process's): a worker given ``4,5,6,7`` puts positions 0 and 1 on 4 and 5; unset, they are
    the indices. {} for a process without GPUs. Raises ``PlanError`` naming this host's list
    where it holds fewer (``''``: none)."""
    if not gpus:
        return {}
    visible = (os.environ if environ is None else environ).get(CUDA_VISIBLE)
    return {CUDA_VISIBLE: ",".join(physical_gpus(tuple(gpus), visible))}


def _device_env(
    device: Device,
    gpus: tuple[int, ...],
    tp: int = 1,
    cpus: int = 1,
    visible: str | None = None,
    placed: bool = False,
    hide_gpus: bool = False,
) -> dict[str, str]:
    """A planned process's device environment: its GPUs mapped through ``visible`` (this
    process's list); none for a ``placed`` process, which maps its own on its host. A CPU
    process on a host with GPUs (``hide_gpus``) sees none: a CUDA build (vLLM's, torch's) would
    otherwise take GPU 0, beside the trainer's rank there."""
    if device == "cuda":
        return {} if placed else {CUDA_VISIBLE: ",".join(physical_gpus(gpus, visible))}
    env = {CUDA_VISIBLE: ""} if hide_gpus and not placed else {}
    if tp > 1:
        # vLLM's CPU workers bind their OpenMP threads per rank, "|"-separated: one core each,
        # round the machine's cores (docs/research/vllm-cpu-0.32.md: TP 2 on 2 cores = "0|1").
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r % cpus) for r in range(tp))
    return env


def _shown_devices(p: PlannedProcess) -> str:
    """The plan's CUDA_VISIBLE_DEVICES column: a placed process's GPUs are its host's."""
    if p.resolved_where_it_runs and p.gpus:
        return f"its host's {','.join(map(str, p.gpus))}"
    return p.env.get(CUDA_VISIBLE, "-")


def _ranges(ranks: tuple[int, ...]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def _driver_gpus(root: str = "/proc/driver/nvidia/gpus") -> int:
    try:
        return len(os.listdir(root))
    except OSError:
        return 0


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
