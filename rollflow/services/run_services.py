"""The run's long-lived services: the trainer, the inference deployment, the weight group.

``RunServices`` places the processes with the placement plan, starts the trainer and every
vLLM server (they load at once), forms the weight group (trainer rank 0, then every worker of
every server) and tears everything down within a deadline. ``check_alive()``, called by the
step loop every ``HEALTH_CHECK_INTERVAL_S`` from the main thread, fails the run when the trainer
died, grows or shrinks the inference fleet toward the size ``rollflow scale`` asked
(``reconcile``; ``inference/fleet.py``) and has each server's supervisor restart it if it died
(``inference/supervisor.py``).

Invariant: when ``stop()`` returns (or the ``with`` block exits, on success or error), the
weight group is closed on both sides and no service process is left. Processes are spawned from
the calling thread because the kernel kills them when the thread that spawned them exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import shlex
import threading
import time
from pathlib import Path

from rollflow.infra.config import RunConfig
from rollflow.infra.errors import ServiceError, TrainerLost, WeightSyncError
from rollflow.infra.events import Event, publish
from rollflow.infra.http import Endpoint
from rollflow.infra.placement import Machine, make_plan, resolve_addresses
from rollflow.infra.storage import RunStorage
from rollflow.infra.vllm_fleet.fleet import (
    Fleet,
    asked_servers,
    record_fleet,
    register_fleet,
    unregister_fleet,
)
from rollflow.services.placed import check_deployment, gpu_request, publish_key, withdraw_key
from rollflow.services.placed_server import PlacedServer
from rollflow.services.placed_trainer import PlacedTrainer, TrainerNodes
from rollflow.services.trainer_process import TrainerProcess, node_argv
from rollflow.services.vllm_supervisor import (
    HEALTH_PROBE_TIMEOUT_S,
    InferenceSupervisor,
    WeightLink,
    max_model_len,
)
from rollflow.tasks.sync import weights
from rollflow.tasks.sync.weights import GroupSpec
from rollflow.tasks.train.client import TrainerClient
from rollflow.trainer import lora
from rollflow.trainer.protocol import ServiceArgs

TEARDOWN_DEADLINE_S = 30.0
HEALTH_CHECK_INTERVAL_S = 5.0
JOIN_TRIES = 3  # failed joins of a server before the fleet stops trying to grow to that size
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
        self.node0_placed = bool(cfg.trainer.node_deployment)
        if cfg.trainer.master_addr == "auto" and not self.node0_placed:  # (placed: node 0's)
            cfg = resolve_addresses(cfg)
            progress(f"services: trainer.master_addr = auto: {cfg.trainer.master_addr}")
        self.cfg, self.policy_dir, self.checkpoint_step = cfg, str(policy_dir), checkpoint_step
        # The model before any training (policy_dir is a checkpoint's merged model on resume):
        # what vLLM serves under an adapter sync.
        self.base_model = str(base_model or policy_dir)
        self.log_dir = Path(log_dir)
        self.progress = progress
        self.token = secrets.token_urlsafe(24)
        # Impossible plans fail here, before any process starts.
        self.plan = make_plan(cfg, machine or Machine.here(nodes=cfg.trainer.num_nodes))
        self._group = GroupSpec.from_plan(self.plan, cfg.trainer.weight_bucket_mb)
        self.storage = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options)
        # What every server serves, and so what the trainer sends (one device for all servers).
        self.weight_dtype = self.plan.serving_dtype
        self.weights_lock = threading.Lock()
        self.trainer_proc: TrainerProcess | PlacedTrainer | None = None
        self.nodes: TrainerNodes | None = None  # the trainer's nodes as flow runs, where so placed
        self.supervisors: list[InferenceSupervisor] = []  # the fleet's, in slot order
        self.fleet = Fleet()
        self._served: tuple[str, Path | None] = (self.policy_dir, None)  # what vLLM loads
        self._joining: _Joining | None = None  # a server starting to join the fleet
        self._asked_error: str | None = None  # a bad control file, said once
        self._join_failures: dict[int, int] = {}  # fleet size asked → joins that failed for it
        self._join_target = 0  # the size the last join was for
        self.trainer: TrainerClient | None = None
        self.group_formed = False
        # vLLM servers as flow runs on other hosts (flows/servers.py), where so placed
        self.placed = bool(cfg.inference.server_deployment)
        self._served_model: tuple[str, int] = ("policy", 0)  # what placed servers load
        self._server_pool_variables: set[str] = set()  # the job variables of their pool

    def _model_in_storage(self, checkpoint_step: int | None) -> tuple[str, int]:
        """Where processes on other hosts (trainer nodes, placed vLLM servers) find the policy
        in the run's storage: ``checkpoint_step``'s checkpoint (the one being resumed), else the
        policy itself, put there once."""
        if checkpoint_step:
            return ("checkpoints", checkpoint_step)
        storage = self.storage
        if 0 not in storage.committed_steps("policy"):
            self.progress(
                f"services: putting the policy in {storage.step_uri('policy', 0)} for the "
                "processes on other hosts"
            )
            storage.upload_dir(self.policy_dir, "policy", 0)
        return ("policy", 0)

    @property
    def inference_urls(self) -> list[str]:
        return [s.url for s in self.supervisors]

    @property
    def inference_endpoints(self) -> list[Endpoint]:
        return [Endpoint("inference", url, self.token) for url in self.inference_urls]

    def _servers(self) -> list[tuple[str, int]]:
        """(url, first weight-group rank) of every server of the fleet: after the trainer's
        rank 0, each server's workers in slot order."""
        out, rank = [], 1
        for sup in self.supervisors:
            out.append((sup.url, rank))
            rank += len(self.plan.servers[sup.index].weight_ranks)
        return out

    @property
    def group(self) -> GroupSpec:
        """The weight group of the fleet as it is now: the trainer and every server's workers."""
        workers = sum(len(self.plan.servers[sup.index].weight_ranks) for sup in self.supervisors)
        return dataclasses.replace(self._group, world_size=1 + workers)

    # ------------------------------------------------------------------- start

    def start(self) -> RunServices:
        cfg = self.cfg
        start = time.perf_counter()
        if self.node0_placed:
            secret = cfg.run.storage_secret
            self.nodes = TrainerNodes(
                cfg.trainer.node_deployment,
                cfg.trainer.node_queues,
                self.progress,
                gpus=len(self.plan.trainer_nodes[-1].gpus),
                storage_secret=(cfg.run.storage, secret) if secret else None,
            )
            self.nodes.check()  # before any process starts
        if self.placed or self.node0_placed:
            publish_key(self.storage, self.token)  # before any flow run asks for it
        if self.placed:
            self._server_pool_variables = check_deployment(
                cfg.inference.server_deployment,
                "inference.server_deployment",
                "or leave inference.server_deployment empty to run the servers on this host",
            )
            self._served_model = self._model_in_storage(self.checkpoint_step)
        self._start_trainer()  # loads while vLLM starts
        self._start_other_nodes()
        self._served = self._served_policy()
        self.supervisors = [self._supervisor(slot) for slot in range(self._first_size())]
        try:
            for sup in self.supervisors:  # every server loads at once
                sup.spawn()
            for sup in self.supervisors:
                sup.wait_ready()
            self.trainer_proc.wait_healthy()
            servers = ", ".join(self.inference_urls)
            self.progress(
                f"services: vLLM at {servers}, trainer at {self.trainer.url} "
                f"({cfg.trainer.backend}, {cfg.trainer.num_ranks} rank(s)"
                f"{f' × {cfg.trainer.num_nodes} nodes' if cfg.trainer.num_nodes > 1 else ''}; "
                f"{time.perf_counter() - start:.0f}s); logs in {self.log_dir}"
            )
            self.group_formed = True  # (partly) formed from here on: teardown closes it
            weights.join(
                self.trainer, self._servers(), self.group, cfg.trainer.weight_sync_timeout_s
            )
            for sup in self.supervisors:
                sup.open_gate(self._link())
                self.fleet.add(sup.index, sup.url)
            register_fleet(cfg.run.name, self.fleet)
            self._record_fleet()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_other_nodes(self) -> None:
        """Trainer nodes 1..: flow runs of ``trainer.node_deployment`` (``nodes.py``), meeting
        node 0 where it said (``self._group.host``), or the commands a person runs on their
        hosts, printed."""
        cfg = self.cfg
        tr = cfg.trainer.model_copy(update={"master_addr": self._group.host})  # found, if auto
        args = self.trainer_proc.args.model_copy(update={"trainer": tr})
        commands = {}
        for node in self.plan.trainer_nodes[1:]:
            commands[node.node] = (
                node_argv(
                    tr,
                    node.node,
                    self.trainer_proc.args_file,
                    cfg.trainer.master_port,
                    node.env,  # DeepSpeed names that node's GPUs with --include
                    # The arguments themselves: the node may be another host, without our files.
                    service_args=args.model_dump_json(),
                ),
                dict(node.env),
            )
        wait = f"trainer: waiting up to {cfg.trainer.startup_timeout_s:.0f}s for node"
        if not commands:
            return
        if self.nodes is not None:
            self.nodes.submit(cfg.run.name, commands)
            self.progress(f"{wait}s {', '.join(map(str, commands))} to join")
            return
        for node, (cmd, env) in commands.items():
            prefix = "".join(f"{k}={v} " for k, v in sorted(env.items()))
            self.progress(
                f"{wait} {node} of {cfg.trainer.num_nodes}; on it, run: {prefix}{shlex.join(cmd)}"
            )

    def _supervisor(self, slot: int) -> InferenceSupervisor:
        """The supervisor of the server in plan slot ``slot`` (not started)."""
        served, adapter = self._served
        planned = self.plan.servers[slot]
        return InferenceSupervisor(
            self.cfg,
            served,
            self.log_dir,
            server=self._placed_server(slot) if self.placed else None,
            lora_adapter=adapter,
            index=slot,
            env=planned.env,
            cpus=planned.cpus,
            server_args=self.plan.server_args(slot),
            progress=self.progress,
            api_key=self.token,  # every vLLM route needs the run's token (inference/auth.py)
            on_restart=lambda info: publish(
                self.storage, Event.INFERENCE_RESTARTED, server=slot, **info
            ),
        )

    def _placed_server(self, slot: int) -> PlacedServer:
        """Server ``slot`` as a flow run of ``inference.server_deployment``, which loads what
        the run serves from its storage (the run's policy, or the resumed checkpoint)."""
        cfg, planned = self.cfg, self.plan.servers[slot]
        inf = cfg.inference
        return PlacedServer(
            inf.server_deployment,
            inf.server_queues[slot] if inf.server_queues else "",
            cfg.run.name,
            slot,
            (cfg.run.storage, cfg.run.storage_options),
            self._served_model,
            {
                "reach": self._group.host,  # it binds the address that reaches node 0's host
                "port": inf.port + slot if inf.port else 0,
                "max_model_len": max_model_len(self.policy_dir),
                "startup_timeout_s": inf.startup_timeout_s,
                "extra_args": [*self.plan.server_args(slot), *inf.extra_args],
                "env": dict(planned.env),
                "cpus": list(planned.cpus),
            },
            api_key=self.token,
            progress=self.progress,
            job_variables=gpu_request(self._server_pool_variables, len(planned.gpus)),
            storage_secret=cfg.run.storage_secret,
        )

    def _link(self) -> WeightLink:
        return WeightLink(rejoin=self._rejoin, lock=self.weights_lock, moved=self._moved)

    def _moved(self, slot: int, url: str) -> None:
        """Server ``slot`` came back at ``url`` after a restart (a pool placed its flow run on
        another host): the fleet follows it (under the group's lock, which the restart holds)."""
        self.fleet.add(slot, url)
        self._record_fleet()

    def _first_size(self) -> int:
        """How many servers the run starts with: the size last asked of the fleet
        (``rollflow scale``: a rerun keeps it), else ``inference.num_servers``."""
        return self._asked() or self.cfg.inference.num_servers

    def _start_trainer(self) -> None:
        """Start node 0 of the trainer from ``policy_dir`` (``checkpoint_step``'s, on resume):
        here, or as a flow run (``PlacedTrainer``), waited for until it says where it serves and
        meets the other nodes (the weight group's host from then on)."""
        cfg, node = self.cfg, self.plan.trainer_nodes[0]
        args = trainer_args(cfg, self.policy_dir, self.checkpoint_step, self.weight_dtype)
        if cfg.trainer.num_nodes > 1 or self.node0_placed:
            stored = self._model_in_storage(self.checkpoint_step)
            args = args.model_copy(update={"model_in_storage": stored})
        if self.node0_placed:
            from rollflow.infra.network import own_address

            self.trainer_proc = PlacedTrainer(
                self.nodes,
                cfg.run.name,
                args,
                self.token,
                self.storage,
                {
                    "storage": (cfg.run.storage, cfg.run.storage_options),
                    "reach": own_address(),  # node 0 serves toward this host
                    "env": dict(node.env),
                    "cpus": list(node.cpus),
                },
                progress=self.progress,
            ).start()
            master = self.trainer_proc.wait_placed()
            self._group = dataclasses.replace(self._group, host=master)
            self.trainer = self.trainer_proc.client
            return
        self.trainer_proc = TrainerProcess(
            args,
            token=self.token,
            log_dir=self.log_dir,
            beside_inference=True,
            device_env=node.env,
            cpus=node.cpus,
        )
        self.trainer = self.trainer_proc.client
        self.trainer_proc.start()

    def restart_trainer(self, policy_dir: str | Path, checkpoint_step: int | None) -> int:
        """Replace a lost trainer: stop what is left of it, start it again from ``policy_dir``
        (``checkpoint_step``'s checkpoint; None: the run's starting policy), its other nodes too
        where they are flow runs (cancelled, then submitted again), form the weight group anew
        with every server and send them its weights. vLLM keeps running throughout; what it
        serves afterwards is the checkpoint's policy (it may have served a later, uncommitted
        step's). Returns the version the servers serve: the checkpoint's step, 0 at the start.

        The lost trainer's log is kept beside the new one, as ``trainer.lost-N.log`` (a placed
        node 0's stays in its flow run's log).
        """
        t = self.cfg.trainer  # one node, or nodes this run submits (the caller checks)
        with self.weights_lock:  # no server restart re-forms the group meanwhile
            self.trainer_proc.stop(timeout_s=10.0)
            if self.nodes is not None:  # every node goes with node 0, and is submitted anew
                self.nodes.stop(timeout_s=TEARDOWN_DEADLINE_S)
            self.trainer_proc.set_aside_log()
            self.policy_dir, self.checkpoint_step = str(policy_dir), checkpoint_step
            self._start_trainer()
            if self.nodes is not None:
                self._start_other_nodes()
            self.trainer_proc.wait_healthy()
            # A server's workers may still wait in the lost trainer's broadcast (on NCCL, up to
            # its timeout): leaving the group first waits that out, on every server.
            with contextlib.suppress(WeightSyncError):
                weights.leave(self.trainer, self.inference_urls, timeout_s=t.weight_sync_timeout_s)
            weights.join(self.trainer, self._servers(), self.group, t.weight_sync_timeout_s)
            version = checkpoint_step or 0
            weights.publish(self.trainer, self.inference_urls, version, t.weight_sync_timeout_s)
        return version

    def _served_policy(self) -> tuple[str, Path | None]:
        """What vLLM loads at start: the policy's model; or, under ``train.lora.sync =
        "adapter"``, the base model and the adapter to serve as the policy (the checkpoint's on
        resume, else a zero one: the base model)."""
        lora_cfg = self.cfg.train.lora
        if lora_cfg is None or lora_cfg.sync != "adapter":
            return self.policy_dir, None
        if self.checkpoint_step:
            return self.base_model, Path(self.policy_dir) / lora.ADAPTER_DIR
        folder = self.log_dir / "adapter-v0"
        return self.base_model, lora.save_initial_adapter(folder, self.base_model, lora_cfg)

    def _rejoin(self) -> int:
        """A restarted server's re-join: the group forms anew with every server (see weights)."""
        t = self.cfg.trainer
        return weights.rejoin(
            self.trainer, self._servers(), self.group, t.weight_sync_timeout_s, t.request_timeout_s
        )

    # ------------------------------------------------------------------- check

    def check_alive(self) -> None:
        """Raise if the trainer died or stopped answering (a dead trainer fails the run at once);
        bring the fleet to the size asked of it (``reconcile``); restart any vLLM server that
        died (raise if it cannot be restarted)."""
        self._check_trainer()
        self.reconcile()
        for sup in self.supervisors:
            sup.check()

    # ------------------------------------------------------------------- fleet

    def reconcile(self) -> None:
        """Grow or shrink the fleet toward the size ``rollflow scale`` asked (the control file
        in the run's storage), one server at a time. A server starts in the background and
        joins at a later call once healthy; a leaving one is a dead server first (a preempted
        one is not restarted when the fleet is to shrink), else the newest. Main thread only:
        services die with the thread that spawned them."""
        target = self._asked()
        if self._joining is not None:
            if target is not None and target <= len(self.supervisors):
                self._cancel_join("the fleet was asked to shrink meanwhile")
            elif self._joining.done():
                self._finish_join()
            return
        if target is None or target == len(self.supervisors):
            return
        if target > len(self.supervisors):
            if self._join_failures.get(target, 0) < JOIN_TRIES:
                self._join_target = target
                self._begin_join()
        else:
            self._leave(*self._leaver())

    def _asked(self) -> int | None:
        """The fleet size asked, within 1..``inference.fleet_slots()`` (None: nothing asked, or
        a bad control file). What is wrong with the ask is said once, while it stays so."""
        try:
            asked = asked_servers(self.storage)
        except ValueError as exc:
            self._say_bad_control(str(exc))
            return None
        slots = self.cfg.inference.fleet_slots()
        if asked is not None and asked > slots:
            self._say_bad_control(
                f"{asked} servers were asked but the plan has {slots} slot(s) "
                f"(inference.max_servers = {self.cfg.inference.max_servers}); growing to {slots}"
            )
            return slots
        self._asked_error = None
        return asked

    def _join_failed(self, sup: InferenceSupervisor, why: str, error: BaseException) -> None:
        """Say and record a join that failed, and count it toward the size it was for (asking
        another size starts anew); at ``JOIN_TRIES`` the fleet stops trying that size."""
        target = self._join_target
        failures = self._join_failures.get(target, 0) + 1
        self._join_failures = {target: failures}
        self.progress(f"fleet: {sup.name} {why}, the fleet stays as it is: {error}")
        if failures == JOIN_TRIES:
            self.progress(
                f"fleet: {target} servers asked, {len(self.supervisors)} serve: {JOIN_TRIES} "
                "joins failed; ask another size to try again"
            )
        publish(
            self.storage,
            Event.FLEET_CHANGED,
            servers=len(self.supervisors),
            failed=sup.index,
            error=str(error),
        )

    def _say_bad_control(self, message: str) -> None:
        if message != self._asked_error:
            self._asked_error = message
            self.progress(f"fleet: {message}")

    def _begin_join(self) -> None:
        taken = {sup.index for sup in self.supervisors}
        slot = min(set(range(self.cfg.inference.fleet_slots())) - taken)
        sup = self._supervisor(slot)
        self.progress(f"fleet: starting {sup.name} ({len(taken) + 1} server(s) asked)")
        sup.spawn()
        self._joining = _Joining(sup)

    def _cancel_join(self, why: str) -> None:
        joining, self._joining = self._joining, None
        self.progress(f"fleet: {joining.sup.name} stopped before joining: {why}")
        joining.sup.server.stop(timeout_s=10.0)

    def _finish_join(self) -> None:
        """The started server is healthy (or failed to start): join it to the weight group with
        every server, give all of them the trainer's weights, then let sampling in."""
        joining, self._joining = self._joining, None
        sup = joining.sup
        if joining.error is not None:
            self._join_failed(sup, "did not start", joining.error)
            return
        with self._weights_turn(f"{sup.name} joining"):  # no sync meanwhile: the group changes
            self.supervisors = sorted([*self.supervisors, sup], key=lambda s: s.index)
            try:
                version = self._rejoin()
            except Exception as exc:
                # The group is formed again without it; only if that fails too is the run lost.
                self.supervisors.remove(sup)
                sup.server.stop(timeout_s=10.0)
                try:
                    self._rejoin()
                except Exception as again:
                    raise ServiceError(
                        f"{sup.name} could not join the weight group ({exc}), and the group "
                        f"could not be formed again without it: {again}"
                    ) from again
                self._join_failed(sup, "could not join the weight group", exc)
                return
            sup.open_gate(self._link())
            self.fleet.add(sup.index, sup.url)
        info = {
            "servers": len(self.supervisors),
            "joined": sup.index,
            "url": sup.url,
            "join_s": joining.elapsed(),
            "version": version,
        }
        self._record_fleet()
        publish(self.storage, Event.FLEET_CHANGED, **info)
        self.progress(
            f"fleet: {sup.name} joined in {info['join_s']:.0f}s, serving policy version {version}; "
            f"{info['servers']} server(s)"
        )

    def _record_fleet(self) -> None:
        record_fleet(self.storage, self.cfg.inference.fleet_slots(), self.fleet)

    @contextlib.contextmanager
    def _weights_turn(self, what: str):
        """The weight group's lock, within the longest a sync holding it may take."""
        timeout_s = 2 * self.cfg.trainer.weight_sync_timeout_s + 30.0
        if not self.weights_lock.acquire(timeout=timeout_s):
            raise ServiceError(f"{what}: the weight group stayed busy for {timeout_s:.0f}s")
        try:
            yield
        finally:
            self.weights_lock.release()

    def _leaver(self) -> tuple[InferenceSupervisor, bool]:
        """Which server leaves: one that does not serve (preempted: dead or not answering),
        else the newest; and whether it was preempted."""
        down = [sup for sup in self.supervisors if not sup.serving()]
        return (down or self.supervisors)[-1], bool(down)

    def _leave(self, sup: InferenceSupervisor, preempted: bool) -> None:
        """Take ``sup``'s server out: no new request, its requests in flight retried on the
        others, the weight group formed anew without it."""
        start = time.monotonic()
        with self._weights_turn(f"{sup.name} leaving"):
            self.fleet.remove(sup.index)
            self.supervisors.remove(sup)
            sup.retire(timeout_s=10.0)
            version = self._rejoin()
        info = {
            "servers": len(self.supervisors),
            "left": sup.index,
            "preempted": preempted,
            "leave_s": time.monotonic() - start,
            "version": version,
        }
        self._record_fleet()
        publish(self.storage, Event.FLEET_CHANGED, **info)
        self.progress(
            f"fleet: {sup.name} left{' (it was down: preempted)' if preempted else ''} in "
            f"{info['leave_s']:.0f}s; {info['servers']} server(s) serve policy version {version}"
        )

    def _check_trainer(self) -> None:
        """Raise ``ServiceError`` naming the trainer (and its dead rank) if it died or does not
        answer, or naming its node whose flow run ended (where the run submitted them)."""
        self.trainer_proc.check_alive(timeout_s=HEALTH_PROBE_TIMEOUT_S)
        if self.nodes is not None:
            self.nodes.check_running()

    def dead_service(self, grace_s: float = 0.0) -> ServiceError | None:
        """After a failure: the error naming the service that died (``TrainerLost`` for the
        trainer, dead or not answering), None when all live.
        ``grace_s`` lets a process that is dying now (a call to it just failed) finish exiting: a
        trainer that no longer answers but whose launcher still runs is waited for, so that the
        message can name the rank that died."""
        deadline = time.monotonic() + grace_s
        while True:
            trainer_error = None
            try:
                if self.trainer_proc is not None:
                    self._check_trainer()
            except ServiceError as exc:
                trainer_error = TrainerLost(str(exc))
                if not self.trainer_proc.is_alive():
                    return trainer_error
            for sup in self.supervisors:
                server = sup.server
                if not server.is_alive():
                    return ServiceError(
                        f"{sup.name} died ({server.ended()}); see {server.log_path}"
                    )
            if time.monotonic() >= deadline:
                return trainer_error
            time.sleep(0.2)

    # -------------------------------------------------------------------- stop

    def stop(self) -> None:
        """Close the weight group on every side, then stop every process, within the deadline."""
        deadline = time.monotonic() + TEARDOWN_DEADLINE_S
        unregister_fleet(self.cfg.run.name, self.fleet)
        if self._joining is not None:
            self._joining, joining = None, self._joining
            joining.sup.server.stop(timeout_s=10.0)
        for sup in self.supervisors:
            sup.close_gate()
        if self.group_formed:
            self.group_formed = False
            try:
                weights.leave(self.trainer, self.inference_urls, timeout_s=5.0)
            except Exception as exc:  # a dead peer must not block teardown
                self.progress(f"teardown: {exc}")
        for sup in self.supervisors:
            sup.stop(timeout_s=max(1.0, min(10.0, deadline - time.monotonic())))
        if self.trainer_proc is not None:
            self.trainer_proc.stop(timeout_s=max(1.0, deadline - time.monotonic()))
        if self.nodes is not None:  # their ranks end with node 0's; a node that did not: cancelled
            self.nodes.end(grace_s=max(5.0, deadline - time.monotonic()))
        if self.placed or self.node0_placed:
            withdraw_key(self.storage)

    def __enter__(self) -> RunServices:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Joining:
    """A server started to join the fleet, waited for in the background (only the wait: it was
    spawned on the main thread)."""

    def __init__(self, sup: InferenceSupervisor):
        self.sup, self.error = sup, None
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._wait, name=f"join-{sup.index}", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        try:
            self.sup.wait_ready()
        except Exception as exc:  # noqa: BLE001 - said by the run's services
            self.error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def elapsed(self) -> float:
        return time.monotonic() - self._start


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
        train=cfg.train,
        trainer=cfg.trainer,
        sampling=cfg.sampling,
    )
