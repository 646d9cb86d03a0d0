"""The supervisor of each server slot of the plan: what it serves, where it runs, how it is reached.

Owns: what vLLM loads at start (the policy's model; or, under ``train.lora.sync = "adapter"``,
the base model and the adapter it serves as the policy), and how a slot's server is made: a
local ``InferenceServer`` with the plan's devices and cores, a flow run of
``inference.server_deployment`` (``PlacedServer``) that loads the policy from the run's storage,
or a server started before the run (``inference.urls``: ``StartedServer``).
"""

from __future__ import annotations

from pathlib import Path

from rollflow.infra import export
from rollflow.infra.events import Event, publish
from rollflow.services.placed import check_deployment, gpu_request, policy_in_storage
from rollflow.services.placed_server import PlacedServer
from rollflow.services.run_parts import RunParts
from rollflow.services.started_server import StartedServer
from rollflow.services.vllm_supervisor import InferenceSupervisor, max_model_len
from rollflow.services.weight_link import WeightGroupLink
from rollflow.services.zero_adapter import write_zero_adapter


class ServerMaker:
    """``maker(slot)``: the unstarted supervisor of plan slot ``slot``'s server."""

    def __init__(self, parts: RunParts, link: WeightGroupLink):
        self.cfg, self.plan, self.storage, self.link = parts.cfg, parts.plan, parts.storage, link
        self.token, self.log_dir, self.progress = parts.token, parts.log_dir, parts.progress
        self.placed = bool(self.cfg.inference.server_deployment)
        self.served: tuple[str, Path | None] = ("", None)  # what a local vLLM loads (``prepare``)
        self.served_in_storage: tuple[str, int] = ("policy", 0)  # what a placed one loads
        self.policy_dir = ""
        self._pool_variables: set[str] = set()  # the job variables of the placed servers' pool

    def check(self, policy_dir: str, checkpoint_step: int | None) -> None:
        """Before any process starts: the placed servers' deployment exists (its pool's job
        variables read), and the policy they load is in the run's storage."""
        if not self.placed:
            return
        self._pool_variables = check_deployment(
            self.cfg.inference.server_deployment,
            "inference.server_deployment",
            "or leave inference.server_deployment empty to run the servers on this host",
        )
        self.served_in_storage = policy_in_storage(
            self.storage, policy_dir, checkpoint_step, self.progress
        )

    def prepare(self, policy_dir: str, base_model: str, checkpoint_step: int | None) -> None:
        """What vLLM loads at start: the policy's model; or, under ``train.lora.sync =
        "adapter"``, the base model and the adapter to serve as the policy (the checkpoint's on
        resume, else a zero one: the base model)."""
        self.policy_dir = policy_dir
        lora_cfg = self.cfg.train.lora
        if lora_cfg is None or lora_cfg.sync != "adapter":
            self.served = (policy_dir, None)
        elif checkpoint_step:
            self.served = (base_model, Path(policy_dir) / export.ADAPTER)
        else:
            folder = self.log_dir / "adapter-v0"
            self.served = (base_model, write_zero_adapter(folder, base_model, lora_cfg))

    def __call__(self, slot: int) -> InferenceSupervisor:
        served, adapter = self.served
        planned = self.plan.servers[slot]
        return InferenceSupervisor(
            self.cfg,
            served,
            self.log_dir,
            server=self.placed_server(slot) if self.placed else self.started_server(slot),
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

    def started_server(self, slot: int) -> StartedServer | None:
        """Server ``slot`` when it was started before the run (``inference.urls``), else None."""
        inf = self.cfg.inference
        if not inf.urls:
            return None
        return StartedServer(inf.urls[slot], self.token, slot, inf.startup_timeout_s)

    def placed_server(self, slot: int) -> PlacedServer:
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
            self.served_in_storage,
            {
                "reach": self.link.spec.host,  # it binds the address that reaches node 0's host
                "port": inf.port + slot if inf.port else 0,
                "max_model_len": max_model_len(self.policy_dir),
                "startup_timeout_s": inf.startup_timeout_s,
                "extra_args": [
                    *self.plan.server_args(slot),
                    *cfg.vllm_args(),
                ],
                "env": dict(planned.env),
                "gpus": list(planned.gpus),  # its host's first ones, which its flow run names
                "cpus": list(planned.cpus),
            },
            api_key=self.token,
            progress=self.progress,
            job_variables=gpu_request(self._pool_variables, len(planned.gpus)),
            storage_secret=cfg.run.storage_secret,
        )
