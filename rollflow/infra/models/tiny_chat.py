"""Tiny random chat models of real architectures, built locally (nothing is downloaded).

Users bring instruct models (Llama, Qwen) with byte-level BPE tokenizers and chat templates.
This module builds small stand-ins with the features that matter to an RL framework, so that
tests run each through vLLM, the trainer and a weight sync:

- ``llama``: Llama with grouped-query attention (4 query heads, 2 key/value heads), untied
  LM head, the Llama 3 chat format (``<|start_header_id|>role<|end_header_id|>``, ``<|eot_id|>``);
  tool calls are a JSON object ``{"name": ..., "parameters": ...}`` as the assistant's message.
- ``qwen2``: Qwen2 with grouped-query attention, tied embeddings and q/k/v biases, ChatML
  (``<|im_start|>role``, ``<|im_end|>``); tool calls are Hermes style,
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, tool results come back as
  ``<tool_response>`` in a user turn.
- ``qwen3``: Qwen3 (q/k RMS norm on each head, no biases), ChatML as Qwen2.

The tokenizer is a byte-level BPE trained here on a small synthetic corpus (every byte is in its
alphabet, so any text encodes); it adds no BOS by itself: the chat template writes what the
format needs. Head size 32: vLLM's CPU attention supports 32, 64 and 128 only.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

Arch = Literal["llama", "qwen2", "qwen3"]
ARCHS: tuple[Arch, ...] = ("llama", "qwen2", "qwen3")

CHATML_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
LLAMA_SPECIAL = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)

# ChatML as Qwen2.5 / Qwen3 write it, reduced to what rollflow uses: an optional system message,
# tools listed in the system turn, Hermes tool calls, tool results as <tool_response> user turns.
CHATML_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    'Call a function as <tool_call>{"name": <name>, "arguments": <args-json-object>}</tool_call>'
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif not (loop.first and message.role == 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    '<tool_call>{"name": {{ call.function.name | tojson }}, '
    '"arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The Llama 3.1 format, reduced the same way; tool results are `ipython` turns.
LLAMA3_TEMPLATE = (
    "<|begin_of_text|>"
    "{% if tools or messages[0].role == 'system' %}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    "{% if tools %}"
    "{% if messages[0].role == 'system' %}{{ '\\n\\n' }}{% endif %}"
    "You may call a function by answering with a JSON object only: "
    '{"name": <name>, "parameters": <args-json-object>}. Functions:'
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "{% endif %}"
    "<|eot_id|>"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (loop.first and message.role == 'system') %}"
    "<|start_header_id|>{{ 'ipython' if message.role == 'tool' else message.role }}"
    "<|end_header_id|>\n\n"
    "{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    '{"name": {{ call.function.name | tojson }}, '
    '"parameters": {{ call.function.arguments | tojson }}}'
    "{% endfor %}"
    "<|eot_id|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def chat_format(arch: Arch) -> dict:
    """Special tokens, EOS tokens and the chat template of ``arch``'s format."""
    if arch == "llama":
        return {
            "special": LLAMA_SPECIAL,
            "added": (),
            "eos": ("<|eot_id|>", "<|end_of_text|>"),
            "pad": "<|end_of_text|>",
            "bos": "<|begin_of_text|>",
            "template": LLAMA3_TEMPLATE,
        }
    if arch in ("qwen2", "qwen3"):
        return {
            "special": CHATML_SPECIAL,
            "added": CHATML_ADDED,
            "eos": ("<|im_end|>", "<|endoftext|>"),
            "pad": "<|endoftext|>",
            "bos": None,
            "template": CHATML_TEMPLATE,
        }
    raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")


