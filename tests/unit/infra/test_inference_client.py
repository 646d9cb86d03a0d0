"""The run's client of vLLM reads every answer of the prefix-cache reset: a refusal
(``{"success": false}``, what vLLM answers while KV blocks are held) is tried again, and one that
lasts to the deadline raises ``PrefixCacheNotReset``; it is never taken for a reset. The server is
the fake OpenAI server; the real vLLM's reset is in tests/integration/tasks/sync/test_weights.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rollflow.infra.errors import InferenceError, PrefixCacheNotReset
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.testing.fake_openai import FakeOpenAI


def reset(server: FakeOpenAI, deadline_s: float = 5.0) -> int:
    async def go() -> int:
        async with InferenceClient(server.url) as client:
            return await client.reset_prefix_cache(deadline_s=deadline_s)

    return asyncio.run(go())


def test_the_reset_preempts_requests_in_flight_and_a_refusal_is_tried_again():
    with FakeOpenAI(resets=lambda attempt: attempt >= 2) as server:
        assert reset(server) == 3
    # Every try asks vLLM to preempt the running requests: it refuses a reset while they hold
    # KV blocks, and pause(keep) keeps them in flight.
    assert server.reset_queries == ["reset_running_requests=true"] * 3


def test_a_reset_refused_to_the_deadline_raises_naming_the_server():
    with FakeOpenAI(resets=lambda attempt: False) as server:
        start = time.monotonic()
        with pytest.raises(PrefixCacheNotReset, match=server.url) as err:
            reset(server, deadline_s=0.5)
    assert time.monotonic() - start < 3
    assert len(server.reset_queries) > 1
    assert "refused to reset its prefix cache" in str(err.value)


def test_an_answer_that_does_not_say_whether_the_cache_was_reset_is_an_error():
    with FakeOpenAI(resets=lambda attempt: None) as server:
        with pytest.raises(InferenceError, match="not its success"):
            reset(server)
