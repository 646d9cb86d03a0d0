"""Multi-turn episodes against a scripted model: one token sequence of model and environment
turns, the mask token by token, turn boundaries and versions, stop reasons, tool calls (good
and malformed)."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from rollflow.infra.config import PromptSection
from rollflow.infra.models.tiny_chat import build_bpe_tokenizer
from rollflow.infra.schema import ROLLOUT_SCHEMA, rows_to_table
from rollflow.infra.vllm_fleet.client import Completion
from rollflow.tasks.generate.chat import PromptRenderer
from rollflow.tasks.generate.environments import Prompt, RolloutContext
from rollflow.tasks.generate.rollouts import to_rows
from rollflow.tasks.generate.tool_env import (
    GuessNumberEnv,
    Tool,
    ToolEnv,
    add,
    parse_tool_calls,
)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tok(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_bpe_tokenizer(request.param).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def _stop_id(tok):
    return tok.convert_tokens_to_ids(tok.eos_token)


class Scripted:
    """A model that says the next scripted text (then its stop token), and records every call."""

    def __init__(self, tok, replies, *, cut_at: int | None = None):
        self.tok, self.replies, self.cut_at = tok, list(replies), cut_at
        self.calls: list[tuple[list[int], int]] = []
        self.version = 0

    async def __call__(self, prompt_ids, n=1, max_tokens=64, **_):
        self.calls.append((list(prompt_ids), max_tokens))
        ids = self.tok(self.replies.pop(0), add_special_tokens=False).input_ids
        ids = ids + [_stop_id(self.tok)]
        reason = "stop"
        if len(ids) > max_tokens:
            ids, reason = ids[:max_tokens], "length"
        self.version += 1  # a weight sync lands after every request
        return [Completion(ids, [-0.5] * len(ids), reason)] * n


def _ctx(tok, model, max_tokens=64):
    render = PromptRenderer(tok, PromptSection())
    return RolloutContext(
        sample=model,
        encode=render.encode_text,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        eos_token_id=_stop_id(tok),
        render=render,
        renderer=render,
        policy_version=lambda: model.version,
        max_tokens=max_tokens,
    )


def _episode(env, prompt, tok, replies, **kw):
    model = Scripted(tok, replies)
    sample = asyncio.run(env.episode(prompt, _ctx(tok, model, **kw)))
    return sample, model


def _calc_prompt(env):
    import random

    return env.prompts("train", 1, random.Random(0))[0]


def test_tool_episode_is_one_sequence_with_env_tokens_masked(tok):
    env = ToolEnv()
    prompt = _calc_prompt(env)
    a, b, c = map(int, prompt.text[len("What is ") : -1].replace("*", "+").split("+"))
    call = (
        f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
        if "<tool_call>" in tok.chat_template
        else f'{{"name": "multiply", "parameters": {{"a": {a}, "b": {b}}}}}'
    )
    s, model = _episode(env, prompt, tok, [call, str(a * b + c)])
    assert s.reward == 1.0 and s.stop_reason == "env_done" and not s.truncated
    assert s.turn_roles == ["assistant", "tool", "assistant"]
    assert s.turn_versions == [0, 0, 1]  # the second model turn was requested after a sync
    # Every model call saw exactly the sequence so far: prompt + completion tokens before it.
    assert [ids for ids, _ in model.calls] == [
        s.prompt_ids,
        s.prompt_ids + s.completion_ids[: s.turn_offsets[2]],
    ]
    # Token by token: model turns are mask 1 with their log-probs, the env turn mask 0 / 0.0.
    bounds = [*s.turn_offsets, len(s.completion_ids)]
    for k, role in enumerate(s.turn_roles):
        span = range(bounds[k], bounds[k + 1])
        want = 1 if role == "assistant" else 0
        assert [s.completion_mask[i] for i in span] == [want] * len(span)
        assert [s.completion_logprobs[i] for i in span] == [-0.5 if want else 0.0] * len(span)
    env_text = tok.decode(s.completion_ids[bounds[1] : bounds[2]], skip_special_tokens=False)
    one = [{"role": "user", "content": "x"}]
    header = tok.apply_chat_template(one, add_generation_prompt=True, tokenize=False)[
        len(tok.apply_chat_template(one, add_generation_prompt=False, tokenize=False)) :
    ]
    # The env turn holds the tool's result and ends with the header the model answers after.
    assert str(a * b) in env_text and env_text.endswith(header) and header
    # The whole sequence is the chat template's rendering of the conversation.
    transcript = [
        *[dict(m) for m in prompt.messages],
        {"role": "assistant", "content": call},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b + c)},
    ]
    rendered = tok.apply_chat_template(
        transcript, tools=list(prompt.tools), add_generation_prompt=False, tokenize=False
    )
    full = tok.decode(s.prompt_ids + s.completion_ids, skip_special_tokens=False)
    assert rendered.startswith(full) and len(rendered) - len(full) <= 1  # ChatML's final "\n"


def test_malformed_calls_get_error_messages_not_a_crash(tok):
    env = ToolEnv(max_turns=5, max_total_tokens=2048)
    prompt = _calc_prompt(env)
    replies = [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": "x", "b": 2}}</tool_call>',
        "<tool_call>{",
        "7",
    ]
    s, _ = _episode(env, prompt, tok, replies)
    tool_messages = [m["content"] for m in json.loads(s.info["messages"]) if m["role"] == "tool"]
    assert [m.split(":")[0] for m in tool_messages] == ["error"] * 4
    assert "not valid JSON" in tool_messages[0] and "no tool 'divide'" in tool_messages[1]
    assert "bad arguments for add" in tool_messages[2] and "not closed" in tool_messages[3]
    assert s.stop_reason == "env_done" and s.reward == 0.0


def test_stop_conditions_are_recorded(tok):
    game = GuessNumberEnv(high=8, max_turns=3)
    prompt = Prompt("guess_number", "g", "Guess", "5", ({"role": "user", "content": "Guess"},))
    s, _ = _episode(game, prompt, tok, ["3", "7", "5"])
    assert s.stop_reason == "env_done" and s.reward == pytest.approx(1 / 3)
    assert s.turn_roles == ["assistant", "user", "assistant", "user", "assistant"]
    s, _ = _episode(game, prompt, tok, ["1", "2", "3"])
    assert (s.stop_reason, s.truncated, s.reward) == ("max_turns", True, 0.0)
    assert s.turn_roles[-1] == "assistant"  # no env turn after the last model turn
    # A model turn cut at max_tokens does not end the episode: the template closes the cut
    # message (an environment token, mask 0), and the game answers what it could read.
    s, _ = _episode(game, prompt, tok, ["1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8", "5"], max_tokens=4)
    assert (s.stop_reason, s.truncated, s.info["cut_turns"]) == ("env_done", False, 1)
    assert s.turn_offsets[1] == 4 and s.completion_mask[4] == 0
    assert s.completion_ids[4] == _stop_id(tok)  # the end-of-turn the model did not write
    tight = GuessNumberEnv(high=8, max_turns=5, max_total_tokens=6)
    s, _ = _episode(tight, prompt, tok, ["1", "2", "3", "4", "5"])
    assert s.stop_reason == "max_total_tokens" and s.truncated
    assert len(s.completion_ids) <= 6


def test_rows_carry_the_turn_columns_and_duckdb_reads_them(tok, tmp_path):
    import duckdb

    game = GuessNumberEnv(high=8, max_turns=3)
    prompt = Prompt("guess_number", "g", "Guess", "5", ({"role": "user", "content": "Guess"},))
    s, _ = _episode(game, prompt, tok, ["3", "5"])
    single = type(s)([1], [7, 8], [-1.0, -2.0], "x", "stop", reward=1.0)
    rows = to_rows("r", 1, [prompt, prompt], [[s], [single]], 1, [(0, 1), (2, 2)])
    table = rows_to_table(rows)
    assert table.schema == ROLLOUT_SCHEMA
    assert rows[1]["completion_mask"] == [1, 1] and rows[1]["turn_versions"] == [2]
    assert rows[1]["num_turns"] == 1 and rows[1]["stop_reason"] == "stop"
    import pyarrow.parquet as pq

    pq.write_table(table, tmp_path / "part-0.parquet")
    got = duckdb.sql(
        f"select num_turns, stop_reason, list_sum(completion_mask) as model_tokens, "
        f"len(completion_ids) - list_sum(completion_mask) as env_tokens "
        f"from '{tmp_path}/part-0.parquet' order by num_turns desc"
    ).fetchall()
    assert got[0][:2] == (2, "env_done") and got[0][3] > 0 and got[1] == (1, "stop", 2, 0)


def test_tool_schema_from_type_hints_and_call_parsing():
    tool = Tool.from_function(add)
    assert tool.parameters["required"] == ["a", "b"]
    assert tool.call({"a": 2, "b": 3}) == "5"
    assert tool.call({"a": 2}).startswith("error: bad arguments")
    assert parse_tool_calls("no call here") == []
    assert parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}') == [
        {"name": "add", "arguments": {"a": 1, "b": 2}}
    ]
    two = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {}}</tool_call> and '
        '<tool_call>{"name": "multiply", "arguments": {}}</tool_call>'
    )
    assert [c["name"] for c in two] == ["add", "multiply"]
