"""RolloutProducer: staleness admission, FIFO emission, exactly once, timeouts, the explicit end."""

import asyncio
import itertools
import math
import random
import time

import pytest

from rollflow.infra.errors import InferenceGone, ProducerFailed, TrainingFinished
from rollflow.tasks.generate.environments import AddEnv, Prompt, Sample
from rollflow.tasks.generate.producer import (
    RolloutProducer,
    groups_to_over_request,
    prompt_stream,
)
from rollflow.tasks.generate.rollouts import group_runner, select_prompts


def numbered_prompts():
    """An endless, deterministic prompt source whose ids are the admission order."""
    return (Prompt("fake", str(i), f"q{i}", "a") for i in itertools.count())


class FakeGroups:
    """A ``run_group`` with seeded random durations that records every start and finish."""

    def __init__(self, seed: int, fail_every: int = 0, max_s: float = 0.004):
        self.rng, self.fail_every, self.max_s = random.Random(seed), fail_every, max_s
        self.started: list[tuple[str, int]] = []
        self.finished: list[str] = []
        self.producer: RolloutProducer | None = None

    async def __call__(self, prompt: Prompt, version_started: int):
        p = self.producer
        if p is not None:  # the accounting invariant, checked at this await point too
            assert_accounting(p)
        self.started.append((prompt.prompt_id, version_started))
        await asyncio.sleep(self.rng.random() * self.max_s)
        self.finished.append(prompt.prompt_id)
        if self.fail_every and int(prompt.prompt_id) % self.fail_every == 0:
            return "rollout: RuntimeError: injected"
        return [Sample([1], [2], [-0.1], "x", "stop", reward=1.0)]


def assert_accounting(p: RolloutProducer) -> None:
    s = p.snapshot()
    assert s["num_admitted"] == (
        s["num_in_flight"]
        + s["num_ready"]
        + s["num_emitted"]
        + s["num_cancelled"]
        + s["num_stale_dropped"]
        + s["num_resampled"]
    ), s
    assert s["num_admitted"] <= s["admission_bound"], s


async def watch_accounting(p: RolloutProducer) -> None:
    while True:
        assert_accounting(p)
        await asyncio.sleep(0)


async def train_loop(p: RolloutProducer, num_steps: int, seed: int, *, overlap: bool = False):
    """Take each step, 'train' for a random while, then sync; with ``overlap`` the next step's
    take is already waiting while this step trains, as overlapping step flows do."""
    rng = random.Random(seed)
    batches: dict[int, list] = {}
    nxt = asyncio.create_task(p.take(1, timeout_s=5))
    for step in range(1, num_steps + 1):
        batches[step] = await nxt
        if step < num_steps:
            if overlap:
                nxt = asyncio.create_task(p.take(step + 1, timeout_s=5))
            await asyncio.sleep(rng.random() * 0.003)
            p.set_version(step)
            if not overlap:
                nxt = asyncio.create_task(p.take(step + 1, timeout_s=5))
    return batches


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("overlap", [False, True])
def test_admission_bound_fifo_and_exactly_once(max_staleness, overlap):
    B, num_steps = 6, 15

    async def main():
        fake = FakeGroups(seed=100 + max_staleness, fail_every=7)
        p = RolloutProducer(
            fake,
            numbered_prompts(),
            train_batch_size=B,
            max_staleness=max_staleness,
            max_in_flight=B * (max_staleness + 1),
        )
        fake.producer = p
        async with p:
            watcher = asyncio.create_task(watch_accounting(p))
            batches = await train_loop(p, num_steps, seed=max_staleness, overlap=overlap)
            watcher.cancel()
            with pytest.raises(asyncio.CancelledError):  # an assertion in it would surface here
                await watcher
            assert_accounting(p)
            finished_before_end = list(fake.finished)
        return p, fake, batches, finished_before_end

    p, fake, batches, finished = asyncio.run(main())
    emitted = [g for step in sorted(batches) for g in batches[step]]
    assert all(len(batches[s]) == B for s in batches)
    # Exactly once: no duplicate, and every admitted group is emitted, ready or cancelled.
    ids = [g.prompt.prompt_id for g in emitted]
    assert len(ids) == len(set(ids)) == num_steps * B
    assert p.num_admitted == p.num_emitted + len(p._ready) + p.num_cancelled + p.num_stale_dropped
    # First finished, first out: the emission order is the finish order less the stale drops.
    position = {pid: i for i, pid in enumerate(finished)}
    assert [position[i] for i in ids] == sorted(position[i] for i in ids)
    assert len(ids) + p.num_stale_dropped >= len(finished[: position[ids[-1]] + 1])
    started = dict(fake.started)
    for step, groups in batches.items():
        for g in groups:
            assert started[g.prompt.prompt_id] == g.version_started
            assert g.index == int(g.prompt.prompt_id)
            # The admission bound, checked for every group at the version it was admitted with.
            assert g.index + 1 <= (max_staleness + g.version_started + 1) * B + p.num_stale_dropped
            assert g.version_finished >= g.version_started
            assert step - 1 - g.version_started <= max_staleness  # the staleness bound, strictly
    if max_staleness == 0:  # synchronous RL: step N's groups all started from version N - 1
        for step, groups in batches.items():
            assert {g.version_started for g in groups} == {step - 1}
    failed = [g for g in emitted if g.error]
    assert failed and all(int(g.prompt.prompt_id) % 7 == 0 for g in failed)
    assert p.num_failed >= len(failed)
    m = p.step_metrics(num_steps)
    assert 0 <= m["staleness_mean"] <= m["staleness_max"]


