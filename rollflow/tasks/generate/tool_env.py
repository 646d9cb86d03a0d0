"""Tool use and a game: two built-in multi-turn environments.

**Tools** are Python functions with a JSON-schema signature (``Tool.from_function`` derives it
from the type hints, or takes one). The prompt lists them through the chat template (the
model's own tool format), and each model turn is parsed for calls in that format:

- Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or more;
- Llama 3.1: the whole message is one JSON object ``{"name": ..., "parameters": {...}}``.

Each call's result goes back as a ``tool`` message. A malformed call (bad JSON, an unclosed
tag, an unknown tool, arguments that break the schema) or a tool that raises gets an
``error: ...`` tool message, and the episode goes on: the model can learn to call correctly. A
turn with no call is the final answer.

``ToolEnv`` (``calculator``): arithmetic questions with ``add`` and ``multiply`` tools, scored by
exact match of the final answer. ``GuessNumberEnv`` (``guess_number``): the model guesses a
secret number and hears "higher" or "lower"; the reward is higher the fewer turns it needs.
"""

from __future__ import annotations

import inspect
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from rollflow.infra.errors import ConfigError, InputError
from rollflow.tasks.generate.environments import Prompt, Split, in_eval_split
from rollflow.tasks.generate.multi_turn import EnvReply, MultiTurnEnv

# Python annotations (as objects, or as strings under `from __future__ import annotations`).
_JSON_TYPES = {
    t: kind
    for py, kind in ((int, "integer"), (float, "number"), (str, "string"), (bool, "boolean"))
    for t in (py, py.__name__)
}
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    """One callable tool: a Python function and the JSON schema of its arguments."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]

    @classmethod
    def from_function(
        cls, fn: Callable[..., Any], parameters: dict[str, Any] | None = None
    ) -> Tool:
        """A tool of ``fn``; its schema from the type hints (int, float, str, bool) unless given."""
        if parameters is None:
            props, required = {}, []
            for name, param in inspect.signature(fn).parameters.items():
                kind = _JSON_TYPES.get(param.annotation)
                if kind is None:
                    raise InputError(
                        f"tool {fn.__name__}: parameter {name!r} needs an int, float, str or "
                        "bool annotation, or pass its JSON schema"
                    )
                props[name] = {"type": kind}
                if param.default is inspect.Parameter.empty:
                    required.append(name)
            parameters = {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": False,
            }
        jsonschema.Draft202012Validator.check_schema(parameters)
        doc = (inspect.getdoc(fn) or fn.__name__).splitlines()[0]
        return cls(fn.__name__, fn, doc, parameters)

    def spec(self) -> dict[str, Any]:
        """The OpenAI-style function spec chat templates list."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def call(self, arguments: Any) -> str:
        """The tool's result as text; ``error: ...`` for bad arguments or a raising tool."""
        try:
            jsonschema.validate(arguments, self.parameters)
        except jsonschema.ValidationError as exc:
            return f"error: bad arguments for {self.name}: {exc.message}"
        try:
            return str(self.fn(**arguments))
        except Exception as exc:  # a tool may raise anything: the model gets the message
            return f"error: {self.name} raised {type(exc).__name__}: {exc}"


def parse_tool_calls(text: str) -> list[dict[str, Any] | str]:
    """Calls in ``text`` (Hermes tags, or a Llama JSON message) as ``{"name", "arguments"}``,
    or an error string per malformed call. An empty list: the message is not a call."""
    if "<tool_call>" in text:
        calls: list[dict[str, Any] | str] = []
        for body in _HERMES_CALL.findall(text):
            calls.append(_call_of(body, "arguments"))
        if text.count("<tool_call>") > len(calls):
            calls.append("error: a <tool_call> tag is not closed by </tool_call>")
        return calls
    stripped = text.strip()
    if stripped.startswith("{") and '"name"' in stripped:
        return [_call_of(stripped, "parameters")]
    return []


def _call_of(body: str, args_key: str) -> dict[str, Any] | str:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"error: the tool call is not valid JSON ({exc.msg} at {exc.pos})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return 'error: a tool call is a JSON object with a "name" string'
    arguments = call.get(args_key, call.get("arguments", call.get("parameters", {})))
    if not isinstance(arguments, dict):
        return f"error: the {args_key} of a tool call are a JSON object"
    return {"name": call["name"], "arguments": arguments}


