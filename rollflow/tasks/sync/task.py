"""The sync stage: trainer weights → vLLM as policy version N, while requests stay queued.

Order: pause generation (in-flight requests kept) → the trainer broadcasts and vLLM receives,
concurrently → reset the prefix cache → resume. Resume runs even when the broadcast fails.
"""

from __future__ import annotations

import asyncio

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.infra.context import RunContext
from rollflow.infra.events import publish
from rollflow.infra.http import acall
from rollflow.infra.inference.client import InferenceClient
from rollflow.infra.inference.sync import sync_weights


@task(name="sync", cache_policy=NO_CACHE, persist_result=False)
def sync(ctx: RunContext, version: int) -> dict:
    """Publish the trainer's current weights to the inference deployment as ``version``."""
    timeout_s = ctx.config.trainer.weight_sync_timeout_s

    async def run() -> dict:
        client = InferenceClient(ctx.inference.url, timeout_s=timeout_s)
        async with httpx.AsyncClient() as http:
            try:
                send = lambda: acall(http, ctx.trainer, "/weights/broadcast", {"version": version},  # noqa: E731
                                     timeout_s=timeout_s)
                return await sync_weights(client, send, version, timeout_s)
            finally:
                await client.aclose()

    result = asyncio.run(run())
    publish(ctx.storage, "weights_published", version=version)
    return result
