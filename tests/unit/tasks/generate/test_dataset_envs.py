import asyncio
import json
import math
import random
import threading
import time
from types import SimpleNamespace

import pytest

from rollflow.tasks.generate import dataset_envs
from rollflow.tasks.generate.dataset_envs import DatasetEnv, MathEnv
from rollflow.tasks.generate.environments import Prompt, RolloutContext, load_env
from rollflow.tasks.generate.rollouts import select_prompts


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_math_env_ships_its_problems_and_every_reference_answer_checks():
    env = load_env("math", {})
    assert isinstance(env, MathEnv) and env.num_skipped_rows == 0
    train, held_out = (
        env.prompts("train", 1000, random.Random(0)),
        env.prompts("eval", 1000, random.Random(0)),
    )
    assert 30 <= len({p.text for p in train}) + len(held_out) <= 60
    assert {p.text for p in train}.isdisjoint({p.text for p in held_out}) and held_out
    assert all(p.text.endswith("Put the final answer in \\boxed{}.\n") for p in held_out)
    for p in held_out + train[:40]:
        assert env.reward(p, f"so the answer is \\boxed{{{p.answer}}}") == 1.0, p


@pytest.mark.parametrize(
    "answer, completion, expected",
    [
        ("\\frac{1}{2}", "0.5", 1.0),
        ("0.5", "The answer is \\boxed{\\frac{1}{2}}", 1.0),
        ("\\frac{1}{2}", "\\boxed{\\frac{2}{4}}", 1.0),
        ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", 1.0),
        ("x^2 + 2x + 1", "\\boxed{(x+1)^2}", 1.0),
        ("42", "I think it is \\boxed{42}.", 1.0),
        ("42", "\\boxed{43}", 0.0),
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
        ("5", "no idea", 0.0),
    ],
)
def test_math_reward_checks_equivalence(answer, completion, expected):
    env = MathEnv()
    assert env.reward(Prompt("math", "t", "q", answer), completion) == expected


def test_math_reward_refuses_huge_powers_quickly_off_the_main_thread():
    # Comparing 9^(9^(9^99)) with sympy does not finish; math-verify's SIGALRM timeout cannot fire
    # in the worker thread where rewards run, so the env must refuse it before comparing.
    env, out = MathEnv(), []
    worker = threading.Thread(
        target=lambda: out.append(
            env.reward(Prompt("math", "t", "q", "3"), "\\boxed{9^{9^{9^{99}}}}")
        )
    )
    start = time.monotonic()
    worker.start()
    worker.join(20)
    assert out == [0.0] and time.monotonic() - start < 5
    assert env.reward(Prompt("math", "t", "q", "256"), "\\boxed{2^{2^{3}}}") == 1.0


def test_a_raising_math_reward_marks_only_that_sample(monkeypatch):
    real_verify = dataset_envs.verify

    def verify(gold, predicted):
        if "7" in str(predicted):
            raise RuntimeError("sympy bug")
        return real_verify(gold, predicted)

    monkeypatch.setattr(dataset_envs, "verify", verify)
    texts = {1: "\\boxed{0.5}", 2: "\\boxed{7}", 3: "\\boxed{3}"}
    completions = [
        SimpleNamespace(token_ids=[i], logprobs=[-0.5], finish_reason="stop") for i in texts
    ]

    async def sample(prompt_ids, n):
        return completions[:n]

    ctx = RolloutContext(
        sample=sample, encode=lambda t: [0], decode=lambda ids: texts[ids[0]], eos_token_id=None
    )
    samples = asyncio.run(MathEnv().rollout_group(Prompt("math", "t", "q", "\\frac{1}{2}"), 3, ctx))
    assert [s.reward for s in samples[::2]] == [1.0, 0.0] and all(
        s.error is None for s in samples[::2]
    )
    assert math.isnan(samples[1].reward) and "RuntimeError: sympy bug" in samples[1].error


def test_an_unparseable_reference_answer_marks_the_sample():
    with pytest.raises(ValueError, match="cannot parse the reference answer"):
        MathEnv().reward(Prompt("math", "t", "q", "\\frac{"), "\\boxed{1}")


def test_dataset_env_exact_match_template_and_skipped_count(tmp_path):
    rows = [{"question": f"q{i}", "label": i} for i in range(40)] + [{"question": ""}, {"label": 1}]
    env = load_env(
        "dataset",
        {
            "path": jsonl(tmp_path / "d.jsonl", rows),
            "prompt_column": "question",
            "answer_column": "label",
            "prompt_template": "Q: {prompt}\nA:",
            "eval_fraction": 0.25,
        },
    )
    assert env.num_skipped_rows == 2
    train = env.prompts("train", 100, random.Random(1))
    num_train = len({p.prompt_id for p in train})
    assert len(train) == 100 and 20 < num_train < 40
    assert len({p.prompt_id for p in train[:num_train]}) == num_train  # no repeat within a pass
    held_out = env.prompts("eval", 100, random.Random(1))
    assert 0 < len(held_out) < 40 and {p.text for p in train}.isdisjoint({p.text for p in held_out})
    p = held_out[0]
    assert p.text.startswith("Q: q") and p.text.endswith("\nA:")
    assert env.reward(p, f" {p.answer}\n") == 1.0 and env.reward(p, p.answer + "0") == 0.0
    mixed = select_prompts({"dataset": env}, {"dataset": 1.0}, 8, "train", seed=3)
    assert mixed == select_prompts({"dataset": env}, {"dataset": 1.0}, 8, "train", seed=3)


