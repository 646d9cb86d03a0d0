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
import sys
import time
from pathlib import Path

import httpx

from rollflow.infra.config import RunConfig
from rollflow.infra.http import Endpoint, ServiceCallError, acall, call
from rollflow.infra.inference.client import InferenceClient
from rollflow.infra.inference.server import InferenceServer
from rollflow.infra.inference.sync import init_weight_group
from rollflow.infra.service import ManagedProcess, free_port

TEARDOWN_DEADLINE_S = 30.0


class RunServices:
    """Trainer service + vLLM server + the weight group between them."""

    def __init__(self, cfg: RunConfig, policy_dir: str | Path, checkpoint_step: int | None, log_dir: str | Path,
                 progress=print):
        self.cfg, self.policy_dir, self.checkpoint_step = cfg, str(policy_dir), checkpoint_step
        self.log_dir = Path(log_dir)
        self.progress = progress
        self.token = secrets.token_urlsafe(24)
        self.trainer_proc: ManagedProcess | None = None
        self.inference: InferenceServer | None = None
        self.trainer: Endpoint | None = None
        self.inference_ep: Endpoint | None = None
        self.group_open = False

    # ------------------------------------------------------------------- start

    def start(self) -> RunServices:
        cfg = self.cfg
        start = time.perf_counter()
        host = "127.0.0.1"
        port = free_port(host)
        args = {
            "model_path": self.policy_dir, "checkpoint_step": self.checkpoint_step,
            "storage_root": cfg.run.storage, "storage_options": cfg.run.storage_options, "run": cfg.run.name,
            "lr": cfg.train.lr, "weight_decay": cfg.train.weight_decay, "max_grad_norm": cfg.train.max_grad_norm,
            "micro_batch_tokens": cfg.trainer.micro_batch_tokens, "seed": cfg.run.seed, "host": host, "port": port,
            "num_steps": cfg.run.num_steps,
        }
        self.trainer = Endpoint("trainer", f"http://{host}:{port}", self.token)
        self.trainer_proc = ManagedProcess(
            "trainer", [sys.executable, "-m", "rollflow.tasks.train.service", json.dumps(args)],
            self.log_dir / "trainer.log", env={"ROLLFLOW_TOKEN": self.token},
        )
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
            self.trainer_proc.wait_healthy(
                lambda: call(self.trainer, "/health", timeout_s=2, method="GET")["ok"],
                self.cfg.trainer.startup_timeout_s,
            )
            self.progress(f"services: vLLM at {self.inference.url}, trainer at {self.trainer.url} "
                          f"({time.perf_counter() - start:.0f}s); logs in {self.log_dir}")
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
        probes = (("trainer", self.trainer_proc, f"{self.trainer.url}/health", self.trainer.headers()),
                  ("vLLM server", self.inference, f"{self.inference.url}/health", {}))
        for name, proc, url, headers in probes:
            if proc is None or not proc.is_alive():
                raise ServiceCallError(f"the {name} died; see the logs in {self.log_dir}")
            try:
                healthy = httpx.get(url, headers=headers, timeout=10).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if not healthy:
                raise ServiceCallError(f"the {name} is unhealthy ({url}); see the logs in {self.log_dir}")

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


def _max_model_len(policy_dir: str) -> int | None:
    try:
        return json.loads((Path(policy_dir) / "config.json").read_text())["max_position_embeddings"]
    except (OSError, KeyError, ValueError):
        return None