def test_staleness_zero_waits_for_the_sync():
    async def main():
        p = RolloutProducer(
            FakeGroups(seed=1),
            numbered_prompts(),
            train_batch_size=4,
            max_staleness=0,
            max_in_flight=4,
        )
        async with p:
            await p.take(1, timeout_s=2)
            await asyncio.sleep(0.05)
            s = p.snapshot()
            assert s["num_admitted"] == 4 and s["num_in_flight"] == 0
            assert s["blocked_by_bound_s"] >= 0.03
            with pytest.raises(TimeoutError) as err:
                await p.take(2, timeout_s=0.05)
            assert "blocked by the staleness bound" in str(err.value)
            p.set_version(1)
            groups = await p.take(2, timeout_s=2)
            assert {g.version_started for g in groups} == {1}
            assert p.num_admitted == 8

    asyncio.run(main())


def test_take_timeout_names_what_it_waited_for():
    async def hang(prompt, version):
        await asyncio.Event().wait()

    async def main():
        p = RolloutProducer(
            hang, numbered_prompts(), train_batch_size=4, max_staleness=1, max_in_flight=6
        )
        async with p:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError) as err:
                await p.take(3, timeout_s=0.1)
            assert time.monotonic() - t0 < 1
        return str(err.value)

    msg = asyncio.run(main())
    for part in [
        "take(step=3)",
        "0.1s",
        "0/4 groups ready",
        "6 in flight",
        "version 0",
        "admitted 6 of bound 8",
    ]:
        assert part in msg, msg


def test_finish_ends_every_waiter_and_leaves_no_tasks():
    async def hang(prompt, version):
        await asyncio.Event().wait()

    async def main():
        p = RolloutProducer(
            hang, numbered_prompts(), train_batch_size=4, max_staleness=1, max_in_flight=8
        )
        p.start()
        waiters = [asyncio.create_task(p.take(s, timeout_s=30)) for s in (1, 2)]
        deadline = time.monotonic() + 10  # admitted soon; a loaded machine takes longer than 20 ms
        while p.snapshot()["num_in_flight"] < 8 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert p.snapshot()["num_in_flight"] == 8
        t0 = time.monotonic()
        await p.finish()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert time.monotonic() - t0 < 5  # at once, not at the waiters' 30 s timeout
        assert all(isinstance(r, TrainingFinished) for r in results)
        with pytest.raises(TrainingFinished):
            await p.take(3, timeout_s=30)
        assert asyncio.all_tasks() == {asyncio.current_task()}
        s = p.snapshot()
        assert s["num_in_flight"] == 0 and s["num_cancelled"] == s["num_admitted"] == 8

    asyncio.run(main())