def synthetic_corpus(num_lines: int = 3000, seed: int = 0) -> list[str]:
    """Text like what the tests and built-in environments send: words, numbers, JSON, code."""
    rng = random.Random(seed)
    words = (
        "the a an of to and in is it you that he was for on are as with his they at be this "
        "from have or by one had not but what all were when we there can your which their said "
        "if do will each about how up out them then she many some so these would other into "
        "has more her two like him see time could no make than first been its who now people "
        "my made over did down only way find use may water long little very after words called "
        "just where most know get through back much before go good new write our used me man "
        "too any day same right look think also around another came come work three word must "
        "because does part even place well such here take why things help put years different "
        "away again off went old number great tell men say small every found still between name "
        "should home big give air line set own under read last never us left end along while "
        "answer question sum add sort letters reverse count tool call result error function "
        "arguments parameters name value true false null user assistant system guess higher "
        "lower correct wrong number game turn done"
    ).split()
    lines = []
    for _ in range(num_lines):
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) + ".")
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"{a}+{b}={a + b}, {a}*{b} = {a * b}; {rng.random():.3f}")
        elif kind == 2:
            args = {rng.choice(words): rng.randint(-50, 500) for _ in range(rng.randint(1, 3))}
            lines.append(json.dumps({"name": rng.choice(words), "arguments": args}))
        else:
            name = rng.choice(words)
            lines.append(f"def {name}(x, y):\n    return x + y  # {rng.choice(words)}")
    return lines


def build_bpe_tokenizer(
    arch: Arch, vocab_size: int = 512, seed: int = 0
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``synthetic_corpus``, with ``arch``'s chat format."""
    fmt = chat_format(arch)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(fmt["special"]),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(synthetic_corpus(seed=seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=fmt["eos"][0],
        pad_token=fmt["pad"],
        bos_token=fmt["bos"],
        additional_special_tokens=[t for t in fmt["special"] if t not in fmt["eos"]],
    )
    if fmt["added"]:
        tokenizer.add_tokens(list(fmt["added"]))  # whole tokens, decoded as text
    tokenizer.chat_template = fmt["template"]
    return tokenizer


def build_tiny_chat_model(
    arch: Arch,
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> PreTrainedModel:
    """A randomly initialised ``arch`` model in float32 over ``tokenizer``'s vocabulary."""
    torch.manual_seed(seed)
    fmt = chat_format(arch)
    ids = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.convert_tokens_to_ids(fmt["pad"]),
        "eos_token_id": [tokenizer.convert_tokens_to_ids(t) for t in fmt["eos"]],
        "bos_token_id": tokenizer.convert_tokens_to_ids(fmt["bos"]) if fmt["bos"] else None,
    }
    shape = {
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
    }
    if arch == "llama":
        config = LlamaConfig(**ids, **shape, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    elif arch == "qwen2":
        config = Qwen2Config(**ids, **shape, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(config)
    elif arch == "qwen3":
        head_dim = hidden_size // num_heads
        config = Qwen3Config(**ids, **shape, head_dim=head_dim, tie_word_embeddings=False)
        model = Qwen3ForCausalLM(config)
    else:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    # A wider spread of logits than HF's 0.02 init, so that top-p cuts tokens and temperature
    # changes the distribution measurably (a near-uniform model would hide both).
    # Tied (Qwen2): the head is the input embedding, whose own token then dominates the logits,
    # so its spread stays smaller.
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(
            0.0, 0.06 if config.tie_word_embeddings else 0.2
        )
    return model.float()


def save_tiny_chat_model(arch: Arch, path: str | Path, *, seed: int = 0, **shape) -> Path:
    """Build tokenizer + model of ``arch`` and save them as a HF directory vLLM can serve."""
    tokenizer = build_bpe_tokenizer(arch)
    model = build_tiny_chat_model(arch, tokenizer, seed=seed, **shape)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # vLLM stops on every id of generation_config.json's eos_token_id.
    gen = {
        "eos_token_id": model.config.eos_token_id,
        "pad_token_id": model.config.pad_token_id,
    }
    if model.config.bos_token_id is not None:
        gen["bos_token_id"] = model.config.bos_token_id
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return path
