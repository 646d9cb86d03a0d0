"""Tiny character-level Llama models, built locally (nothing is downloaded).

The quickstart and the tests need a causal LM that vLLM and transformers both load from a
Hugging Face directory. This module builds one: a character tokenizer (one token per
character, plus pad/bos/eos/unk) saved as ``tokenizer.json``, and a randomly initialised
``LlamaForCausalLM`` small enough to train in seconds on a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rollflow.infra.config import DEFAULT_ALPHABET, TinyModelSpec

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one token per character of ``alphabet`` (distinct characters: the
    config's ``TinyModelSpec`` checks them)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    # Prompts start with <bos>, as with most HF tokenizers: tokenizer(text).input_ids just works.
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def build_tiny_llama(spec: TinyModelSpec, vocab_size: int) -> LlamaForCausalLM:
    """A randomly initialised Llama of the given shape, in float32."""
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config).float()


def save_hf_dir(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: str | Path
) -> Path:
    """Save model + tokenizer as a Hugging Face directory that vLLM can serve."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # vLLM reads the stop token from generation_config.json.
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return path


# A chat format in the character alphabet (role names and ": ", each turn ended by <eos>), as
# base models' plain chat formats go ("User: ...\n\nAssistant:"): a tiny character model whose
# tokenizer has it reads chat-message prompts through its template, as an instruct model does.
CHAR_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def add_chat_template(model_dir: str | Path, template: str = CHAR_CHAT_TEMPLATE) -> Path:
    """Give the tokenizer saved in ``model_dir`` a chat template (saved with it)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(model_dir)
    return Path(model_dir)