def test_finish_before_a_task_starts_still_counts_it():
    async def main():
        p = RolloutProducer(
            FakeGroups(seed=2),
            numbered_prompts(),
            train_batch_size=2,
            max_staleness=0,
            max_in_flight=2,
        )
        p.start()
        await asyncio.sleep(0)  # the admission loop has created tasks that have not run yet
        await p.finish()
        assert_accounting(p)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())


def test_a_raise_from_run_group_fails_takes_with_the_cause():
    async def dead(prompt, version):
        raise InferenceGone("vLLM unreachable for 20s")

    async def main():
        async with RolloutProducer(
            dead, numbered_prompts(), train_batch_size=2, max_staleness=0, max_in_flight=2
        ) as p:
            with pytest.raises(ProducerFailed, match="InferenceGone") as err:
                await p.take(1, timeout_s=5)
            assert isinstance(err.value.__cause__, InferenceGone)

    asyncio.run(main())


def test_steps_are_served_lowest_first_and_a_retake_returns_the_same_groups():
    async def main():
        fake = FakeGroups(seed=3)
        async with RolloutProducer(
            fake, numbered_prompts(), train_batch_size=3, max_staleness=1, max_in_flight=6
        ) as p:
            later = asyncio.create_task(p.take(2, timeout_s=5))
            await asyncio.sleep(0)
            first = await p.take(1, timeout_s=5)
            second = await later
            assert [g.prompt.prompt_id for g in first + second] == fake.finished[:6]
            assert await p.take(1, timeout_s=5) is first
            assert p.num_emitted == 6

    asyncio.run(main())


def test_event_loop_lag_is_sampled():
    async def main():
        async with RolloutProducer(
            FakeGroups(seed=4),
            numbered_prompts(),
            train_batch_size=1,
            max_staleness=0,
            max_in_flight=1,
            lag_interval_s=0.02,
        ) as p:
            await asyncio.sleep(0.05)
            time.sleep(0.15)  # block the loop, as CPU work on it would
            await asyncio.sleep(0.05)
            s = p.snapshot()
            assert s["loop_lag_max_s"] >= 0.1
            assert s["loop_lag_p50_s"] <= s["loop_lag_p99_s"] <= s["loop_lag_max_s"]

    asyncio.run(main())


def test_prompt_stream_follows_the_per_step_seed():
    envs, weights = {"add": AddEnv()}, {"add": 1.0}
    stream = prompt_stream(envs, weights, 4, seed=7, first_step=3)
    got = [next(stream) for _ in range(8)]
    want = [
        *select_prompts(envs, weights, 4, "train", seed=7 * 1_000_003 + 3),
        *select_prompts(envs, weights, 4, "train", seed=7 * 1_000_003 + 4),
    ]
    assert got == want


def test_group_runner_turns_errors_into_strings_but_not_inference_death():
    class Env:
        def __init__(self, exc):
            self.exc = exc

        async def rollout_group(self, prompt, group_size, ctx):
            raise self.exc

    prompt = Prompt("e", "0", "q", "a")
    ok = group_runner({"e": Env(ValueError("bad"))}, ctx=None, group_size=2)
    assert asyncio.run(ok(prompt, 0)) == "rollout: ValueError: bad"
    dead = group_runner({"e": Env(InferenceGone("gone"))}, ctx=None, group_size=2)
    with pytest.raises(InferenceGone):
        asyncio.run(dead(prompt, 0))


