"""The trainer service as a process tree: the real launcher, its ranks, the HTTP endpoint of rank 0.

``TrainerProcess`` starts ``torchrun`` (FSDP2) or the ``deepspeed`` launcher with N ranks of
the service (``trainer/rank_main.py``) under one ``ManagedProcess`` (own process group, dies with the
run), waits until rank 0 answers ``/health``, and stops the ranks with a ``/shutdown`` command
(every rank tears down its engine and process group) before signalling whatever is left.

Invariants: ``check_alive`` raises within seconds of a rank's death with a message naming the
rank (rank 0 answers 503 naming it; once the launcher has exited, the log's last lines do);
after ``stop`` no process of the tree is left.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path
from typing import Any

from rollflow.infra.errors import ConfigError, ServiceError
from rollflow.infra.http import Endpoint
from rollflow.infra.processes import ManagedProcess, cpu_split, free_port, log_tail, wait_port_free
from rollflow.tasks.train.client import TrainerClient
from rollflow.trainer.protocol import (
    RANK_MAIN_MODULE,
    THREADS_ENV,
    TOKEN_ENV,
    RankInfo,
    ServiceArgs,
)

# DeepSpeed's JIT-compiled ops (on CPU: its shared-memory all-reduce, ~2-6 min to build). One
# folder per Python environment: torch rebuilds an op whose build flags changed, and the flags
# hold the environment's paths, so two checkouts sharing one folder rebuilt it on every switch.
TORCH_EXTENSIONS_DIR = (
    Path("~/.cache/rollflow/torch_extensions").expanduser()
    / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
)
# How long node 0 waits for its rendezvous port to be let go before it starts its launcher: the
# previous trainer's node 0 on this host (a restart) may still be exiting.
RENDEZVOUS_FREE_TIMEOUT_S = 60.0


def launcher_argv(
    backend: str,
    num_ranks: int,
    args_file: str | Path,
    master_port: int,
    *,
    num_nodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    hostfile: str | Path | None = None,
    gpus: str | None = None,
) -> list[str]:
    """The launcher command line of one trainer node: torchrun for FSDP2, the deepspeed launcher
    for DeepSpeed, ``num_ranks`` ranks on this node of ``num_nodes``.

    ``gpus`` is the node's ``CUDA_VISIBLE_DEVICES`` from the plan (None on CPU). torchrun keeps
    the variable; DeepSpeed's launcher does not (it deletes it and gives the ranks 0..N-1 of
    ``--num_gpus``, or its hostfile's slots), so its devices are named with ``--include``.

    Both are run as modules of this interpreter (``torchrun`` is ``torch.distributed.run``,
    ``deepspeed`` is ``deepspeed.launcher.runner``), so the ranks get the same environment.
    Several nodes rendezvous at ``master_addr:master_port`` on node 0 with fixed node ranks
    (torchrun's static c10d store; DeepSpeed's hostfile with ``--no_ssh``): global rank 0, the
    one that serves the trainer's HTTP API and roots the weight group, is always on node 0.
    torchrun's dynamic c10d rendezvous orders nodes by host name and pid, so it could not
    promise that (see docs/architecture.md).
    """
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
        argv = [sys.executable, "-m", "deepspeed.launcher.runner"]
        if num_nodes > 1:
            if hostfile is None:
                raise ValueError("a multi-node DeepSpeed launch needs a hostfile")
            argv += [f"--hostfile={hostfile}", "--no_ssh", f"--node_rank={node_rank}"]
        if gpus is not None:
            argv.append("--include=" + deepspeed_include(gpus, num_ranks, num_nodes, node_rank))
        elif num_nodes == 1:
            argv.append(f"--num_gpus={num_ranks}")
        return [
            *argv,
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


def deepspeed_include(gpus: str, num_ranks: int, num_nodes: int = 1, node_rank: int = 0) -> str:
    """DeepSpeed's own way to name devices: ``localhost:4,5,6,7`` on one node; with a hostfile,
    ``node-0:..@node-1:..`` where this node's slots are its GPUs (each node runs its own launcher,
    which only uses its own entry; the others' give their rank counts)."""
    ids = deepspeed_gpu_ids(gpus)
    if len(ids) != num_ranks:
        raise ConfigError(
            f"trainer.num_ranks = {num_ranks} but the plan gives this node {len(ids)} GPU(s) "
            f"({gpus}): one rank per GPU"
        )
    own = ",".join(map(str, ids))
    if num_nodes == 1:
        return f"localhost:{own}"
    others = ",".join(map(str, range(num_ranks)))
    return "@".join(f"node-{i}:{own if i == node_rank else others}" for i in range(num_nodes))


def hostfile_text(num_nodes: int, num_ranks: int, slots: int | None = None) -> str:
    """DeepSpeed's hostfile: one line per trainer node (names only label nodes with --no_ssh).
    ``slots`` (default ``num_ranks``) must cover the highest GPU index ``--include`` names."""
    slots = max(num_ranks, slots or 0)
    return "".join(f"node-{i} slots={slots}\n" for i in range(num_nodes))


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
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(TORCH_EXTENSIONS_DIR)),
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
    ``device_env`` is the plan's environment for that node (its ``CUDA_VISIBLE_DEVICES``).
    The ranks read their ``ServiceArgs`` from ``args_file``, or take ``service_args`` (the JSON
    itself) where given: another host has none of node 0's files."""
    hostfile = None
    if trainer.backend == "deepspeed" and trainer.num_nodes > 1:
        hostfile = Path(args_file).with_name("trainer-hostfile")
    return launcher_argv(
        trainer.backend,
        trainer.num_ranks,
        service_args if service_args is not None else args_file,
        master_port,
        num_nodes=trainer.num_nodes,
        node_rank=node_rank,
        master_addr=trainer.master_addr if trainer.num_nodes > 1 else "127.0.0.1",
        hostfile=hostfile,
        gpus=(device_env or {}).get("CUDA_VISIBLE_DEVICES"),
    )


class TrainerProcess:
    """One trainer node's launcher and ranks; node 0's is reachable through ``client``.

    ``device_env`` is the plan's environment for this node (``CUDA_VISIBLE_DEVICES``);
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
        self.process = ManagedProcess(
            "trainer" + suffix,
            node_argv(tr, node_rank, args_file, master_port, device_env),
            log_path,
            env=env,
            cpus=cpus,
        )
        self.args_file = args_file
        self.device_env = dict(device_env or {})
        self.ranks: list[RankInfo] = []

    def start(self) -> TrainerProcess:
        """Launch the ranks; returns at once (they load while other services start)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.args_file.write_text(self.args.model_dump_json())
        tr = self.args.trainer
        if tr.backend == "deepspeed" and tr.num_nodes > 1:
            gpus = self.device_env.get("CUDA_VISIBLE_DEVICES")
            slots = max(deepspeed_gpu_ids(gpus)) + 1 if gpus else None
            self.args_file.with_name("trainer-hostfile").write_text(
                hostfile_text(tr.num_nodes, tr.num_ranks, slots)
            )
        if tr.num_nodes > 1 and self.node_rank == 0:
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
            cause = _failure_in_log(self.process.log_path)
            raise ServiceError(
                f"the trainer has exited (code {self.process.proc.returncode})"
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


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
