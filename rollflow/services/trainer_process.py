"""The trainer service as a process tree: the real launcher, its ranks, the HTTP endpoint of rank 0.

``TrainerProcess`` starts ``torchrun`` (FSDP2) or the ``deepspeed`` launcher with N ranks of
the service (``trainer/rank_main.py``), or one FSDP2 rank on its own, under one
``ManagedProcess`` (own process group, dies with the run), waits until rank 0 answers
``/health``, and stops the ranks with a ``/shutdown`` command (every rank tears down its engine
and process group) before signalling whatever is left.

Invariants: ``check_alive`` raises within seconds of a rank's death with a message naming the
rank (rank 0 answers 503 naming it; once the launcher has exited, the log's last lines do; a
rank started on its own is named by its exit);
after ``stop`` no process of the tree is left.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import platform
import re
import signal
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollflow.infra.errors import ConfigError, ServiceError
from rollflow.infra.http import Endpoint
from rollflow.infra.placement import devices_on_this_host
from rollflow.infra.processes import ManagedProcess, cpu_split, free_port, log_tail, wait_port_free
from rollflow.tasks.train.client import TrainerClient
from rollflow.trainer.protocol import (
    RANK_MAIN_MODULE,
    THREADS_ENV,
    TOKEN_ENV,
    RankInfo,
    ServiceArgs,
)


def torch_extensions_dir() -> Path:
    """The folder of DeepSpeed's JIT-compiled ops (on CPU: its shared-memory all-reduce, ~55 s
    of both cores to build), one per machine and versions: Python's ABI, torch, DeepSpeed, and
    this CPU's flags (DeepSpeed's CPU ops build with ``-march=native``). Not per environment: a rank
    loads a library built there by any checkout (``trainer/deepspeed_op.py``), so a new clone
    (each CI run's) no longer builds it again."""
    from importlib.metadata import PackageNotFoundError, version

    # (the ABI, not the version: CI's clone ran Python 3.11.2 and a developer's tree 3.11.7)
    parts = [sysconfig.get_config_var("SOABI") or sys.version, platform.machine(), _cpu_flags()]
    for package in ("torch", "deepspeed"):
        try:
            parts.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            parts.append(f"{package} absent")
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
    return Path("~/.cache/rollflow/torch_extensions").expanduser() / key


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


# How long node 0 waits for its rendezvous port to be let go before it starts its launcher: the
# previous trainer's node 0 on this host (a restart) may still be exiting.
RENDEZVOUS_FREE_TIMEOUT_S = 60.0


def launches_directly(backend: str, num_ranks: int, num_nodes: int) -> bool:
    """Whether the trainer's one rank is started without a launcher (``launcher_argv``)."""
    return backend == "fsdp2" and num_ranks == 1 and num_nodes == 1


def launcher_argv(
    backend: str,
    num_ranks: int,
    args_file: str | Path,
    master_port: int,
    *,
    num_nodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    gpus: str | None = None,
) -> list[str]:
    """The launcher command line of one trainer node: torchrun for FSDP2, the deepspeed launcher
    for DeepSpeed, ``num_ranks`` ranks on this node of ``num_nodes``.

    ``gpus`` is the node's ``CUDA_VISIBLE_DEVICES`` (None on CPU). torchrun keeps the variable;
    DeepSpeed's launcher does not (it sets the ranks' to the ids it is given), so its devices are
    named: this node's entry of ``--world_info``.

    Both are run as modules of this interpreter (``torchrun`` is ``torch.distributed.run``,
    DeepSpeed's is ``deepspeed.launcher.launch``), so the ranks get the same environment.
    Several nodes rendezvous at ``master_addr:master_port`` on node 0 with fixed node ranks
    (torchrun's static c10d store; DeepSpeed's per-node launcher with its node rank): global rank
    0, the one that serves the trainer's HTTP API and roots the weight group, is always on node
    0. torchrun's dynamic c10d rendezvous orders nodes by host name and pid, so it could not
    promise that (see docs/architecture.md).

    DeepSpeed starts ``deepspeed.launcher.launch``, the per-node launcher that its runner (the
    ``deepspeed`` command) starts once it has read the hostfile and ``--include``, with what the
    runner would have handed it (``deepspeed_world_info``): the command then holds all the node
    needs, on any host, where a hostfile written on node 0 is not on node 1's. On one node too:
    there the runner only starts that launcher and waits, and its own start cost ~2.6 s of CPU
    (it imports DeepSpeed and torch).

    One FSDP2 rank on one node needs no launcher (``launches_directly``): the command is the
    rank itself, which then makes a world of one (``rank_main``). torchrun would supervise that
    one process and cost ~1.5 s of CPU to start (it imports ``torch.distributed.run``) before
    the rank begins to load.
    """
    if launches_directly(backend, num_ranks, num_nodes):
        return [sys.executable, "-m", RANK_MAIN_MODULE, str(args_file)]
    if backend == "fsdp2":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={num_ranks}",
            f"--nnodes={num_nodes}",
            f"--node-rank={node_rank}",
            f"--master-addr={master_addr}",
            f"--master-port={master_port}",
            "--max-restarts=0",
            "-m",
            RANK_MAIN_MODULE,
            str(args_file),
        ]
    if backend == "deepspeed":
        world = deepspeed_world_info(gpus, num_ranks, num_nodes, node_rank)
        return [
            sys.executable,
            "-u",
            "-m",
            "deepspeed.launcher.launch",
            f"--world_info={world}",
            f"--node_rank={node_rank}",
            f"--master_addr={master_addr}",
            f"--master_port={master_port}",
            "--module",
            RANK_MAIN_MODULE,
            str(args_file),
        ]
    raise ConfigError(f"trainer.backend = {backend!r} is unknown: set 'fsdp2' or 'deepspeed'")