def test_a_group_overtaken_past_the_bound_is_dropped_counted_and_replaced():
    """S = 1: a slow group admitted for step 1 that finishes only after step 2 was served is too
    old for step 3 (version 0 < 3 - 1 - 1); it is dropped, counted, and its slot refilled."""
    slow = asyncio.Event

    async def main():
        release = slow()
        fast = FakeGroups(seed=3)

        async def run_group(prompt, version):
            if prompt.prompt_id == "0":
                await release.wait()
                return [Sample([1], [2], [-0.1], "x", "stop", reward=0.0)]
            return await fast(prompt, version)

        p = RolloutProducer(
            run_group, numbered_prompts(), train_batch_size=2, max_staleness=1, max_in_flight=4
        )
        async with p:
            one = await p.take(1, timeout_s=2)
            p.set_version(1)
            two = await p.take(2, timeout_s=2)
            release.set()
            await asyncio.sleep(0.01)  # group 0 finishes: version 0, fine for step 2, not step 3
            p.set_version(2)
            three = await p.take(3, timeout_s=2)
            assert_accounting(p)
            return p, one + two + three, three

    p, emitted, three = asyncio.run(main())
    assert "0" not in [g.prompt.prompt_id for g in emitted]
    assert p.num_stale_dropped == 1 and p.step_metrics(3)["stale_dropped_total"] == 1
    assert all(3 - 1 - g.version_started <= 1 for g in three)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_dynamic_sampling_replaces_groups_without_signal_within_the_bound(max_staleness):
    """Every third group is all-correct (no signal under GRPO): it is dropped before any step
    takes it and a new group is sampled in its place, counted per step, the staleness bound and
    the accounting holding throughout; a step's batch holds only groups with signal."""
    from rollflow.tasks.advantage.advantages import grpo_advantages
    from rollflow.tasks.generate.rollouts import group_has_signal

    B, steps = 4, 5
    finished_flat = 0

    async def run_group(prompt, version):
        nonlocal finished_flat
        await asyncio.sleep(random.random() * 0.002)
        flat = int(prompt.prompt_id) % 3 == 0
        finished_flat += flat  # judged as it returns, with no await between
        rewards = [1.0, 1.0] if flat else [1.0, 0.0]
        return [Sample([1], [2], [-0.1], "x", "stop", reward=r) for r in rewards]

    async def main():
        p = RolloutProducer(
            run_group,
            numbered_prompts(),
            train_batch_size=B,
            max_staleness=max_staleness,
            max_in_flight=B * (max_staleness + 1),
            has_signal=group_has_signal(grpo_advantages),
            max_resampled=B,
        )
        async with p:
            watcher = asyncio.create_task(watch_accounting(p))
            batches = await train_loop(p, steps, seed=1)
            watcher.cancel()
            assert_accounting(p)
            # Every group without signal that finished was replaced; how many finished before the
            # last take depends on the groups' random order (at S = 1 up to K are still out).
            assert p.num_resampled == finished_flat >= B
            return p, batches

    p, batches = asyncio.run(main())
    for step, groups in batches.items():
        assert len(groups) == B
        assert all(int(g.prompt.prompt_id) % 3 for g in groups), "a flat group was trained on"
        assert all(step - 1 - g.version_started <= max_staleness for g in groups)
    per_step = [p.step_metrics(s)["resampled"] for s in range(1, steps + 1)]
    assert sum(per_step) == p.step_metrics(steps)["resampled_total"] <= p.num_resampled


def test_dynamic_sampling_is_bounded():
    """With every group flat, at most max_resampled groups per step are replaced; past that the
    flat groups are kept (the advantage stage then filters them) and steps still fill."""

    async def run_group(prompt, version):
        await asyncio.sleep(0)
        return [Sample([1], [2], [-0.1], "x", "stop", reward=1.0) for _ in range(2)]

    async def main():
        from rollflow.tasks.advantage.advantages import grpo_advantages
        from rollflow.tasks.generate.rollouts import group_has_signal

        p = RolloutProducer(
            run_group,
            numbered_prompts(),
            train_batch_size=2,
            max_staleness=0,
            max_in_flight=2,
            has_signal=group_has_signal(grpo_advantages),
            max_resampled=3,
        )
        async with p:
            batches = await train_loop(p, 3, seed=2)
            return p, batches

    p, batches = asyncio.run(main())
    assert all(len(g) == 2 for g in batches.values())
    assert p.num_resampled <= 3 * 3  # (steps taken + 1) x max_resampled at the last take
    assert p.step_metrics(1)["resampled"] == 3


