"""The run's long-lived services: the trainer, the inference deployment, the weight group.

``RunServices`` starts both processes, joins the weight group (trainer rank 0, each inference
worker one rank) and tears everything down within a deadline.

Invariant: when ``stop()`` returns (or the ``with`` block exits, on success or error), the
weight group is closed on both sides and no service process is left. Processes are spawned from
the calling thread because the kernel kills them when the thread that spawned them exits.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path

import httpx

from rollflow.infra.config import RunConfig
from rollflow.infra.http import Endpoint, ServiceCallError, acall, call
from rollflow.infra.inference.client import InferenceClient
from rollflow.infra.inference.server import InferenceServer
from rollflow.infra.inference.sync import init_weight_group
from rollflow.infra.launch import TrainerProcess
from rollflow.infra.service import free_port

TEARDOWN_DEADLINE_S = 30.0


class RunServices:
    """Trainer service + vLLM server + the weight group between them."""

    def __init__(self, cfg: RunConfig, policy_dir: str | Path, checkpoint_step: int | None, log_dir: str | Path,
                 progress=print):
        self.cfg, self.policy_dir, self.checkpoint_step = cfg, str(policy_dir), checkpoint_step
        self.log_dir = Path(log_dir)
        self.progress = progress
        self.token = secrets.token_urlsafe(24)
        self.trainer_proc: TrainerProcess | None = None
        self.inference: InferenceServer | None = None
        self.trainer: Endpoint | None = None
        self.inference_ep: Endpoint | None = None
        self.group_open = False

    # ------------------------------------------------------------------- start

    def start(self) -> RunServices:
        cfg = self.cfg
        start = time.perf_counter()
        self.trainer_proc = TrainerProcess(
            trainer_args(cfg, self.policy_dir, self.checkpoint_step), backend=cfg.trainer.backend,
            num_ranks=cfg.trainer.num_ranks, token=self.token, log_dir=self.log_dir,
            startup_timeout_s=cfg.trainer.startup_timeout_s,
        )
        self.trainer = self.trainer_proc.endpoint
        self.trainer_proc.start()  # loads while vLLM starts
        max_len = _max_model_len(self.policy_dir)
        self.inference = InferenceServer(
            self.policy_dir, host=cfg.inference.host, port=cfg.inference.port, max_model_len=max_len,
            startup_timeout_s=cfg.inference.startup_timeout_s, extra_args=cfg.inference.extra_args,
            log_path=self.log_dir / "vllm.log",
        )
        try:
            self.inference.start()
            self.inference_ep = Endpoint("inference", self.inference.url, self.token)
            self.trainer_proc.wait_healthy()
            self.progress(f"services: vLLM at {self.inference.url}, trainer at {self.trainer.url} "
                          f"({cfg.trainer.backend}, {cfg.trainer.num_ranks} rank(s); "
                          f"{time.perf_counter() - start:.0f}s); logs in {self.log_dir}")
            asyncio.run(self._join_weight_group())
        except BaseException:
            self.stop()
            raise
        return self

    async def _join_weight_group(self) -> None:
        timeout_s = self.cfg.trainer.weight_sync_timeout_s
        metadata = call(self.trainer, "/weights/metadata", timeout_s=timeout_s, method="GET")
        port = free_port()
        client = InferenceClient(self.inference.url, timeout_s=timeout_s)
        async with httpx.AsyncClient() as http:
            try:
                connect = lambda: acall(  # noqa: E731
                    http, self.trainer, "/weights/connect",
                    {"host": "127.0.0.1", "port": port, "world_size": 2, "timeout_s": timeout_s},
                    timeout_s=timeout_s)
                await init_weight_group(client, connect, "127.0.0.1", port, 2, timeout_s, metadata)
            finally:
                await client.aclose()
        self.group_open = True

    # -------------------------------------------------------------------- stop

    def check_alive(self) -> None:
        """Raise if a service died or stopped answering: a dead component fails the run at once."""
        if self.trainer_proc is None:
            raise ServiceCallError("the trainer was never started")
        self.trainer_proc.check_alive()  # names a dead rank
        if self.inference is None or not self.inference.is_alive():
            raise ServiceCallError(f"the vLLM server died; see the logs in {self.log_dir}")
        url = f"{self.inference.url}/health"
        try:
            healthy = httpx.get(url, timeout=10).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if not healthy:
            raise ServiceCallError(f"the vLLM server is unhealthy ({url}); see the logs in {self.log_dir}")

    def stop(self) -> None:
        """Close the weight group on both sides, then stop both processes, within the deadline."""
        deadline = time.monotonic() + TEARDOWN_DEADLINE_S
        if self.group_open:
            self.group_open = False
            for close in (self._close_trainer_group, self._close_inference_group):
                try:
                    close(max(1.0, min(5.0, deadline - time.monotonic())))
                except Exception as exc:  # a dead peer must not block teardown
                    self.progress(f"teardown: {exc}")
        if self.inference is not None:
            self.inference.stop(timeout_s=max(1.0, (deadline - time.monotonic()) / 2))
        if self.trainer_proc is not None:
            self.trainer_proc.stop(timeout_s=max(1.0, deadline - time.monotonic()))

    def _close_trainer_group(self, timeout_s: float) -> None:
        call(self.trainer, "/weights/close", timeout_s=timeout_s)

    def _close_inference_group(self, timeout_s: float) -> None:
        async def run():
            client = InferenceClient(self.inference.url, timeout_s=timeout_s)
            try:
                await client.collective_rpc("close_weight_group", [])
            finally:
                await client.aclose()

        asyncio.run(run())

    def __enter__(self) -> RunServices:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def trainer_args(cfg: RunConfig, policy_dir: str, checkpoint_step: int | None) -> dict:
    """The trainer service's start arguments (``ServiceArgs`` of ``tasks/train/service.py``)."""
    t, tr = cfg.train, cfg.trainer
    return {
        "model_path": str(policy_dir), "checkpoint_step": checkpoint_step,
        "storage_root": cfg.run.storage, "storage_options": cfg.run.storage_options, "run": cfg.run.name,
        "lr": t.lr, "weight_decay": t.weight_decay, "max_grad_norm": t.max_grad_norm,
        "warmup_steps": t.lr_warmup_steps, "micro_batch_tokens": tr.micro_batch_tokens, "seed": cfg.run.seed,
        "zero_stage": tr.zero_stage or 1, "device": tr.device, "reference_model": t.kl_coef > 0,
        "timeout_s": tr.request_timeout_s,
    }


def _max_model_len(policy_dir: str) -> int | None:
    try:
        return json.loads((Path(policy_dir) / "config.json").read_text())["max_position_embeddings"]
    except (OSError, KeyError, ValueError):
        return None
