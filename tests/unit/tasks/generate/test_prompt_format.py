"""Chat templates by default (raw text only when asked, a mismatch warned once in one line),
chat-message datasets through the template, and ``[prompt] max_prompt_length`` drops, counted."""

from __future__ import annotations

import json
import logging
import random

import pytest
from transformers import AutoTokenizer

from rollflow.infra.config import PromptSection, load_config, validate_config
from rollflow.infra.models.tiny import build_char_tokenizer
from rollflow.infra.models.tiny_chat import build_bpe_tokenizer
from rollflow.tasks.generate import chat
from rollflow.tasks.generate.chat import PromptRenderer
from rollflow.tasks.generate.dataset_envs import DatasetEnv
from rollflow.tasks.generate.environments import Prompt
from rollflow.tasks.generate.generate_task import build_envs

CHAT_LOG = "rollflow.tasks.generate.chat"
HEADER = "<|im_start|>user\n"


@pytest.fixture(scope="module")
def instruct_path(tmp_path_factory):
    """A tiny instruct tokenizer built here: a BPE vocabulary with Qwen's chat_template set."""
    path = tmp_path_factory.mktemp("instruct")
    build_bpe_tokenizer("qwen3").save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def fresh_warnings():
    chat._warned.clear()
    yield
    chat._warned.clear()


def text_of(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def test_an_instruct_tokenizer_gets_its_template_by_default(instruct_path):
    tok = AutoTokenizer.from_pretrained(instruct_path)
    assert PromptSection().chat_template == "auto"
    ids = PromptRenderer(tok, PromptSection(), instruct_path)(Prompt("e", "0", "12+30=", "42"))
    assert text_of(tok, ids) == f"{HEADER}12+30=<|im_end|>\n<|im_start|>assistant\n"


def test_the_quickstart_char_model_keeps_raw_text(caplog):
    """The quickstart's tokenizer has no template: 'auto' leaves its prompts as they were."""
    tok = build_char_tokenizer()
    assert not tok.chat_template
    cfg = load_config("configs/quickstart.toml")
    with caplog.at_level(logging.WARNING, logger=CHAT_LOG):
        ids = PromptRenderer(tok, cfg.prompt, "tiny")(Prompt("e", "0", "sort dcab=", ""))
    assert ids == tok("sort dcab=").input_ids and not caplog.records


def test_raw_text_to_a_template_tokenizer_is_warned_once_in_one_line(instruct_path, caplog):
    tok = AutoTokenizer.from_pretrained(instruct_path)
    with caplog.at_level(logging.WARNING, logger=CHAT_LOG):
        for _ in range(2):  # two renderers (a run makes one per rollout context), many prompts
            render = PromptRenderer(tok, PromptSection(chat_template="messages"), instruct_path)
            for i in range(3):
                assert render(Prompt("e", str(i), "1+1=", "2")) == tok("1+1=").input_ids
    [record] = caplog.records
    message = record.getMessage()
    assert "\n" not in message and "has a chat template" in message
    assert "chat_template = 'messages'" in message and "set 'auto'" in message


def test_a_chat_model_without_a_template_is_warned_once(tmp_path, caplog):
    tok = build_char_tokenizer()
    path = str(tmp_path / "Qwen2.5-0.5B-Instruct")
    with caplog.at_level(logging.WARNING, logger=CHAT_LOG):
        for _ in range(2):
            PromptRenderer(tok, PromptSection(), path)(Prompt("e", "0", "ab", ""))
        PromptRenderer(tok, PromptSection(), str(tmp_path / "tiny-base"))  # not a chat name
    [record] = caplog.records
    assert "named as a chat model" in record.getMessage() and "\n" not in record.getMessage()


def chat_rows(n):
    return [
        {"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}], "answer": str(2 * i)}
        for i in range(n)
    ]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_messages_dataset_env_renders_through_the_template(tmp_path, instruct_path):
    env = DatasetEnv(
        write_jsonl(tmp_path / "chat.jsonl", chat_rows(30)),
        prompt_template="{prompt} Answer with a number.",
        eval_fraction=0.2,
    )
    train = env.prompts("train", 30, random.Random(0))
    held = env.prompts("eval", 30, random.Random(0))
    assert train and held and {p.prompt_id for p in train}.isdisjoint({p.prompt_id for p in held})
    p = train[0]
    assert p.messages[-1]["content"] == p.text and p.text.endswith("? Answer with a number.")
    tok = AutoTokenizer.from_pretrained(instruct_path)
    rendered = text_of(tok, PromptRenderer(tok, PromptSection(), instruct_path)(p))
    assert rendered == f"{HEADER}{p.text}<|im_end|>\n<|im_start|>assistant\n"


def run_config(tmp_path, data, **prompt):
    return validate_config(
        {
            "run": {"storage": str(tmp_path / "runs")},
            "model": {"path": "unused"},
            "envs": [{"name": "dataset", "args": {"path": data, "eval_fraction": 0.3}}],
            "prompt": prompt,
        }
    )


def test_max_prompt_length_drops_longer_prompts_and_counts_them(tmp_path, instruct_path, caplog):
    tok = AutoTokenizer.from_pretrained(instruct_path)
    rows = chat_rows(20) + [
        {"prompt": [{"role": "user", "content": "why? " * (50 + i)}], "answer": "x"}
        for i in range(6)
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows + [{"prompt": ""}])  # and one malformed row
    render = PromptRenderer(tok, PromptSection(), instruct_path)
    lengths = sorted(
        len(render(Prompt("e", "0", "", "", messages=tuple(r["prompt"])))) for r in rows
    )
    limit = lengths[19]  # every short question fits, no long one does
    assert lengths[20] > limit
    cfg = run_config(tmp_path, data, max_prompt_length=limit)
    assert build_envs(cfg)["dataset"].num_skipped_rows == 1  # no model: no tokenizer, no limit
    with caplog.at_level(logging.WARNING, logger="rollflow.tasks.generate.dataset_envs"):
        env = build_envs(cfg, instruct_path)["dataset"]
    assert env.num_long_prompts == 6 and env.num_skipped_rows == 7  # the malformed row too
    kept = env.prompts("train", 100, random.Random(0)) + env.prompts("eval", 100, random.Random(0))
    assert {p.answer for p in kept} == {str(2 * i) for i in range(20)}
    assert all(len(render(p)) <= limit for p in kept)  # dropped, never truncated
    assert (
        f"dropped 6 of 26 prompts longer than [prompt] max_prompt_length = {limit}" in caplog.text
    )
    with pytest.raises(ValueError, match="every training prompt is longer than"):
        build_envs(run_config(tmp_path, data, max_prompt_length=1), instruct_path)