def test_a_fractional_bound_admits_the_next_step_from_the_mid_step_weights_only():
    """max_staleness = 1/4 with 4 optimizer steps per step: step N + 1's groups wait for the
    weights sent one optimizer step before step N's end (version N - 1/4), start from exactly
    those, and nothing starts from a version older than that allows."""
    B, num_steps = 4, 6

    async def main():
        fake = FakeGroups(seed=3)
        p = RolloutProducer(
            fake, numbered_prompts(), train_batch_size=B, max_staleness=0.25, max_in_flight=B
        )
        fake.producer = p
        admitted_before_sync = []
        async with p:
            batches = {1: await p.take(1, timeout_s=5)}  # version 0 serves step 1
            for step in range(1, num_steps):
                # Step `step` trains; nothing of step + 1 may start before its mid-step sync.
                await asyncio.sleep(0.01)
                admitted_before_sync.append(p.num_admitted - step * B)
                p.set_version(step - 0.25)
                batches[step + 1] = await p.take(step + 1, timeout_s=5)
                with pytest.raises(TimeoutError, match="blocked by the staleness bound"):
                    await p.take(step + 2, timeout_s=0.05)  # its groups wait for the next sync
        return p, batches, admitted_before_sync

    p, batches, admitted_before_sync = asyncio.run(main())
    assert admitted_before_sync == [0] * (num_steps - 1)
    assert {g.version_started for g in batches[1]} == {0}
    for step in range(2, num_steps + 1):
        assert {g.version_started for g in batches[step]} == {step - 1.25}
        assert p.step_metrics(step)["staleness_max"] == pytest.approx(0.25)
    assert p.num_stale_dropped == 0


def test_a_take_checks_each_finished_group_against_the_bound_once(monkeypatch):
    """The take wakes on every finished group; it checked every ready group each time (O(B²)
    staleness checks a step: 8,866 for B = 200 here), now only those that arrived since."""
    from rollflow.infra import staleness

    B, checks = 200, []
    real = staleness.allowed
    monkeypatch.setattr(staleness, "allowed", lambda *a: checks.append(a) or real(*a), raising=True)

    async def one_at_a_time(prompt: Prompt, version: int):
        await asyncio.sleep(int(prompt.prompt_id) * 0.0005)  # group i finishes i-th, alone
        return [Sample([1], [2], [-0.1], "x", "stop", reward=1.0)]

    async def main():
        p = RolloutProducer(
            one_at_a_time, numbered_prompts(), train_batch_size=B, max_staleness=0, max_in_flight=B
        )
        async with p:
            groups = await p.take(1, timeout_s=10)
            assert_accounting(p)
            return groups

    groups = asyncio.run(main())
    assert [g.prompt.prompt_id for g in groups] == [str(i) for i in range(B)]
    assert B <= len(checks) <= 2 * B, len(checks)


def two_env_prompts(drawn: list[str]):
    """Prompts of env "ok" and env "bad", alternating; ``drawn`` records each one handed out."""
    for i in itertools.count():
        env = ("ok", "bad")[i % 2]
        drawn.append(env)
        yield Prompt(env, f"{env}:{i}", f"q{i}", "a")


