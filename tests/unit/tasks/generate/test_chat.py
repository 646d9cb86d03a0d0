"""Chat prompts: an env's messages through the model's chat template (with the generation
prompt), the run's system prompt, and raw-text prompts unchanged."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from rollflow.infra.config import PromptSection
from rollflow.infra.errors import InputError
from rollflow.infra.models.tiny import build_char_tokenizer
from rollflow.infra.models.tiny_chat import build_bpe_tokenizer
from rollflow.infra.vllm_fleet.client import Completion
from rollflow.tasks.generate.chat import PromptRenderer
from rollflow.tasks.generate.environments import Prompt, RolloutContext, SingleTurnEnv

QUESTION = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_bpe_tokenizer("qwen3").save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)  # as a run loads it: from the saved folder


def _text(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def test_messages_render_with_the_generation_prompt(qwen_tok):
    render = PromptRenderer(qwen_tok, PromptSection())
    ids = render(Prompt("e", "0", "What is 2+3?", "5", messages=tuple(QUESTION)))
    assert (
        _text(qwen_tok, ids) == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    # The template's special tokens are single ids, not their characters spelt out.
    assert ids[0] == qwen_tok.convert_tokens_to_ids("<|im_start|>")


def test_system_prompt_from_config_unless_the_env_gives_one(qwen_tok):
    render = PromptRenderer(qwen_tok, PromptSection(system="Be brief."))
    ids = render(Prompt("e", "0", "q", "5", messages=tuple(QUESTION)))
    assert _text(qwen_tok, ids).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user"
    )
    own = ({"role": "system", "content": "Think."}, *QUESTION)
    text = _text(qwen_tok, render(Prompt("e", "0", "q", "5", messages=own)))
    assert "Think." in text and "Be brief." not in text


def test_raw_text_goes_as_it_is_only_when_asked(qwen_tok):
    prompt = Prompt("e", "0", "12+30=", "42")
    raw = PromptRenderer(qwen_tok, PromptSection(chat_template="messages"))(prompt)
    assert raw == qwen_tok("12+30=").input_ids
    wrapped = PromptRenderer(qwen_tok, PromptSection(chat_template="always"))(prompt)
    assert _text(qwen_tok, wrapped) == "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n"


def test_tools_are_listed_by_the_template(qwen_tok):
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ids = PromptRenderer(qwen_tok, PromptSection())(
        Prompt("e", "0", "q", "", messages=tuple(QUESTION), tools=(tool,))
    )
    assert '"name": "add"' in _text(qwen_tok, ids)


def test_bad_combinations_say_what_to_do(qwen_tok):
    with pytest.raises(InputError, match="chat_template = 'never'"):
        PromptRenderer(qwen_tok, PromptSection(chat_template="never"))(
            Prompt("e", "7", "q", "", messages=tuple(QUESTION))
        )
    char_tok = build_char_tokenizer()  # no chat template
    with pytest.raises(InputError, match="no chat template"):
        PromptRenderer(char_tok, PromptSection(system="hi"), "tiny-model")
    with pytest.raises(InputError, match="no chat template"):
        PromptRenderer(char_tok, PromptSection())(
            Prompt("e", "0", "q", "", messages=tuple(QUESTION))
        )
    # Raw text with a model that has no template keeps working.
    assert (
        PromptRenderer(char_tok, PromptSection())(Prompt("e", "0", "ab", ""))
        == char_tok("ab").input_ids
    )


class _Echo(SingleTurnEnv):
    name = "echo"

    def prompts(self, split, count, rng):
        return []

    def reward(self, prompt, completion):
        return float(completion == "5")


def test_a_single_turn_env_samples_from_the_rendered_prompt(qwen_tok):
    seen = []
    five = qwen_tok("5", add_special_tokens=False).input_ids
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")

    async def sample(prompt_ids, n=1):
        seen.append(prompt_ids)
        return [Completion(five + [im_end], [-0.1] * (len(five) + 1), "stop")] * n

    render = PromptRenderer(qwen_tok, PromptSection(system="Be brief."))
    ctx = RolloutContext(
        sample=sample,
        encode=render.encode_text,
        decode=lambda ids: qwen_tok.decode(ids, skip_special_tokens=True),
        eos_token_id=None,
        render=render,
        stop_token_ids=(im_end,),
    )
    prompt = Prompt("echo", "0", "What is 2+3?", "5", messages=tuple(QUESTION))
    samples = asyncio.run(_Echo().rollout_group(prompt, 2, ctx))
    assert seen == [render(prompt)] and samples[0].prompt_ids == render(prompt)
    assert [s.reward for s in samples] == [1.0, 1.0] and samples[0].completion_text == "5"
