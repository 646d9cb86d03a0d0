"""Multi-turn episodes: model turns and environment turns in one token sequence, with a loss mask.

An episode starts from the prompt's chat messages (``chat.PromptRenderer``). Each model turn
is one sampling call on the whole sequence so far (token ids, never re-tokenised: what the model
saw is what the trainer trains on); the environment answers with messages (a tool's result, a
game's reply), whose tokens are appended as context. The turn's tokens come from the chat
template itself: the environment turn is the text the template adds after the model's message
(its end-of-turn suffix, the environment's messages, and the next assistant header), so the
sequence is exactly the template's rendering of the conversation.

Invariants of the ``Sample`` an episode returns (``infra/schema.py`` documents the columns):

- ``completion_mask[i]`` is 1 exactly for the tokens vLLM sampled, whose log-prob is its own;
  every environment token has mask 0 and log-prob 0.0;
- the turns tile ``completion_ids``: ``turn_offsets`` increase from 0, model and environment
  turns alternate, starting and ending with a model turn;
- it stops at the first of: the environment says done (``env_done``), ``max_turns`` model
  turns (``max_turns``), ``max_total_tokens`` completion tokens (``max_total_tokens``); the
  last two mark it ``truncated``, and so does a last model turn cut at ``max_tokens``. A model turn cut by ``sampling.max_tokens`` does not end it:
  the environment turn then opens with the end-of-turn the model did not write (the template's),
  and the environment answers the cut message (counted in ``info["cut_turns"]``);
- ``turn_versions[k]`` is the policy version vLLM held when turn k was requested (weights may
  change between turns; staleness counts from the group's ``version_started``).
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any

from rollflow.infra.errors import ConfigError, InputError
from rollflow.tasks.generate.environments import Environment, Prompt, RolloutContext, Sample


@dataclass
class EnvReply:
    """What the environment says after a model turn: messages to append, and whether it is done."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False