def test_a_failing_env_is_quarantined_probed_and_admitted_again_once_it_recovers():
    from rollflow.tasks.generate.quarantine import EnvQuarantine

    B, broken, drawn, started, now = 4, {"bad": True}, [], [], [0.0]

    async def run_group(prompt: Prompt, version: int):
        started.append(prompt.env)
        await asyncio.sleep(0.001)
        if broken.get(prompt.env):
            return "rollout: ConnectionError: the env's tool server is down"
        return [Sample([1], [2], [-0.1], "x", "stop", reward=1.0)]

    async def main():
        # The quarantine's clock moves 0.1 s a step: a probe is due every other step.
        q = EnvQuarantine(
            after=3, probe_every_s=0.2, clock=lambda: now[0], envs=frozenset({"ok", "bad"})
        )
        p = RolloutProducer(
            run_group,
            two_env_prompts(drawn),
            train_batch_size=B,
            max_staleness=0,
            max_in_flight=B,
            quarantine=q,
        )
        steps = {}

        async def step(n: int) -> None:
            steps[n] = await p.take(n, timeout_s=5)
            p.set_version(n)
            now[0] += 0.1

        async with p:
            for n in range(1, 11):  # "bad" is down
                await step(n)
            down = {**p.step_metrics(10), "probes": q.num_probes, "bad": started.count("bad")}
            broken["bad"] = False  # the tool server is back: the next probe succeeds
            for n in range(11, 20):
                await step(n)
                if p.step_metrics(n)["envs_quarantined"] == 0:
                    break
            recovered_at = n
            for n in range(recovered_at + 1, recovered_at + 4):
                await step(n)
            assert_accounting(p)
            return p, steps, down, recovered_at

    p, steps, down, recovered_at = asyncio.run(main())
    # While down: 3 failed groups quarantined it (up to B more were in flight by then); then only
    # a probe every 0.2 s started.
    assert down["envs_quarantined"] == 1 and down["env_quarantined/bad"] == 1
    assert down["env_quarantined/ok"] == 0 and down["quarantines_total"] == 1
    assert down["quarantine_set_aside_total"] > 0 and down["quarantine_probes_total"] >= 2
    assert down["bad"] <= 3 + B + down["probes"], down
    # Steps 3-10 are healthy groups but for the probes: batches do not fill with errors.
    failed = sum(g.error is not None for n in range(3, 11) for g in steps[n])
    assert failed <= down["probes"], failed
    # Recovered within two probe intervals; "bad" is admitted again and its groups train.
    assert recovered_at <= 14
    after = [g for n in range(recovered_at + 1, recovered_at + 4) for g in steps[n]]
    assert any(g.prompt.env == "bad" and g.error is None for g in after)
    assert p.step_metrics(recovered_at)["env_quarantined/bad"] == 0


def test_every_env_quarantined_fails_the_take_naming_the_env_and_its_last_error():
    from rollflow.tasks.generate.quarantine import EnvQuarantine

    drawn = []

    def one_env():
        for i in itertools.count():
            drawn.append(i)
            yield Prompt("calc", f"calc:{i}", f"q{i}", "a")

    async def run_group(prompt: Prompt, version: int):
        await asyncio.sleep(0.001)
        return "rollout: RuntimeError: reward function raised"

    async def main():
        q = EnvQuarantine(
            after=2,
            probe_every_s=0.1,
            clock=time.monotonic,
            envs=frozenset({"calc"}),
            give_up_s=0.5,
        )
        p = RolloutProducer(
            run_group, one_env(), train_batch_size=4, max_staleness=0, max_in_flight=4, quarantine=q
        )
        async with p:
            start = time.monotonic()
            with pytest.raises(ProducerFailed) as err:
                for step in range(1, 100):  # step 1 gets the 4 failed groups that quarantined it
                    await p.take(step, timeout_s=10)
                    p.set_version(step)
            return time.monotonic() - start, str(err.value)

    waited_s, message = asyncio.run(main())
    assert "every environment has failed" in message
    assert "calc: " in message and "reward function raised" in message
    assert "sampling.env_quarantine_give_up_s" in message
    assert waited_s < 5
    # While waiting for probes it set prompts aside in bounded batches, not in a busy loop.
    assert len(drawn) < 200, len(drawn)


