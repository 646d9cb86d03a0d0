"""The run's long-lived services: the trainer, the inference fleet, the weight group between them.

``RunServices`` composes them. It places the processes with the placement plan, starts the
trainer (``trainer_life.py``) and every vLLM server of the fleet (``fleet_keeper.py``; each
made by ``server_maker.py`` and kept serving by its supervisor) at once, forms the weight group
(``weight_link.py``: trainer rank 0, then every worker of every server) and tears everything
down within a deadline. ``check_alive()``, called by the step loop every
``HEALTH_CHECK_INTERVAL_S`` from the main thread, fails the run when the trainer died, grows or
shrinks the fleet toward the size ``rollflow scale`` asked and has each server's supervisor
restart it if it died.

Invariant: when ``stop()`` returns (or the ``with`` block exits, on success or error), the
weight group is closed on both sides and no service process is left. Processes are spawned from
the calling thread because the kernel kills them when the thread that spawned them exits.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from rollflow.infra.config import RunConfig
from rollflow.infra.errors import ServiceError
from rollflow.infra.http import Endpoint
from rollflow.infra.placement import Machine, make_plan, resolve_addresses
from rollflow.infra.storage import RunStorage
from rollflow.infra.vllm_fleet.fleet import register_fleet, unregister_fleet
from rollflow.services.fleet_keeper import FleetKeeper
from rollflow.services.placed import publish_key, withdraw_key
from rollflow.services.run_parts import RunParts
from rollflow.services.server_maker import ServerMaker
from rollflow.services.started_server import started_servers_key
from rollflow.services.trainer_life import TrainerLife
from rollflow.services.vllm_supervisor import HEALTH_PROBE_TIMEOUT_S, InferenceSupervisor
from rollflow.services.weight_link import WeightGroupLink
from rollflow.tasks.sync.weights import GroupSpec
from rollflow.tasks.train.client import TrainerClient

TEARDOWN_DEADLINE_S = 30.0
HEALTH_CHECK_INTERVAL_S = 5.0
# The longest a dead server goes unnoticed: one interval, then the trainer's probe before vLLM's.
# The Sampler's unhealthy grace (tasks/generate/rollouts.py, RetryPolicy) must exceed it.
DETECTION_BOUND_S = HEALTH_CHECK_INTERVAL_S + HEALTH_PROBE_TIMEOUT_S


class RunServices:
    """Trainer service + the vLLM servers (each under its supervisor) + one weight group between
    them, placed by the placement plan (``infra/placement.py``)."""

    def __init__(
        self,
        cfg: RunConfig,
        policy_dir: str | Path,
        checkpoint_step: int | None,
        log_dir: str | Path,
        progress=print,
        machine: Machine | None = None,
        base_model: str | Path | None = None,
    ):
        # Trainer node 0 a flow run on a host of its own (trainer.node_deployment): "auto" is
        # its host's address, which its flow run finds and says (``PlacedTrainer.wait_placed``).
        if cfg.trainer.master_addr == "auto" and not cfg.trainer.node_deployment:
            cfg = resolve_addresses(cfg)
            progress(f"services: trainer.master_addr = auto: {cfg.trainer.master_addr}")
        self.cfg, self.policy_dir, self.checkpoint_step = cfg, str(policy_dir), checkpoint_step
        # The model before any training (policy_dir is a checkpoint's merged model on resume):
        # what vLLM serves under an adapter sync.
        self.base_model = str(base_model or policy_dir)
        self.log_dir, self.progress = Path(log_dir), progress
        # The run's key: every service of the run (and the weight group's members) knows it.
        # Servers started before the run were given theirs (inference.urls): it is the run's.
        self.token = started_servers_key() if cfg.inference.urls else secrets.token_urlsafe(24)
        # Impossible plans fail here, before any process starts.
        self.plan = make_plan(cfg, machine or Machine.here(nodes=cfg.trainer.num_nodes))
        # What every server serves, and so what the trainer sends (one device for all servers).
        self.weight_dtype = self.plan.serving_dtype
        self.storage = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options)
        self.weights = WeightGroupLink(
            GroupSpec.from_plan(self.plan, cfg.trainer.weight_bucket_mb),
            cfg.trainer.weight_sync_timeout_s,
            cfg.trainer.request_timeout_s,
        )
        parts = RunParts(cfg, self.plan, self.storage, self.token, self.log_dir, progress)
        self.life = TrainerLife(parts)
        self.maker = ServerMaker(parts, self.weights)
        self.servers = FleetKeeper(parts, self.weights, self.maker, lambda: self.trainer)
        self.fleet = self.servers.fleet
        # The run's key travels to processes on other hosts through its storage.
        self.placed = self.maker.placed or self.life.nodes is not None
        # Colocated on GPUs: vLLM sizes its KV cache from the memory its GPU has free while it
        # profiles, so the trainer, which shares that GPU, loads only once vLLM is ready (loaded
        # at once, its weights and optimizer state were counted as vLLM's and the cache starved).
        self.vllm_first = (
            self.plan.colocated
            and not self.placed
            and any(p.device == "cuda" for p in self.plan.servers)
        )

    @property
    def trainer(self) -> TrainerClient | None:
        return self.life.client

    @property
    def supervisors(self) -> list[InferenceSupervisor]:
        return self.servers.supervisors

    @property
    def inference_urls(self) -> list[str]:
        return [sup.url for sup in self.supervisors]

    @property
    def inference_endpoints(self) -> list[Endpoint]:
        return [Endpoint("inference", url, self.token) for url in self.inference_urls]

    def start(self) -> RunServices:
        cfg, start = self.cfg, time.perf_counter()
        if self.life.nodes is not None:
            self.life.nodes.check()  # before any process starts
        if self.placed:
            publish_key(self.storage, self.token)  # before any flow run asks for it
        self.maker.check(self.policy_dir, self.checkpoint_step)
        if not self.vllm_first:
            self.life.start(
                self.policy_dir, self.checkpoint_step, self.weight_dtype
            )  # loads meanwhile
            self.weights.meet_at(self.life.master)
        self.maker.prepare(self.policy_dir, self.base_model, self.checkpoint_step)
        keeper = self.servers
        keeper.supervisors = [self.maker(slot) for slot in range(keeper.first_size())]
        try:
            for sup in keeper.supervisors:  # every server loads at once
                sup.spawn()
            for sup in keeper.supervisors:
                sup.wait_ready()
            if self.vllm_first:
                self.life.start(self.policy_dir, self.checkpoint_step, self.weight_dtype)
                self.weights.meet_at(self.life.master)
            self.life.wait_healthy()
            nodes = f" × {cfg.trainer.num_nodes} nodes" if cfg.trainer.num_nodes > 1 else ""
            self.progress(
                f"services: vLLM at {', '.join(s.url for s in keeper.supervisors)}, trainer at "
                f"{self.trainer.url} ({cfg.trainer.backend}, {cfg.trainer.num_ranks} rank(s)"
                f"{nodes}; {time.perf_counter() - start:.0f}s); logs in {self.log_dir}"
            )
            self.weights.join(self.trainer, keeper.servers(), keeper.num_workers())
            if cfg.inference.urls:  # they serve what they were started with: the policy now
                version = self.checkpoint_step or 0
                self.weights.publish(self.trainer, self.inference_urls, version)
                self.progress(
                    "services: the servers started before the run now serve the trainer's "
                    f"policy (version {version})"
                )
            for sup in keeper.supervisors:
                sup.open_gate(keeper.weight_link_of_servers())
                self.fleet.add(sup.index, sup.url)
            register_fleet(cfg.run.name, self.fleet)
            keeper.record()
        except BaseException:
            self.stop()
            raise
        return self

    def restart_trainer(self, policy_dir: str | Path, checkpoint_step: int | None) -> int:
        """Replace a lost trainer: stop what is left of it (its other nodes' flow runs too),
        start it again from ``policy_dir`` (``checkpoint_step``'s checkpoint; None: the run's
        starting policy), form the weight group anew with every server and send them its
        weights. vLLM keeps running throughout; what it serves afterwards is the checkpoint's
        policy (it may have served a later, uncommitted step's). Returns the version the
        servers serve: the checkpoint's step, 0 at the start."""
        with self.weights.lock:  # no server restart re-forms the group meanwhile
            self.policy_dir, self.checkpoint_step = str(policy_dir), checkpoint_step
            self.maker.policy_dir = self.policy_dir
            self.life.restart(self.policy_dir, checkpoint_step, self.weight_dtype)
            self.weights.meet_at(self.life.master)
            version = checkpoint_step or 0
            keeper = self.servers
            self.weights.reform_after_trainer_restart(
                self.trainer, keeper.servers(), keeper.num_workers(), version
            )
        return version

    def check_alive(self) -> None:
        """Raise if the trainer died or stopped answering (a dead trainer fails the run at once);
        bring the fleet to the size asked of it (``reconcile``); restart any vLLM server that
        died (raise if it cannot be restarted)."""
        self.life.check()
        self.servers.reconcile()
        for sup in self.supervisors:
            sup.check()

    def dead_service(self, grace_s: float = 0.0) -> ServiceError | None:
        """After a failure: the error naming the service that died (``TrainerLost`` for the
        trainer, dead or not answering), None when all live. ``grace_s`` lets a process that is
        dying now (a call to it just failed) finish exiting: a trainer that no longer answers but
        whose launcher still runs is waited for, so that the message can name the rank that
        died."""
        deadline = time.monotonic() + grace_s
        while True:
            trainer_error = self.life.error()
            if trainer_error is not None and self.life.exited():
                return trainer_error
            if server_error := self.servers.dead_server():
                return server_error
            if time.monotonic() >= deadline:
                return trainer_error
            time.sleep(0.2)

    def stop(self) -> None:
        """Close the weight group on every side, then stop every process, within the deadline."""
        deadline = time.monotonic() + TEARDOWN_DEADLINE_S
        unregister_fleet(self.cfg.run.name, self.fleet)
        self.servers.stop_joining()
        for sup in self.supervisors:
            sup.close_gate()
        self.weights.close(self.trainer, self.inference_urls, self.progress)
        for sup in self.supervisors:
            sup.stop(timeout_s=max(1.0, min(10.0, deadline - time.monotonic())))
        self.life.stop(deadline)
        if self.placed:
            withdraw_key(self.storage)

    def __enter__(self) -> RunServices:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
