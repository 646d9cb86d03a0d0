"""Aborted and disconnected requests are retried with backoff and counted; no rollout is lost.

Faults are injected by a fake OpenAI server (``rollflow.testing.fake_openai``), per prompt and
attempt, so every expected retry is known: the real client, sampler, environment and producer
run against it. (The real vLLM path, including an abort by a real pause, is in tests/infra.)
"""

import asyncio
import random

from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.tasks.generate.environments import Prompt, RolloutContext, SingleTurnEnv
from rollflow.tasks.generate.producer import RolloutProducer
from rollflow.tasks.generate.rollouts import RetryPolicy, Sampler, SamplingStats, group_runner
from rollflow.testing.fake_openai import FakeOpenAI

B, S, G, STEPS = 6, 0, 4, 6  # S = 0: every admitted group is taken, none dropped as stale


class NumberedEnv(SingleTurnEnv):
    """Prompt i is the single token i + 10; every completion scores 1."""

    name = "numbered"

    def prompts(self, split, count, rng):
        raise NotImplementedError

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0


def kind(prompt_ids) -> str:
    return ("abort", "disconnect", "ok")[prompt_ids[0] % 3]


def faults(prompt_ids, attempt):
    """Every third prompt is aborted once; every third loses its connection twice in a row (the
    client's one immediate resend meets the second), so the sampler must back off and retry."""
    if kind(prompt_ids) == "abort" and attempt == 0:
        return "abort"
    if kind(prompt_ids) == "disconnect" and attempt < 2:
        return "disconnect"
    return "ok"


def test_aborts_and_disconnects_are_retried_counted_and_nothing_is_lost():
    stats = SamplingStats()
    env = NumberedEnv()
    prompts = (Prompt(env.name, str(i), f"q{i}", "") for i in range(10_000))

    async def main(url: str):
        client = InferenceClient(url, timeout_s=10)
        sampler = Sampler(
            client,
            max_tokens=4,
            temperature=1.0,
            top_p=1.0,
            stats=stats,
            deadline_s=30,
            retry=RetryPolicy(initial_s=0.005, max_s=0.02),
        )
        ctx = RolloutContext(
            sample=sampler,
            encode=lambda text: [int(text[1:]) + 10],
            decode=lambda ids: "x" * len(ids),
            eos_token_id=2,
        )
        producer = RolloutProducer(
            group_runner({env.name: env}, ctx, G),
            prompts,
            train_batch_size=B,
            max_staleness=S,
            max_in_flight=B * (S + 1),
        )
        taken = []
        async with producer:
            # No sync after the last step: every admitted group is taken, none is left in flight.
            for step in range(1, STEPS + 1):
                taken += await producer.take(step, timeout_s=20)
                if step < STEPS:
                    await asyncio.sleep(random.random() * 0.01)
                    producer.set_version(step)
            assert producer.snapshot()["num_in_flight"] == 0
        await client.aclose()
        return taken

    with FakeOpenAI(latency_s=0.002, faults=faults) as server:
        taken = asyncio.run(main(server.url))
    assert len(taken) == STEPS * B
    assert len({g.prompt.prompt_id for g in taken}) == len(taken)
    for g in taken:
        assert g.error is None and len(g.result) == G
        assert all(
            s.error is None and s.reward == 1.0 and s.finish_reason == "stop" for s in g.result
        )
        ids = [int(g.prompt.prompt_id) + 10]
        assert server.attempts[tuple(ids)] == {"abort": 2, "disconnect": 3, "ok": 1}[kind(ids)]
    kinds = [kind([int(g.prompt.prompt_id) + 10]) for g in taken]
    assert kinds.count("abort") > 0 and kinds.count("disconnect") > 0
    assert stats.retry_reasons == {
        "RequestAborted": kinds.count("abort"),
        "InferenceUnavailable": kinds.count("disconnect"),
    }
    assert stats.retries == kinds.count("abort") + kinds.count("disconnect")
    assert server.injected == {
        "abort": kinds.count("abort"),
        "disconnect": 2 * kinds.count("disconnect"),
    }