class HalfFlat:
    """A ``run_group`` whose groups all take ``duration_s``; those of even admission index have no
    signal (every sample right) while ``flat`` says so. Records, per start, the version and how
    many groups had finished then: starts of one version at one count are one round."""

    def __init__(self, duration_s: float = 0.01):
        self.duration_s, self.num_finished = duration_s, 0
        self.starts: list[tuple[int, float, int]] = []  # (index, version, finished so far)
        self.flat = lambda index: index % 2 == 0

    async def __call__(self, prompt: Prompt, version: float):
        index = int(prompt.prompt_id)
        self.starts.append((index, version, self.num_finished))
        await asyncio.sleep(self.duration_s)
        self.num_finished += 1
        rewards = [1.0, 1.0] if self.flat(index) else [1.0, 0.0]
        return [Sample([1], [2], [-0.1], "x", "stop", reward=r) for r in rewards]

    def rounds(self, version: float) -> int:
        """Rounds of the step that trains on ``version + 1`` at S = 0: 1 = no serial round."""
        return len({n for _, v, n in self.starts if v == version})


# The over-request's quantile at which these tests' exact half without signal asks B more groups
# (B = 4: 4 more hold 4 with signal with probability 0.64, 3 more with 0.5): each step's first
# wave is then just enough, and the tests read the mechanism, not the count.
EXACT_HALF_QUANTILE = 0.6


def dynamic_producer(
    run_group, B: int, max_staleness: float, over_request_steps: int, max_resampled: int = 0
):
    from rollflow.tasks.advantage.advantages import grpo_advantages
    from rollflow.tasks.generate.rollouts import group_has_signal

    assert groups_to_over_request(B, 0.5, EXACT_HALF_QUANTILE, 2 * B) == B
    return RolloutProducer(
        run_group,
        numbered_prompts(),
        train_batch_size=B,
        max_staleness=max_staleness,
        max_in_flight=B * (int(max_staleness) + 1),
        has_signal=group_has_signal(grpo_advantages),
        max_resampled=max_resampled or B,
        over_request_steps=over_request_steps,
        over_request_quantile=EXACT_HALF_QUANTILE,
    )


def chance_of_enough(needed: int, extra: int, p_flat: float) -> float:
    """P(at least ``needed`` of ``needed + extra`` groups have signal), summed over the binomial."""
    n = needed + extra
    return sum(
        math.comb(n, k) * (1 - p_flat) ** k * p_flat ** (n - k) for k in range(needed, n + 1)
    )


@pytest.mark.parametrize(
    "B, p_flat, quantile", [(32, 0.3, 0.9), (32, 0.3, 0.5), (4, 0.5, 0.9), (64, 0.05, 0.99)]
)
def test_the_over_request_is_the_least_count_that_holds_the_batch_at_the_quantile(
    B, p_flat, quantile
):
    """The first wave's extra groups: the least e for which B + e groups hold B with signal with
    the quantile's probability (checked by the binomial sum); the mean count B·p/(1-p) falls short
    in about half the steps, so 0.9 asks more than it and 0.5 about as many."""
    e = groups_to_over_request(B, p_flat, quantile, cap=10 * B)
    assert chance_of_enough(B, e, p_flat) >= quantile > chance_of_enough(B, e - 1, p_flat)
    mean = B * p_flat / (1 - p_flat)
    if quantile > 0.5:
        assert e > mean
    else:
        assert abs(e - mean) <= 1
    assert groups_to_over_request(B, p_flat, quantile, cap=e - 1) == e - 1  # the cap binds
    assert groups_to_over_request(B, 0.0, quantile, cap=B) == 0  # every group has signal


