"""The weight sync's orchestration against a real vLLM server: the group forms (or fails within
its deadline), and an in-flight sync makes vLLM serve exactly the sent weights.

The trainer's side is a ``WeightSource`` over an in-process ``WeightSender``: the same wire and
the same orchestration (``join``, ``publish``) as the trainer service, which the run tests use.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from transformers import AutoModelForCausalLM

from rollflow.infra.errors import WeightSyncError
from rollflow.infra.processes import free_port
from rollflow.infra.vllm_fleet import keys
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.tasks.sync.weights import GroupSpec, init_weight_group, join, leave, publish

from conftest import PROMPT_IDS, SenderSource, greedy_reference

pytestmark = pytest.mark.slow


def greedy(url: str) -> list[int]:
    async def go():
        async with InferenceClient(url, timeout_s=60) as client:
            return (await client.complete(PROMPT_IDS, max_tokens=24, temperature=0.0))[0].token_ids

    return asyncio.run(go())


def test_absent_trainer_makes_init_fail_within_timeout(vllm_server):
    async def go():
        async with InferenceClient(vllm_server.url, timeout_s=60) as client:
            start = time.monotonic()

            async def trainer_never_joins():
                return None

            with pytest.raises(WeightSyncError, match="could not join"):
                await init_weight_group(
                    [(client, 1)], trainer_never_joins, GroupSpec.single(), free_port(), 3.0, []
                )
            assert time.monotonic() - start < 15
            # The server survives, and the same client (whose pooled connection the server closed
            # after the failed RPC) still samples.
            assert await client.complete(PROMPT_IDS, max_tokens=2, temperature=0.0)
            assert await client.health()

    asyncio.run(go())


def test_in_flight_sync_makes_vllm_match_transformers_on_new_weights(vllm_server, vllm_model_dirs):
    new_model, expected = greedy_reference(vllm_model_dirs[1], PROMPT_IDS, 24)
    old_weights = list(
        AutoModelForCausalLM.from_pretrained(vllm_model_dirs[0]).state_dict().items()
    )
    source = SenderSource(
        list(new_model.state_dict().items()), secret=keys.key_for(vllm_server.url)
    )
    url = vllm_server.url
    before = greedy(url)
    # Buckets of 64 KiB: a sync of this model spans many, as a large model's does.
    join(source, [(url, 1)], GroupSpec.single(bucket_bytes=64 << 10), timeout_s=30)
    try:
        stats = publish(source, [url], 1, timeout_s=30)
        after = greedy(url)
        # Back to the served weights, tagged by the trainer (version None), so that later tests
        # see the original policy.
        source.weights, source.version = old_weights, 2
        restored = publish(source, [url], None, timeout_s=30)
        assert restored["version"] == 2
    finally:
        leave(source, [url], timeout_s=10)
    print(f"\nweight sync: {json.dumps(stats)}")
    assert after == expected[: len(after)] and len(after) == len(expected)
    assert before != after
    assert greedy(url) == before
    assert stats["bytes"] >= sum(t.numel() * 4 for _, t in source.weights)