def run_tool_calls(tools: dict[str, Tool], calls: list[dict[str, Any] | str]) -> list[str]:
    """One result per call, in order; never raises."""
    out = []
    for call in calls:
        if isinstance(call, str):
            out.append(call)
        elif call["name"] not in tools:
            out.append(f"error: no tool {call['name']!r}; tools: {', '.join(sorted(tools))}")
        else:
            out.append(tools[call["name"]].call(call["arguments"]))
    return out


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class ToolEnv(MultiTurnEnv):
    """Arithmetic with tools: "What is 7*8+5?" → the model may call add / multiply, then answers."""

    name = "calculator"
    eval_fraction = 0.2

    def __init__(self, max_value: int = 20, max_turns: int = 4, max_total_tokens: int = 256):
        super().__init__(max_turns, max_total_tokens)
        self.max_value = max_value
        self.tools = {t.name: t for t in (Tool.from_function(add), Tool.from_function(multiply))}

    def prompts(self, split: Split, count: int, rng: random.Random) -> list[Prompt]:
        specs = tuple(t.spec() for t in self.tools.values())
        out: list[Prompt] = []
        if count == 0:  # a batch whose env mix drew none of this env (2^-8 for 2 envs, 8 prompts)
            return out
        for _ in range(count * 1000):
            a, b, c = (rng.randint(1, self.max_value) for _ in range(3))
            text = f"What is {a}*{b}+{c}?"
            if in_eval_split(text, self.eval_fraction) != (split == "eval"):
                continue
            messages = ({"role": "user", "content": text + " Answer with the number only."},)
            out.append(
                Prompt(self.name, f"{self.name}:{text}", text, str(a * b + c), messages, specs)
            )
            if len(out) == count:
                return out
        raise RuntimeError(f"env {self.name!r}: could not draw {count} {split} prompts")

    def start(self, prompt: Prompt) -> dict[str, Any]:
        return {"final": None, "num_calls": 0, "num_errors": 0}

    def respond(self, prompt: Prompt, state: dict[str, Any], assistant_text: str) -> EnvReply:
        calls = parse_tool_calls(assistant_text)
        if not calls:
            state["final"] = assistant_text
            return EnvReply(done=True)
        results = run_tool_calls(self.tools, calls)
        state["num_calls"] += len(calls)
        state["num_errors"] += sum(r.startswith("error:") for r in results)
        return EnvReply([{"role": "tool", "content": r} for r in results])

    def score(self, prompt: Prompt, state: dict[str, Any]) -> float:
        return float(state["final"] is not None and state["final"].strip() == prompt.answer)


class GuessNumberEnv(MultiTurnEnv):
    """Guess a secret number in [1, high]; the game answers "higher", "lower" or "correct".

    Reward: 1 for a guess right at the first turn, less for each turn after (down to
    1 / max_turns), 0 when the turns run out; with ``discount = False``, 1 for any solved game.
    """

    name = "guess_number"

    def __init__(
        self, high: int = 8, max_turns: int = 4, max_total_tokens: int = 128, discount: bool = True
    ):
        super().__init__(max_turns, max_total_tokens)
        self.discount = discount
        if high < 2:
            raise ConfigError(f"env guess_number: args.high must be >= 2, got {high}")
        self.high = high

    def prompts(self, split: Split, count: int, rng: random.Random) -> list[Prompt]:
        # Held-out prompts are the same game with other secrets: the split is by secret's seed.
        out = []
        while len(out) < count:
            seed = rng.randrange(10**9)
            if in_eval_split(f"guess:{seed}", 0.2) != (split == "eval"):
                continue
            secret = random.Random(seed).randint(1, self.high)
            text = f"Guess my number between 1 and {self.high}. Say one number."
            messages = ({"role": "user", "content": text},)
            out.append(Prompt(self.name, f"{self.name}:{seed}", text, str(secret), messages))
        return out

    def start(self, prompt: Prompt) -> dict[str, Any]:
        return {"turns": 0, "solved_at": None}

    def respond(self, prompt: Prompt, state: dict[str, Any], assistant_text: str) -> EnvReply:
        state["turns"] += 1
        secret = int(prompt.answer)
        found = re.search(r"-?\d+", assistant_text)
        if found is None:
            return EnvReply([{"role": "user", "content": f"Say one number from 1 to {self.high}."}])
        guess = int(found.group())
        if guess == secret:
            state["solved_at"] = state["turns"]
            return EnvReply(done=True)
        return EnvReply([{"role": "user", "content": "higher" if guess < secret else "lower"}])

    def score(self, prompt: Prompt, state: dict[str, Any]) -> float:
        if state["solved_at"] is None:
            return 0.0
        if not self.discount:
            return 1.0
        return (self.max_turns - state["solved_at"] + 1) / self.max_turns
