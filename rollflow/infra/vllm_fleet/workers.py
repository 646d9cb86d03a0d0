"""The orchestrator's typed client of a vLLM server's workers: the worker extension's methods.

Owns: the name and the argument order of every method of ``worker_extension.WeightReceiver``
that is called from outside the server, each declared once below. A call goes through the
server's ``/collective_rpc`` (``InferenceClient.collective_rpc``), runs on every worker of the
server, and returns one result per worker. No other module names a worker method.
"""

from __future__ import annotations

import json
from typing import Any

from rollflow.infra.vllm_fleet.client import InferenceClient


class WeightWorkers:
    """The weight-group methods of one server's workers (``worker_extension.WeightReceiver``)."""

    def __init__(self, client: InferenceClient):
        self.client = client

    async def init_weight_group(
        self,
        *,
        host: str,
        port: int,
        first_rank: int,
        world_size: int,
        group_timeout_s: float,
        metadata: list[dict[str, Any]],
        wire_device: str,
        bucket_bytes: int,
        timeout_s: float,
    ) -> list[int]:
        """Every worker joins the weight group from rank ``first_rank`` on; their ranks."""
        args = [
            host,
            port,
            first_rank,
            world_size,
            group_timeout_s,
            json.dumps(metadata),
            wire_device,
            bucket_bytes,
        ]
        ranks = await self.client.collective_rpc("init_weight_group", args, timeout_s=timeout_s)
        return [int(r) for r in ranks]

    async def receive_weights(self, timeout_s: float) -> list[int]:
        """Every worker receives one broadcast and loads it; the policy version each loaded."""
        versions = await self.client.collective_rpc("receive_weights", timeout_s=timeout_s)
        return [int(v) for v in versions]

    async def close_weight_group(self, timeout_s: float | None = None) -> None:
        """Every worker leaves the weight group (a no-op where not joined)."""
        await self.client.collective_rpc("close_weight_group", [], timeout_s=timeout_s)
