"""The weight sync's orchestration against a real vLLM server: the group forms (or fails within
its deadline), an in-flight sync makes vLLM serve exactly the sent weights, and after a sync with
requests kept in flight no request reads KV that the old weights computed.

The trainer's side is a ``WeightSource`` over an in-process ``WeightSender``: the same wire and
the same orchestration (``join``, ``publish``) as the trainer service, which the run tests use.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollflow.infra.errors import WeightSyncError
from rollflow.infra.processes import free_port
from rollflow.infra.vllm_fleet import keys
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.infra.vllm_fleet.keys import auth_headers
from rollflow.tasks.sync.weights import GroupSpec, init_weight_group, join, leave, publish

from conftest import PROMPT_IDS, VLLM_BLOCK, VLLM_MAX_LEN, SenderSource, greedy_reference

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


# Two prompts that share one whole KV block (vLLM caches whole blocks), with different tails.
SHARED = [1] + [4 + (7 * i) % 10 for i in range(VLLM_BLOCK - 1)]
FIRST = SHARED + [4 + (3 * i) % 10 for i in range(8)]
SECOND = SHARED + [4 + (5 * i + 1) % 10 for i in range(8)]


def logprobs_of(model, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    """transformers' log-probs of ``token_ids`` after ``prompt_ids`` (T = 1, teacher-forced)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [logprobs[len(prompt_ids) + i - 1, t].item() for i, t in enumerate(token_ids)]


def test_after_a_sync_with_requests_in_flight_no_request_reads_kv_of_the_old_weights(
    vllm_server, vllm_model_dirs
):
    """pause(keep) keeps requests in flight, each holding KV blocks, and vLLM refuses to reset its
    prefix cache while a block is held. A refusal taken for a reset left the old weights' KV of
    FIRST's prefix in the cache, and SECOND, sampled on the new weights, read it: log-probs that
    no policy gives. After the sync SECOND's log-probs are the new weights' own, and the requests
    kept across the sync still complete."""
    url = vllm_server.url
    new_model = AutoModelForCausalLM.from_pretrained(vllm_model_dirs[1]).eval()
    old_weights = list(
        AutoModelForCausalLM.from_pretrained(vllm_model_dirs[0]).state_dict().items()
    )
    source = SenderSource(list(new_model.state_dict().items()), secret=keys.key_for(url))
    # Enough streams that they are still generating when the pause lands.
    body = {
        "model": "policy",
        "prompt": PROMPT_IDS,
        "max_tokens": VLLM_MAX_LEN - len(PROMPT_IDS),
        "min_tokens": VLLM_MAX_LEN - len(PROMPT_IDS),
        "temperature": 1.0,
        "n": 16,
        "stream": True,
    }
    streams: list[list[str]] = [[] for _ in range(8)]
    done_at: list[float] = []
    started = asyncio.Event()

    async def consume(http: httpx.AsyncClient, lines: list[str]) -> None:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line:
                    lines.append(line)
                    started.set()
        done_at.append(time.monotonic())

    async def go():
        async with (
            InferenceClient(url, timeout_s=60) as client,
            httpx.AsyncClient(base_url=url, timeout=60, headers=auth_headers(url)) as http,
        ):
            # The old weights' KV of SHARED, cached once FIRST is done.
            await client.complete(FIRST, max_tokens=1, temperature=0.0)
            tasks = [asyncio.create_task(consume(http, lines)) for lines in streams]
            await asyncio.wait_for(started.wait(), 30)
            sync_started = time.monotonic()
            stats = await asyncio.to_thread(publish, source, [url], 1, 30)
            # The server was paused from sync_started + pause_s (a few ms later: the thread's
            # start) until after the broadcast: a stream that ended after this was kept across
            # the pause. (Not "after publish returned": kept streams near their end finished in
            # the ms between the resume and the return, and a CI run failed so.)
            synced_at = sync_started + stats["pause_s"] + stats["broadcast_s"]
            (after,) = await client.complete(SECOND, max_tokens=8, temperature=1.0, seed=0)
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return stats, synced_at, after

    join(source, [(url, 1)], GroupSpec.single(), timeout_s=30)
    try:
        stats, synced_at, after = asyncio.run(go())
        # Back to the served weights for the tests after this one.
        source.weights, source.version = old_weights, 2
        publish(source, [url], None, timeout_s=30)
    finally:
        leave(source, [url], timeout_s=10)
    assert max(done_at) > synced_at, "every stream ended before the sync: none was kept"
    assert stats["cache_reset_tries"] == 1
    expected = logprobs_of(new_model, SECOND, after.token_ids)
    assert after.logprobs == pytest.approx(expected, abs=1e-3)
    for lines in streams:  # kept, preempted, recomputed on the new weights: none lost
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
        assert {c["finish_reason"] for e in events for c in e["choices"]} - {None} == {"length"}
