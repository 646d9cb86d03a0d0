"""Chat-formatted prompts: an environment's messages through the model's chat template.

An environment gives a prompt as raw text (``Prompt.text``, tokenised as it is) or as chat
messages (``Prompt.messages``, OpenAI style ``{"role", "content"}``, optionally with the tools
the model may call). ``PromptRenderer`` turns either into the token ids vLLM gets:

- messages are rendered by the tokenizer's own chat template with the generation prompt (the
  assistant header the model continues from), then tokenised without adding special tokens (the
  template writes the BOS where the format has one: adding it again would double it);
- the run's system prompt (``[prompt] system``) goes first unless the env's messages start with
  their own system message (the env knows its task best);
- ``[prompt] chat_template`` says when the template applies: ``"auto"`` (default) to every
  prompt when the tokenizer has a template (raw text as one user message: instruct models expect
  it) and to none when it has not (a base model such as the quickstart's); ``"messages"`` to
  prompts given as messages only, raw text as it is; ``"always"`` to every prompt (a template is
  required); ``"never"`` to none (message prompts are refused).
- a mismatch is warned once per model, in one line: a tokenizer with a template given raw text
  because the config asked for it, or a model named as a chat model whose tokenizer has none.

Owns: how a prompt becomes token ids. Multi-turn episodes use ``render_messages`` to append
environment turns in the same format.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from rollflow.infra.config import PromptSection
from rollflow.infra.errors import InputError
from rollflow.tasks.generate.environments import Prompt

log = logging.getLogger(__name__)
# A model path that names a chat model (Qwen2.5-7B-Instruct, Llama-2-7b-chat-hf, gemma-2-2b-it).
CHAT_MODEL_NAME = re.compile(r"(instruct|chat|(^|[-_])it([-_]|$))", re.I)
_warned: set[tuple[str, str]] = set()  # (model, mismatch): each warned once per process


def warn_once(model_path: str, kind: str, message: str) -> None:
    if (model_path, kind) not in _warned:
        _warned.add((model_path, kind))
        log.warning("%s", message)


class PromptRenderer:
    """Prompts to token ids with one tokenizer and the run's ``[prompt]`` section."""

    def __init__(self, tokenizer: Any, cfg: PromptSection, model_path: str = "the model"):
        self.tokenizer, self.cfg, self.model_path = tokenizer, cfg, model_path
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # The Rust backend directly: the same ids as tokenizer(text), at a third of the cost.
        if backend is not None:
            self._encode = lambda text, special: (
                backend.encode(text, add_special_tokens=special).ids
            )
        else:
            self._encode = lambda text, special: (
                tokenizer(text, add_special_tokens=special).input_ids
            )
        if cfg.chat_template == "always" or cfg.system is not None:
            self._need_template("[prompt] chat_template = 'always' or [prompt] system")
        name = str(model_path).rstrip("/").rsplit("/", 1)[-1]
        if not self.has_template and cfg.chat_template != "never" and CHAT_MODEL_NAME.search(name):
            warn_once(
                model_path,
                "no-template",
                f"{model_path}: named as a chat model, but its tokenizer has no chat template, "
                "so raw-text prompts go without one; use the instruct model's tokenizer (or set "
                "its chat_template), or set [prompt] chat_template = 'never' if it is a base model",
            )

    @property
    def has_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def _need_template(self, why: str) -> None:
        if not self.has_template:
            raise InputError(
                f"{self.model_path}: the tokenizer has no chat template, which {why} needs; "
                "use an instruct model's tokenizer, set tokenizer.chat_template, or "
                "set [prompt] chat_template = 'never' and give raw-text prompts"
            )

    def encode_text(self, text: str) -> list[int]:
        """Raw text as the tokenizer encodes it (special tokens such as BOS included)."""
        return self._encode(text, True)

    def messages_of(self, prompt: Prompt) -> list[dict[str, Any]] | None:
        """The messages the template renders for ``prompt`` (system prompt first), or None
        when the prompt goes as raw text."""
        if prompt.messages is None:
            mode = self.cfg.chat_template
            if mode in ("messages", "never") or (mode == "auto" and not self.has_template):
                if self.has_template:
                    warn_once(
                        self.model_path,
                        "raw",
                        f"{self.model_path}: the tokenizer has a chat template, but env "
                        f"{prompt.env}'s raw-text prompts go without it ([prompt] chat_template "
                        f"= {mode!r}); an instruct model expects its template: set 'auto' "
                        "unless the model is a base model",
                    )
                return None
            messages = [{"role": "user", "content": prompt.text}]
        else:
            if self.cfg.chat_template == "never":
                raise InputError(
                    f"env {prompt.env}: prompt {prompt.prompt_id} is given as chat messages but "
                    "[prompt] chat_template = 'never'; set it to 'messages'"
                )
            messages = [dict(m) for m in prompt.messages]
        if self.cfg.system is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.cfg.system})
        return messages

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text of ``messages``."""
        self._need_template("a prompt given as chat messages")
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )

    def encode_rendered(self, text: str) -> list[int]:
        """Template output to ids: no special tokens added (the template wrote them)."""
        return self._encode(text, False)

    def __call__(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, as vLLM gets them."""
        messages = self.messages_of(prompt)
        if messages is None:
            return self.encode_text(prompt.text)
        text = self.render_messages(messages, tools=prompt.tools)
        return self.encode_rendered(text)