def deepspeed_gpu_ids(gpus: str) -> list[int]:
    """A node's ``CUDA_VISIBLE_DEVICES`` as the GPU indices DeepSpeed's ``--include`` takes."""
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not ids or not all(g.isdigit() for g in ids):
        raise ConfigError(
            f"trainer.backend = 'deepspeed' names its GPUs by index (--include host:0,1), but "
            f"this node's CUDA_VISIBLE_DEVICES is {gpus!r}: give the work pool GPU indices "
            "rather than UUIDs or MIG ids, or use trainer.backend = 'fsdp2'"
        )
    return [int(g) for g in ids]


def _node_gpu_ids(gpus: str, num_ranks: int) -> list[int]:
    ids = deepspeed_gpu_ids(gpus)
    if len(ids) != num_ranks:
        raise ConfigError(
            f"trainer.num_ranks = {num_ranks} but the plan gives this node {len(ids)} GPU(s) "
            f"({gpus}): one rank per GPU"
        )
    return ids


def deepspeed_world_info(gpus: str | None, num_ranks: int, num_nodes: int, node_rank: int) -> str:
    """The world DeepSpeed's per-node launcher takes (``--world_info``: each node's device ids by
    name, JSON in URL-safe base64, as its runner encodes what it reads from a hostfile and
    ``--include``): this node's ids are its GPUs (``gpus``, its ``CUDA_VISIBLE_DEVICES``;
    0..N-1 on CPU), the others' only give their rank counts (a node's launcher uses its own
    entry, and the others' sizes to number its ranks)."""
    own = list(range(num_ranks)) if gpus is None else _node_gpu_ids(gpus, num_ranks)
    world = {
        f"node-{i}": own if i == node_rank else list(range(num_ranks)) for i in range(num_nodes)
    }
    return base64.urlsafe_b64encode(json.dumps(world).encode("utf-8")).decode("utf-8")


def launcher_env(
    num_ranks: int, token: str, device: str, num_cpus: int | None = None
) -> dict[str, str]:
    """Per-rank threads (the deepspeed launcher leaves OMP_NUM_THREADS unset; the ranks share
    ``num_cpus`` cores, default all), the run's token, a persistent cache for DeepSpeed's compiled
    ops, and CPU mode where no GPU is to be used."""
    threads = os.environ.get(THREADS_ENV) or str(
        max(1, (num_cpus or os.cpu_count() or 1) // num_ranks)
    )
    env = {
        TOKEN_ENV: token,
        THREADS_ENV: threads,
        "OMP_NUM_THREADS": threads,
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(torch_extensions_dir())),
        "LOCAL_SIZE": str(num_ranks),
        "PYTHONUNBUFFERED": "1",
    }
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def node_argv(
    trainer: Any,
    node_rank: int,
    args_file: str | Path,
    master_port: int,
    device_env: dict[str, str] | None = None,
    service_args: str | None = None,
) -> list[str]:
    """The launcher command of trainer node ``node_rank`` for a run's ``[trainer]`` section;
    ``device_env`` is the node's device environment (its ``CUDA_VISIBLE_DEVICES``).
    The ranks read their ``ServiceArgs`` from ``args_file``, or take ``service_args`` (the JSON
    itself) where given: another host has none of node 0's files."""
    return launcher_argv(
        trainer.backend,
        trainer.num_ranks,
        service_args if service_args is not None else args_file,
        master_port,
        num_nodes=trainer.num_nodes,
        node_rank=node_rank,
        master_addr=trainer.master_addr if trainer.num_nodes > 1 else "127.0.0.1",
        gpus=(device_env or {}).get("CUDA_VISIBLE_DEVICES"),
    )