class MultiTurnEnv(Environment):
    """An environment that talks with the model over several turns.

    Subclasses give ``prompts`` (with ``messages``), ``start`` (a fresh episode state),
    ``respond`` (the environment's turn) and ``score`` (the episode's reward); ``respond`` and
    ``score`` run in a worker thread, off the producer's event loop.
    """

    def __init__(self, max_turns: int = 4, max_total_tokens: int = 256):
        if max_turns < 1 or max_total_tokens < 1:
            raise ConfigError(
                f"env {self.name}: args.max_turns ({max_turns}) and args.max_total_tokens "
                f"({max_total_tokens}) must be >= 1"
            )
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens

    def start(self, prompt: Prompt) -> dict[str, Any]:
        """A fresh state for one episode of ``prompt``."""
        return {}

    @abstractmethod
    def respond(self, prompt: Prompt, state: dict[str, Any], assistant_text: str) -> EnvReply:
        """The environment's turn after the model said ``assistant_text``."""

    @abstractmethod
    def score(self, prompt: Prompt, state: dict[str, Any]) -> float:
        """The episode's reward, once it has ended."""

    def last_turn(self, prompt: Prompt, state: dict[str, Any], assistant_text: str) -> None:
        """The model's turn that used up ``max_total_tokens``: the episode ends without the
        environment's answer (``respond`` is not called for it), before ``score``. By default
        nothing: an env whose score reads the conversation records it here."""

    async def rollout_group(
        self, prompt: Prompt, group_size: int, ctx: RolloutContext
    ) -> list[Sample]:
        episodes = (self.episode(prompt, ctx) for _ in range(group_size))
        return list(await asyncio.gather(*episodes))

    async def episode(self, prompt: Prompt, ctx: RolloutContext) -> Sample:
        renderer = ctx.renderer
        if renderer is None:
            raise ValueError(f"env {self.name}: a multi-turn env needs a chat renderer")
        messages = renderer.messages_of(prompt)
        if messages is None:
            raise InputError(
                f"env {self.name}: prompt {prompt.prompt_id} has no chat messages; a multi-turn "
                "env gives its prompts as messages"
            )
        tools = list(prompt.tools) if prompt.tools else None
        prompt_ids = await asyncio.to_thread(ctx.prompt_ids, prompt)
        state = self.start(prompt)
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        offsets: list[int] = []
        roles: list[str] = []
        versions: list[float] = []
        generate_s = env_s = 0.0
        cut_turns, stopped = 0, True
        stop = "max_turns"
        for turn in range(self.max_turns):
            budget = self.max_total_tokens - len(ids)
            if budget < 1:
                stop = "max_total_tokens"
                break
            version = ctx.policy_version()
            start = time.perf_counter()
            max_tokens = min(budget, ctx.max_tokens or budget)
            (completion,) = await ctx.sample(prompt_ids + ids, n=1, max_tokens=max_tokens)
            generate_s += time.perf_counter() - start
            offsets.append(len(ids))
            roles.append("assistant")
            versions.append(version if version is not None else -1)
            ids += completion.token_ids
            mask += [1] * len(completion.token_ids)
            logprobs += completion.logprobs
            model_ids = completion.token_ids
            stopped = bool(model_ids) and ctx.is_stop(model_ids[-1])
            text = ctx.decode(model_ids[:-1] if stopped else model_ids)
            messages.append({"role": "assistant", "content": text})
            cut_turns += not stopped
            if len(ids) >= self.max_total_tokens:
                stop = "max_total_tokens"
                await asyncio.to_thread(self.last_turn, prompt, state, text)
                break
            start = time.perf_counter()
            reply = await asyncio.to_thread(self.respond, prompt, state, text)
            env_s += time.perf_counter() - start
            if reply.done:
                stop = "env_done"
                break
            if turn == self.max_turns - 1:
                break  # stop stays "max_turns": the model has no turn left to answer
            env_ids = await asyncio.to_thread(
                _env_turn_ids,
                renderer,
                messages,
                reply.messages,
                tools,
                model_ids[-1] if stopped else None,
            )
            messages += reply.messages
            if len(ids) + len(env_ids) >= self.max_total_tokens:
                stop = "max_total_tokens"  # no room left for the model to answer
                break
            offsets.append(len(ids))
            roles.append(reply.messages[0]["role"] if reply.messages else "user")
            versions.append(versions[-1])
            ids += env_ids
            mask += [0] * len(env_ids)
            logprobs += [0.0] * len(env_ids)
        start = time.perf_counter()
        sample = Sample(
            prompt_ids=prompt_ids,
            completion_ids=ids,
            completion_logprobs=logprobs,
            completion_text=ctx.decode(ids),
            finish_reason="length" if cut_turns and not stopped else "stop",
            generate_s=generate_s,
            info={"messages": json.dumps(messages), "env_s": env_s, "cut_turns": cut_turns},
            completion_mask=mask,
            turn_offsets=offsets,
            turn_roles=roles,
            turn_versions=versions,
            stop_reason=stop,
            # Cut short: by a limit, or a last model turn cut at max_tokens (its answer unfinished).
            truncated=stop != "env_done" or not stopped,
        )
        try:
            sample.reward = float(await asyncio.to_thread(self.score, prompt, state))
        except Exception as exc:  # a user's scorer may raise anything: mark the sample
            sample.error = f"reward: {type(exc).__name__}: {exc}"
        sample.reward_s = time.perf_counter() - start
        return sample


def _env_turn_ids(
    renderer: Any,
    messages: list[dict[str, Any]],
    new_messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    model_stop_id: int | None,
) -> list[int]:
    """Token ids of the environment's turn: what the chat template writes after the model's
    message (the rest of its end-of-turn, ``new_messages``, the next assistant header).

    The model's message is rendered as a sentinel, so that where it ends in the template's text
    is exact whatever the model wrote (its decoded text need not round-trip). When the model
    ended its turn with ``model_stop_id``, the template's copy of that token is its own, already
    in the sequence; a cut turn (no stop token) gets the template's end-of-turn here.
    """
    history = [*messages[:-1], {**messages[-1], "content": _SENTINEL}]
    before = renderer.render_messages(history, tools=tools, add_generation_prompt=False)
    after = renderer.render_messages(
        history + list(new_messages), tools=tools, add_generation_prompt=True
    )
    if not after.startswith(before) or before.count(_SENTINEL) != 1:
        raise InputError(
            "the chat template of model.path does not render a conversation as a prefix of its "
            "continuation; multi-turn episodes need a template that only appends"
        )
    tail = before[before.index(_SENTINEL) + len(_SENTINEL) :]
    if model_stop_id is not None:
        stop_text = renderer.tokenizer.decode([model_stop_id], skip_special_tokens=False)
        if stop_text and tail.startswith(stop_text):
            tail = tail[len(stop_text) :]
    return renderer.encode_rendered(tail + after[len(before) :])


_SENTINEL = "\u2063rollflow-model-turn\u2063"  # invisible separator: no template writes it
