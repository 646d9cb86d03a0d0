"""The orchestrator's typed client of a vLLM server's workers: the worker extension's methods.

Every method it calls is one of ``inference/protocol.WORKER_METHODS`` (name, argument model,
reply), which the worker extension (``inference/worker_extension.WeightReceiver``) parses with
the same models. A call goes through the server's ``/collective_rpc``
(``InferenceClient.collective_rpc``), runs on every worker of the server, and returns one reply
per worker. No other module of the run's side calls a worker method.
"""

from __future__ import annotations

from typing import Any

from rollflow.inference.protocol import (
    CLOSE_WEIGHT_GROUP,
    INIT_WEIGHT_GROUP,
    RECEIVE_WEIGHTS,
    CloseWeightGroup,
    JoinWeightGroup,
    ReceiveWeights,
    WorkerMethod,
    WorkerMethodFailed,
)
from rollflow.infra.errors import InferenceError
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
        args = JoinWeightGroup(
            host=host,
            port=port,
            first_rank=first_rank,
            world_size=world_size,
            timeout_s=group_timeout_s,
            metadata=metadata,
            wire_device=wire_device,
            bucket_bytes=bucket_bytes,
        )
        joined = await self._call(INIT_WEIGHT_GROUP, args, timeout_s)
        return [j.rank for j in joined]

    async def receive_weights(self, timeout_s: float) -> list[int]:
        """Every worker receives one broadcast and loads it; the policy version each loaded."""
        loaded = await self._call(RECEIVE_WEIGHTS, ReceiveWeights(), timeout_s)
        return [v.version for v in loaded]

    async def close_weight_group(self, timeout_s: float | None = None) -> None:
        """Every worker leaves the weight group (a no-op where not joined)."""
        await self._call(CLOSE_WEIGHT_GROUP, CloseWeightGroup(), timeout_s)

    async def _call(self, method: WorkerMethod, args: Any, timeout_s: float | None) -> list[Any]:
        results = await self.client.collective_rpc(
            method.name, method.encode(args), timeout_s=timeout_s
        )
        try:
            return method.replies(results)
        except WorkerMethodFailed as exc:  # as a failed call was before: the same handling
            raise InferenceError(f"{self.client.base_url}: {exc}", 500) from None