@pytest.mark.parametrize("over_request_steps", [0, 2])
def test_over_request_admits_the_replacements_in_the_steps_first_wave(over_request_steps):
    """Half the groups have no signal. Without over-request every step replaces them in serial
    rounds (4 groups, then the 2 flat ones' replacements, then 1, ...); with it, once step 1 has
    shown the share, each step's first wave admits B·p/(1-p) = B more and fills the step in one
    round, and the progress line's numbers say so."""
    B, steps = 4, 5

    async def main():
        fake = HalfFlat()
        p = dynamic_producer(fake, B, 0, over_request_steps)
        async with p:
            watcher = asyncio.create_task(watch_accounting(p))
            batches = await train_loop(p, steps, seed=3)
            watcher.cancel()
            assert_accounting(p)
            return p, fake, batches

    p, fake, batches = asyncio.run(main())
    for step, groups in batches.items():
        assert len(groups) == B and not any(int(g.prompt.prompt_id) % 2 == 0 for g in groups)
        assert {g.version_started for g in groups} == {step - 1}
    rounds = [fake.rounds(step - 1) for step in range(1, steps + 1)]
    over = [p.step_metrics(s)["over_requested"] for s in range(1, steps + 1)]
    if over_request_steps:
        assert rounds[0] > 1 and rounds[1:] == [1] * (steps - 1)
        assert over == [0] + [B] * (steps - 1)
        assert [p.step_metrics(s)["resampled"] for s in range(2, steps + 1)] == [B] * (steps - 1)
    else:
        assert all(r >= 3 for r in rounds) and over == [0] * steps
    assert p.num_stale_dropped == 0  # the over-request was just enough: no surplus


def test_over_request_short_of_the_share_falls_back_to_serial_replacement():
    """The share without signal jumps from 1/2 to 2/3 after step 1: the first wave's over-request
    (learned from step 1) is short, and the step still fills by replacing serially."""
    B, steps = 4, 4

    async def main():
        fake = HalfFlat()
        fake.flat = lambda i: i % 2 == 0 if i < 8 else i % 3 != 0
        p = dynamic_producer(fake, B, 0, over_request_steps=1, max_resampled=3 * B)
        async with p:
            batches = await train_loop(p, steps, seed=4)
            assert_accounting(p)
            return p, fake, batches

    p, fake, batches = asyncio.run(main())
    assert all(len(g) == B for g in batches.values())
    assert not any(fake.flat(int(g.prompt.prompt_id)) for gs in batches.values() for g in gs)
    assert p.step_metrics(2)["over_requested"] == B
    assert fake.rounds(1) > 1  # step 2: 2B admitted, 3 of them with signal: a serial round


def test_over_request_surplus_is_dropped_at_s0_and_kept_for_the_next_step_at_s1():
    """The share without signal falls from 1/2 to 0 after step 1: step 2's over-requested groups
    have signal and are surplus. At S = 0 no later step may take them: dropped (ready) or
    cancelled (in flight) when step 2 takes its groups, counted as stale, and step 3 starts from a
    fresh wave. At S = 1 the ready groups a step leaves that the next may take are its first."""

    async def run(max_staleness: float, flat):
        fake = HalfFlat(duration_s=0.005)
        fake.flat = flat
        p = dynamic_producer(fake, 4, max_staleness, over_request_steps=1)
        left: dict[int, list] = {}
        batches: dict[int, list] = {}
        async with p:
            watcher = asyncio.create_task(watch_accounting(p))
            for step in range(1, 6):
                # Every admitted group finished before the step takes (none left in flight: the
                # surplus is ready), so what the take leaves does not hang on the cores' speed.
                for _ in range(5000):
                    if not p._tasks:
                        break
                    await asyncio.sleep(0.001)
                batches[step] = await p.take(step, timeout_s=5)
                left[step] = list(p._ready)
                await asyncio.sleep(0.002)
                p.set_version(step)
            watcher.cancel()
            assert_accounting(p)
        return p, batches, left

    p, batches, _ = asyncio.run(run(0, lambda i: i % 2 == 0 if i < 8 else False))
    assert p.step_metrics(2)["over_requested"] == 4
    assert p.num_stale_dropped == 4  # the surplus of step 2's wave of 8
    assert all({g.version_started for g in batches[s]} == {s - 1} for s in batches)
    p, batches, left = asyncio.run(run(1, lambda i: i % 2 == 0 if i < 12 else i % 5 == 0))
    assert p.num_over_requested > 0 and any(left.values())
    for step in range(1, 5):
        kept = [g.index for g in left[step] if g.version_started >= step - 1]  # allowed at step + 1
        assert [g.index for g in batches[step + 1]][: len(kept)] == kept[:4]
    assert all(s - 1 - g.version_started <= 1 for s in batches for g in batches[s])
