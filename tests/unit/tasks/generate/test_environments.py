import asyncio
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollflow.infra.vllm_fleet.pool import InferencePool
from rollflow.tasks.generate.environments import (
    AddEnv,
    ModAddEnv,
    Prompt,
    ReverseLettersEnv,
    RolloutContext,
    ShiftLettersEnv,
    SingleTurnEnv,
    SortLettersEnv,
    load_env,
)
from rollflow.tasks.generate.rollouts import select_prompts


@pytest.mark.parametrize(
    "env", [AddEnv(), SortLettersEnv(), ReverseLettersEnv(), ModAddEnv(), ShiftLettersEnv()]
)
def test_train_and_eval_splits_are_disjoint_and_rewards_exact(env):
    rng = random.Random(0)
    train = {p.text for p in env.prompts("train", 500, rng)}
    evals = env.prompts("eval", 200, rng)
    assert train.isdisjoint({p.text for p in evals})
    p = evals[0]
    assert env.reward(p, p.answer) == 1.0
    assert env.reward(p, p.answer + "x") == 0.0


def test_a_batch_that_draws_none_of_an_env_is_a_batch_of_the_others():
    """With two envs and 8 prompts, one env gets none in 1 of 128 batches; its prompts(0) used to
    raise "could not draw 0 train prompts" and stop the producer (found in a 300-step chaos run)."""
    from rollflow.tasks.generate.tool_env import ToolEnv

    for env in (AddEnv(), SortLettersEnv(), ToolEnv()):
        assert env.prompts("train", 0, random.Random(0)) == []
    envs = {"add": AddEnv(), "sort_letters": SortLettersEnv()}
    weights = {"add": 1.0, "sort_letters": 1.0}
    seed = next(
        s
        for s in range(10_000)
        if {p.env for p in select_prompts(envs, weights, 8, "train", s)} == {"add"}
    )
    assert len(select_prompts(envs, weights, 8, "train", seed)) == 8


def test_sort_letters_partial_credit_counts_right_positions_over_the_longer_string():
    env, p = SortLettersEnv(partial_credit=True), Prompt("sort_letters", "x", "sort dcab=", "abcd")
    assert env.reward(p, " abcd ") == 1.0
    assert env.reward(p, "abdd") == 0.75
    assert env.reward(p, "ab") == 0.5  # too short: the missing positions are wrong
    assert env.reward(p, "abcdabcd") == 0.5  # too long: the extra positions are wrong
    assert env.reward(p, "") == 0.0
    assert SortLettersEnv().reward(p, "abdd") == 0.0  # exact match by default


def test_reverse_shift_and_mod_add_answers():
    rng = random.Random(3)
    for p in ReverseLettersEnv(min_len=2, max_len=7).prompts("train", 50, rng):
        word = p.text.removeprefix("rev ").removesuffix("=")
        assert p.answer == word[::-1] and 2 <= len(word) <= 7
    for p in ModAddEnv(max_value=30, min_mod=4, max_mod=6).prompts("train", 50, rng):
        a, rest = p.text.removesuffix("=").split("+")
        b, m = rest.split(" mod ")
        assert p.answer == str((int(a) + int(b)) % int(m)) and 4 <= int(m) <= 6
    shift = ShiftLettersEnv(letters="abcd", max_shift=3)
    assert shift.prompts("train", 1, random.Random(0))[0].text.startswith("shift ")
    assert shift._draw(random.Random(5)) == ("shift 3 ccadb=", "bbdca")  # d + 3 wraps to c
    for p in shift.prompts("train", 50, rng):
        _, k, word = p.text.removesuffix("=").split(" ")
        assert p.answer == "".join("abcd"[("abcd".index(c) + int(k)) % 4] for c in word)
    with pytest.raises(ValueError, match="max_shift"):
        load_env("shift_letters", {"letters": "ab", "max_shift": 2})
    with pytest.raises(ValueError, match="min_mod"):
        load_env("mod_add", {"min_mod": 1})
    with pytest.raises(ValueError, match="min_len"):
        load_env("reverse_letters", {"min_len": 4, "max_len": 3})


def test_prompts_are_reproducible_from_the_seed():
    envs = {"add": AddEnv(), "sort_letters": SortLettersEnv()}
    a = select_prompts(envs, {"add": 1, "sort_letters": 3}, 64, "train", seed=7)
    b = select_prompts(envs, {"add": 1, "sort_letters": 3}, 64, "train", seed=7)
    assert a == b and len(a) == 64
    assert 0 < sum(p.env == "add" for p in a) < 32  # weights shape the mix


def test_load_env_errors_name_the_env():
    with pytest.raises(ValueError, match="unknown env 'nope'"):
        load_env("nope", {})
    with pytest.raises(ValueError, match="bad args"):
        load_env("add", {"max_valu": 3})
    with pytest.raises(ValueError, match="cannot import"):
        load_env("no.such.module:Env", {})
    by_path = load_env("rollflow.tasks.generate.environments:AddEnv", {"max_value": 9})
    assert isinstance(by_path, AddEnv)
    # Its prompts carry the configured name, which is how the run looks the env up again.
    prompt = by_path.prompts("train", 1, random.Random(0))[0]
    assert prompt.env == "rollflow.tasks.generate.environments:AddEnv"


class _Flaky(SingleTurnEnv):
    name = "flaky"

    def prompts(self, split, count, rng):
        return [Prompt("flaky", str(i), "q", "a") for i in range(count)]

    def reward(self, prompt, completion):
        if completion == "boom":
            raise ZeroDivisionError("user bug")
        return 1.0


def test_raising_reward_marks_only_that_sample():
    completions = [
        SimpleNamespace(token_ids=[10, 2], logprobs=[-0.1, -0.2], finish_reason="stop"),
        SimpleNamespace(token_ids=[11, 2], logprobs=[-0.3, -0.4], finish_reason="stop"),
    ]

    async def sample(prompt_ids, n):
        return completions[:n]

    ctx = RolloutContext(
        sample=sample,
        encode=lambda t: [1, 5],
        eos_token_id=2,
        decode=lambda ids: {10: "ok", 11: "boom"}[ids[0]],
    )
    samples = asyncio.run(_Flaky().rollout_group(Prompt("flaky", "0", "q", "a"), 2, ctx))
    assert samples[0].reward == 1.0 and samples[0].error is None
    assert math.isnan(samples[1].reward) and "ZeroDivisionError: user bug" in samples[1].error
    assert samples[0].completion_ids == [10, 2]  # the eos token is trained on


def test_rollout_context_encodes_exactly_like_the_tokenizer(tiny_model_dir):
    """The producer tokenises with the fast tokenizer's backend: the same ids as ``tok(text)``."""
    from transformers import AutoTokenizer

    from rollflow.infra.config import load_config
    from rollflow.tasks.generate.generate_task import make_rollout_context
    from rollflow.tasks.generate.rollouts import SamplingStats

    cfg = load_config(Path(__file__).parents[4] / "configs/quickstart.toml")
    unused = InferencePool.of(["http://127.0.0.1:9"])  # nothing is sampled
    ctx = make_rollout_context(cfg, str(tiny_model_dir), unused, SamplingStats(), temperature=1.0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for text in ["sort dcab=", "12+34=", "", "SORT é?"]:
        assert ctx.encode(text) == tok(text).input_ids