def node_command(
    service_args: str, node_rank: int, gpus: Sequence[int] = ()
) -> tuple[list[str], dict[str, str]]:
    """Trainer node ``node_rank``'s launcher command and device environment, made on the host
    that runs it (a placed node's flow run, ``flows/trainer_node.py``) from the trainer's
    arguments alone (``ServiceArgs`` as JSON, carried in the command: this host has none of node
    0's files), its GPUs (``gpus``: positions in this host's list) resolved against this host's
    own ``CUDA_VISIBLE_DEVICES`` (``placement.devices_on_this_host``)."""
    trainer = ServiceArgs.model_validate_json(service_args).trainer
    env = devices_on_this_host(gpus)
    argv = node_argv(
        trainer, node_rank, "trainer-args.json", trainer.master_port, env, service_args
    )
    return argv, env


class TrainerProcess:
    """One trainer node's launcher and ranks; node 0's is reachable through ``client``.

    ``device_env`` is this node's device environment (``CUDA_VISIBLE_DEVICES``: the plan's, or
    resolved on a placed node's host);
    ``node_rank`` > 0 starts another node of a multi-node trainer (its ranks serve no API);
    ``cpus``: the cores the plan pins the launcher and its ranks to (``trainer.cpus``);
    ``progress``: where what it waits for is said.
    """

    def __init__(
        self,
        args: ServiceArgs,
        *,
        token: str,
        log_dir: str | Path,
        beside_inference: bool = False,
        device_env: dict[str, str] | None = None,
        node_rank: int = 0,
        cpus: tuple[int, ...] = (),
        progress=print,
    ):
        self.log_dir = Path(log_dir)
        self.node_rank, self.progress = node_rank, progress
        tr = args.trainer
        self.startup_timeout_s = tr.startup_timeout_s
        suffix = f"-node-{node_rank}" if node_rank else ""
        log_path = self.log_dir / f"trainer{suffix}.log"
        self.args = args.model_copy(
            update={"port": args.port or free_port(args.host), "log_path": str(log_path)}
        )
        self.endpoint = Endpoint("trainer", f"http://{self.args.host}:{self.args.port}", token)
        self.client = TrainerClient(self.endpoint, tr.request_timeout_s)
        args_file = self.log_dir / f"trainer-args{suffix}.json"
        device = tr.device
        if device == "auto":
            device = "cuda" if _has_cuda() else "cpu"
        self.master_port = master_port = tr.master_port if tr.num_nodes > 1 else free_port()
        if cpus:  # pinned by the plan (trainer.cpus): the ranks' threads share those cores
            num_cpus = len(cpus)
        elif beside_inference and device == "cpu":  # the trainer's share of the cores
            num_cpus = len(cpu_split()[1])
        else:
            num_cpus = None
        env = launcher_env(tr.num_ranks, token, device, num_cpus)
        env.update(device_env or {})
        self.direct = launches_directly(tr.backend, tr.num_ranks, tr.num_nodes)
        self.process = ManagedProcess(
            "trainer" + suffix,
            node_argv(tr, node_rank, args_file, master_port, device_env),
            log_path,
            env=env,
            cpus=cpus,
        )
        self.args_file = args_file
        self.ranks: list[RankInfo] = []

    def start(self) -> TrainerProcess:
        """Launch the ranks; returns at once (they load while other services start)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.args_file.write_text(self.args.model_dump_json())
        if self.args.trainer.num_nodes > 1 and self.node_rank == 0:
            self._wait_rendezvous_port()
        self.process.start()
        return self

    def _wait_rendezvous_port(self) -> None:
        """Node 0's launcher hosts the nodes' rendezvous on ``trainer.master_port`` (every
        address of its host). A restarted trainer's node 0 may be placed on the host where the
        lost one's launcher is still exiting, holding the port: started then, the launcher fails
        at once ("address already in use", seen in a two-host run). Wait for the port, saying
        so; raise ``ServiceError`` naming the holder after ``RENDEZVOUS_FREE_TIMEOUT_S``."""
        who = "trainer node 0's rendezvous (trainer.master_port)"
        wait_port_free(
            "0.0.0.0",
            self.master_port,
            RENDEZVOUS_FREE_TIMEOUT_S,
            who,
            on_held=lambda: self.progress(
                f"{who}: port {self.master_port} is still held on this host (a previous trainer "
                f"still exiting?); waiting up to {RENDEZVOUS_FREE_TIMEOUT_S:.0f}s for it"
            ),
        )

    def wait_healthy(self) -> float:
        """Block until rank 0 answers; raises with the log's tail if the launcher exits first."""

        def probe() -> bool:
            health = self.client.health(timeout_s=2)
            self.ranks = health.ranks
            return health.ok

        return self.process.wait_healthy(probe, self.startup_timeout_s)

    def check_alive(self, timeout_s: float = 10.0) -> None:
        """Raise ``ServiceError`` naming the dead rank, if one died (``timeout_s``: the probe's)."""
        if not self.process.is_alive():
            code = self.process.returncode
            cause = _failure_in_log(self.process.log_path)
            if cause is None and self.direct and code:  # no launcher to report it: its exit does
                cause = f"trainer rank 0 died ({_exit_reason(code)})"
            raise ServiceError(
                f"the trainer has exited (code {code})"
                f"{': ' + cause if cause else ''}; last lines of {self.process.log_path}:\n"
                f"{log_tail(self.process.log_path, 15)}"
            )
        probe_health(self.client, timeout_s)

    def is_alive(self) -> bool:
        """Whether its launcher still runs."""
        return self.process.is_alive()

    def set_aside_log(self) -> None:
        """A lost trainer's log: kept beside the next one's, as ``trainer.lost-N.log``."""
        log = self.process.log_path
        lost = len(list(log.parent.glob(f"{log.stem}.lost-*{log.suffix}")))
        if log.exists():
            log.rename(log.with_name(f"{log.stem}.lost-{lost + 1}{log.suffix}"))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to shut down cleanly, then signal whatever is left."""
        if self.process.is_alive():
            try:
                self.client.shutdown(timeout_s=min(10.0, timeout_s))
                self.process.proc.wait(timeout=min(15.0, timeout_s))
            except Exception:  # a dead or hung rank: the signals below end it
                pass
        self.process.stop(timeout_s=timeout_s)


def probe_health(client: TrainerClient, timeout_s: float) -> None:
    """Raise ``ServiceError`` if the trainer at ``client`` does not answer, or answers unhealthy
    (rank 0 names a dead rank), within ``timeout_s``."""
    try:
        client.health(timeout_s=timeout_s)
    except ServiceError as exc:
        if exc.status is None:
            raise ServiceError(f"the trainer does not answer at {client.url}: {exc}") from None
        raise ServiceError(f"the trainer is unhealthy: {exc}", exc.status) from None


def _failure_in_log(path: Path) -> str | None:
    """The last failure recorded in the log, naming the rank: rank 0's own report ("trainer rank 1
    (pid 42) died", "trainer rank 0: ..."), else torchrun's root cause when rank 0 itself died."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    found = re.findall(r"(trainer rank \d+ \(pid \d+\) died|trainer rank 0: [^\n;]*)", text)
    if found:
        return found[-1]
    # torchrun: "rank      : 0 (local_rank: 0)" then "exitcode  : -9 (pid: 29834)  (SIGKILL)"
    root = re.findall(
        r"rank\s+:\s+(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s+:\s+(-?\d+) \(pid: (\d+)\)", text
    )
    if root:
        rank, code, pid = root[-1]
        return f"trainer rank {rank} (pid {pid}) died (exit code {code})"
    return None


def _exit_reason(code: int) -> str:
    """A guarded service's exit code said as a reason: 128 + N is signal N (the guard's bash
    exits so when the service was killed by it)."""
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(code - 128).name}"
    return f"exit code {code}"


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
