"""The run's trainer, from start to stop: node 0 here (``TrainerProcess``) or as a flow run of
``trainer.node_deployment`` (``PlacedTrainer``), and its other nodes (flow runs the run submits,
or commands a person runs on their hosts, printed).

Owns: the trainer's process handle and its client, its nodes' flow runs, where the weight group
meets it (``master``: the plan's host, or the address a placed node 0 says), and the arguments
every rank starts with (``trainer_args``).

Invariant: after ``stop()`` no trainer process of this run is left on this host and every node's
flow run has ended or been cancelled.
"""

from __future__ import annotations

import shlex
import time

from rollflow.infra.config import RunConfig
from rollflow.infra.errors import ServiceError, TrainerLost
from rollflow.services.placed import policy_in_storage
from rollflow.services.placed_trainer import PlacedTrainer, TrainerNodes
from rollflow.services.run_parts import RunParts
from rollflow.services.trainer_process import TrainerProcess, node_argv
from rollflow.services.vllm_supervisor import HEALTH_PROBE_TIMEOUT_S
from rollflow.tasks.train.client import TrainerClient
from rollflow.trainer.protocol import ServiceArgs


class TrainerLife:
    """The trainer service of one run: start, health, restart from a checkpoint, stop."""

    def __init__(self, parts: RunParts):
        cfg, plan, progress = parts.cfg, parts.plan, parts.progress
        self.cfg, self.plan, self.storage, self.token = cfg, plan, parts.storage, parts.token
        self.log_dir, self.progress = parts.log_dir, progress
        self.proc: TrainerProcess | PlacedTrainer | None = None
        self.client: TrainerClient | None = None
        self.master: str = plan.group_host  # where the weight group meets rank 0
        self.nodes: TrainerNodes | None = None  # the nodes as flow runs, where so placed
        if cfg.trainer.node_deployment:
            secret = cfg.run.storage_secret
            self.nodes = TrainerNodes(
                cfg.trainer.node_deployment,
                cfg.trainer.node_queues,
                progress,
                gpus=len(plan.trainer_nodes[-1].gpus),
                storage_secret=(cfg.run.storage, secret) if secret else None,
            )

    def start(
        self, policy_dir: str, checkpoint_step: int | None, weight_dtype: str, first: bool = True
    ) -> None:
        """Start node 0 from ``policy_dir`` (``checkpoint_step``'s, on resume), here or as a
        flow run (waited for until it says where it serves and meets the other nodes), then the
        other nodes (the commands a person runs on their hosts are printed at the first start
        only). Returns once every node is started, not yet healthy (``wait_healthy``)."""
        cfg = self.cfg
        args = trainer_args(cfg, policy_dir, checkpoint_step, weight_dtype)
        if cfg.trainer.num_nodes > 1 or self.nodes is not None:
            # Nodes on other hosts load it from the run's storage.
            stored = policy_in_storage(self.storage, policy_dir, checkpoint_step, self.progress)
            args = args.model_copy(update={"model_in_storage": stored})
        if self.nodes is not None:
            self._start_placed_node_0(args)
        else:
            node = self.plan.trainer_nodes[0]
            self.proc = TrainerProcess(
                args,
                token=self.token,
                log_dir=self.log_dir,
                beside_inference=True,
                device_env=node.env,
                cpus=node.cpus,
            )
            self.client = self.proc.client
            self.proc.start()
        if first or self.nodes is not None:
            self._start_other_nodes()

    def _start_placed_node_0(self, args: ServiceArgs) -> None:
        from rollflow.infra.network import own_address

        cfg, node = self.cfg, self.plan.trainer_nodes[0]
        self.proc = PlacedTrainer(
            self.nodes,
            cfg.run.name,
            args,
            self.token,
            self.storage,
            {
                "storage": (cfg.run.storage, cfg.run.storage_options),
                "reach": own_address(),  # node 0 serves toward this host
                "gpus": list(node.gpus),  # its host's first ones, which its flow run names
                "cpus": list(node.cpus),
            },
            progress=self.progress,
        ).start()
        self.master = self.proc.wait_placed()
        self.client = self.proc.client

    def _start_other_nodes(self) -> None:
        """Nodes 1..: flow runs of ``trainer.node_deployment`` meeting node 0 where it said
        (``master``), each making its command on its host, or the commands a person runs on
        their hosts, printed."""
        cfg, others = self.cfg, self.plan.trainer_nodes[1:]
        if not others:
            return
        tr = cfg.trainer.model_copy(update={"master_addr": self.master})  # found, if auto
        # The arguments themselves: the node may be another host, without our files.
        args = self.proc.args.model_copy(update={"trainer": tr}).model_dump_json()
        wait = f"trainer: waiting up to {cfg.trainer.startup_timeout_s:.0f}s for node"
        if self.nodes is not None:
            self.nodes.submit(cfg.run.name, args, {node.node: list(node.gpus) for node in others})
            self.progress(f"{wait}s {', '.join(str(node.node) for node in others)} to join")
            return
        for node in others:
            # DeepSpeed names that node's GPUs in the command (its --world_info entry)
            cmd = node_argv(
                tr, node.node, self.proc.args_file, cfg.trainer.master_port, node.env, args
            )
            prefix = "".join(f"{k}={v} " for k, v in sorted(node.env.items()))
            self.progress(
                f"{wait} {node.node} of {cfg.trainer.num_nodes}; on it, run: "
                f"{prefix}{shlex.join(cmd)}"
            )

    def wait_healthy(self) -> None:
        self.proc.wait_healthy()

    def check(self) -> None:
        """Raise ``ServiceError`` naming the trainer (and its dead rank) if it died or does not
        answer, or naming its node whose flow run ended (where the run submitted them)."""
        self.proc.check_alive(timeout_s=HEALTH_PROBE_TIMEOUT_S)
        if self.nodes is not None:
            self.nodes.check_running()

    def error(self) -> TrainerLost | None:
        """``TrainerLost`` naming what is wrong if the trainer is dead or does not answer, None
        if it lives (one probe)."""
        try:
            if self.proc is not None:
                self.check()
        except ServiceError as exc:
            return TrainerLost(str(exc))
        return None

    def exited(self) -> bool:
        """Whether node 0's process (or flow run) is over: a trainer that does not answer but
        has not exited may be exiting now."""
        return self.proc is not None and not self.proc.is_alive()

    def restart(self, policy_dir: str, checkpoint_step: int | None, weight_dtype: str) -> None:
        """Stop what is left of the trainer, every node with it where they are flow runs
        (cancelled, then submitted anew), and start it again from ``policy_dir``; returns once
        it is healthy. The lost trainer's log is kept beside the new one (``trainer.lost-N.log``;
        a placed node 0's stays in its flow run's log)."""
        self.proc.stop(timeout_s=10.0)
        if self.nodes is not None:
            # Past Prefect's worker's 30 s between a cancelled flow run's SIGTERM and its
            # SIGKILL, with its polling for cancellations and the processes' exit on top.
            self.nodes.stop(timeout_s=NODES_STOP_S)
        self.proc.set_aside_log()
        self.start(policy_dir, checkpoint_step, weight_dtype, first=False)
        self.wait_healthy()

    def stop(self, deadline: float) -> None:
        """Stop node 0 and end the other nodes' flow runs (their ranks end with node 0's; one
        that did not is cancelled), within the monotonic ``deadline``."""
        if self.proc is not None:
            self.proc.stop(timeout_s=max(1.0, deadline - time.monotonic()))
        if self.nodes is not None:
            self.nodes.end(grace_s=max(5.0, deadline - time.monotonic()))


NODES_STOP_S = 75.0  # the wait for the nodes' cancelled flow runs to end on a restart


def trainer_args(
    cfg: RunConfig, policy_dir: str, checkpoint_step: int | None, weight_dtype: str = "float32"
) -> ServiceArgs:
    """The trainer service's start arguments: the run's train, trainer and sampling sections,
    and the dtype vLLM serves (weight syncs travel in it)."""
    return ServiceArgs(
        weight_dtype=weight_dtype,
        model_path=str(policy_dir),
        checkpoint_step=checkpoint_step,
        storage_root=cfg.run.storage,
        storage_options=cfg.run.storage_options,
        run=cfg.run.name,
        seed=cfg.run.seed,
        num_steps=cfg.run.num_steps,
        model_revision=cfg.model.revision,
        trust_remote_code=cfg.model.trust_remote_code,
        train=cfg.train,
        trainer=cfg.trainer,
        sampling=cfg.sampling,
    )