def test_dataset_env_held_out_file_and_counts_of_both(tmp_path):
    train = jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": "a", "answer": "1"},
            {"prompt": "b", "answer": "2"},
            {"prompt": "shared", "answer": "3"},
            {"prompt": 5},
        ],
    )
    evals = jsonl(tmp_path / "eval.jsonl", [{"prompt": "shared", "answer": "3"}, "oops"])
    env = DatasetEnv(train, eval_path=evals)
    assert env.num_skipped_rows == 2
    assert [p.text for p in env.prompts("eval", 10, random.Random(0))] == ["shared"]
    assert env.prompts("eval", 1, random.Random(0))[0].prompt_id == "dataset:eval:0"
    assert sorted({p.text for p in env.prompts("train", 10, random.Random(0))}) == ["a", "b"]


def test_dataset_env_hf_splits(tmp_path):
    import datasets

    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(
                [{"problem": "1+1", "answer": "2"}, {"problem": "2+2", "answer": "4"}]
            ),
            "test": datasets.Dataset.from_list([{"problem": "3+3", "answer": "6"}]),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    env = MathEnv(str(tmp_path / "dd"), split="train", eval_split="test")
    assert [p.answer for p in env.prompts("eval", 5, random.Random(0))] == ["6"]
    with pytest.raises(ValueError, match="eval source is the training source"):
        MathEnv(str(tmp_path / "dd"), split="train", eval_split="train")


def test_dataset_env_errors_name_what_to_fix(tmp_path):
    one = jsonl(tmp_path / "one.jsonl", [{"prompt": "only", "answer": "1"}])
    with pytest.raises(ValueError, match="leaves .* training and .* held-out prompts; both need"):
        load_env("dataset", {"path": one})
    with pytest.raises(ValueError, match="eval_fraction must be in"):
        load_env("dataset", {"path": one, "eval_fraction": 0})
    with pytest.raises(ValueError, match="has no \\{prompt\\}"):
        load_env("dataset", {"path": one, "prompt_template": "Q:"})
    with pytest.raises(ValueError, match="no such file"):
        load_env("math", {"path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ValueError, match="bad args"):
        load_env("math", {"pth": "x"})


def test_generate_task_reports_the_skipped_rows(tmp_path):
    """The count reaches the generate task's result (here on its reuse path: no vLLM needed)."""
    from rollflow.infra.config import validate_config
    from rollflow.infra.context import RunContext
    from rollflow.infra.http import Endpoint
    from rollflow.infra.schema import rows_to_table
    from rollflow.tasks.generate.environments import RolloutContext, Sample
    from rollflow.tasks.generate.generate_task import build_envs, generate
    from rollflow.tasks.generate.host import ProducerHost
    from rollflow.tasks.generate.rollouts import to_rows

    data = jsonl(
        tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": "a"} for i in range(20)] + [{}, {}, {}]
    )
    cfg = validate_config(
        {
            "run": {"storage": str(tmp_path / "runs")},
            "model": {"path": "unused"},
            "envs": [{"name": "dataset", "args": {"path": data}}],
            "sampling": {"group_size": 2},
            # The host is built without the flow's estimator: no dynamic sampling.
            "train": {"train_batch_size": 2, "mini_batch_size": 2, "dynamic_sampling": False},
        }
    )
    nowhere = Endpoint("none", "http://127.0.0.1:9", "token")
    ctx = RunContext(config=cfg, model_path="unused", trainer=nowhere, inference=[nowhere])
    prompts = load_env("dataset", {"path": data}).prompts("train", 2, random.Random(0))
    samples = [
        [Sample([1], [2], [-0.1], "a", "stop", reward=1.0) for _ in range(2)] for _ in prompts
    ]
    ctx.storage.write_step_table(
        "rollouts", 1, rows_to_table(to_rows("quickstart", 1, prompts, samples, 2, [(0, 0)] * 2))
    )
    # Step 1 reuses its committed rollouts, so the producer admits nothing (the bound is 0).
    host = ProducerHost(
        cfg,
        build_envs(cfg),
        lambda client, stats: RolloutContext(None, str.split, " ".join, None),
        [nowhere.url],
        resumed_from=0,
        reused_steps=[1],
    )
    try:
        result = generate.fn(ctx, 1, host)
    finally:
        host.close()
    assert result.reused and result.num_skipped_rows == 3 and result.num_rollouts == 4
