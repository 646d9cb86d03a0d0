"""Plain reward functions: ``[[envs]] rewards = [{fn = "rewards.py:accuracy", weight = 1.0}]``.

Owns: loading a function from a module or a file, checking its signature at config time, and
calling it with a deadline. Invariant: every sample of a scored group ends with either a finite
reward (the weighted sum of every function's value, each one kept in ``info["rewards"]``) or an
``error``; a function that raises, hangs or returns a non-number never stops the run.

Two call forms, told apart by the signature:

- per sample: ``fn(prompt, completion, **fields)`` → a number, called once per completion;
- batched, TRL's: ``fn(prompts, completions, **fields)`` → a list of numbers, called once per
  group with one entry per completion (fields as lists too). Chat prompts are given as TRL gives
  conversational data: ``prompts`` as message lists, ``completions`` as
  ``[{"role": "assistant", "content": text}]``.

``fields`` are the example's other columns (``answer`` and any metadata column); a function takes
the ones it names, or all of them through ``**kwargs``. ``async def`` functions are awaited.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any

from rollflow.infra.errors import ConfigError

_SAMPLE_ARGS = ("prompt", "completion")
_BATCH_ARGS = ("prompts", "completions")


@dataclass(frozen=True)
class RewardFn:
    """One loaded function: its label in rows and metrics, weight and call form."""

    label: str
    fn: Callable[..., Any]
    weight: float
    batched: bool
    params: frozenset[str] | None  # the keyword arguments it takes; None: any (**kwargs)


def load_reward_fn(ref: str, weight: float = 1.0, *, key: str = "rewards") -> RewardFn:
    """The function ``ref`` names (``package.module:function`` or ``file.py:function``).

    Raises ConfigError naming ``key`` and the module or file when it cannot be used.
    """
    where, _, name = ref.rpartition(":")
    module = _import_file(where, key, ref) if _is_path(where) else _import_module(where, key, ref)
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"{key} = {ref!r}: {where} has no {name!r}")
    if not callable(fn):
        raise ConfigError(f"{key} = {ref!r}: {name!r} in {where} is not callable")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key} = {ref!r}: cannot read its signature: {exc}") from exc
    params = sig.parameters
    any_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    batched = "completions" in params
    if not batched and "completion" not in params and not any_kwargs:
        raise ConfigError(
            f"{key} = {ref!r}: {name}{sig} takes no completion; write "
            "def f(prompt, completion, **kwargs) -> float (one sample) or "
            "def f(prompts, completions, **kwargs) -> list[float] (TRL's, one group)"
        )
    required = [
        p.name
        for p in params.values()
        if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if any(params[p].kind is params[p].POSITIONAL_ONLY for p in required):
        raise ConfigError(
            f"{key} = {ref!r}: {name}{sig} has positional-only parameters; it is called with "
            "keyword arguments (prompt(s), completion(s), answer and the example's other columns)"
        )
    names = None if any_kwargs else frozenset(params)
    return RewardFn(name, fn, float(weight), batched, names)


def load_reward_fns(specs: Sequence[Any], *, key: str = "rewards") -> list[RewardFn]:
    """Every function of ``specs`` (objects with ``fn`` and ``weight``), labels made unique."""
    fns: list[RewardFn] = []
    for i, spec in enumerate(specs):
        f = load_reward_fn(spec.fn, spec.weight, key=f"{key}[{i}].fn")
        taken = {g.label for g in fns}
        label = f.label if f.label not in taken else f"{f.label}_{i}"
        fns.append(RewardFn(label, f.fn, f.weight, f.batched, f.params))
    return fns


def _is_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _import_module(where: str, key: str, ref: str):
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise ConfigError(
            f"{key} = {ref!r}: cannot import module {where!r}: {exc}; name a module on the "
            "path (package.module:function) or a file (rewards.py:function)"
        ) from exc


def _import_file(where: str, key: str, ref: str):
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{key} = {ref!r}: no such file {path}")
    name = f"rollflow_rewards_{abs(hash(str(path)))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{key} = {ref!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's file may raise anything at import
        raise ConfigError(
            f"{key} = {ref!r}: importing {path} failed: {type(exc).__name__}: {exc}"
        ) from exc
    sys.modules[name] = module
    return module


@dataclass(frozen=True)
class RewardFns:
    """An env's weighted functions and the deadline of each call."""

    fns: tuple[RewardFn, ...]
    timeout_s: float

    async def score(
        self, prompt: Any, completions: list[str]
    ) -> list[tuple[float, dict[str, float]] | str]:
        """Per completion: (weighted sum, each function's value) or the error that replaces it."""
        values: list[dict[str, float] | str] = [{} for _ in completions]
        for f in self.fns:
            got = await self._call(f, prompt, completions)
            for i, v in enumerate(got):
                if isinstance(values[i], dict):
                    values[i] = v if isinstance(v, str) else {**values[i], f.label: v}
        weights = {f.label: f.weight for f in self.fns}
        return [
            v if isinstance(v, str) else (sum(weights[k] * x for k, x in v.items()), v)
            for v in values
        ]

    async def _call(self, f: RewardFn, prompt: Any, completions: list[str]) -> list[float | str]:
        fields = {"answer": prompt.answer, **(prompt.fields or {})}
        if f.batched:
            n = len(completions)
            chat = prompt.messages is not None
            kwargs = {
                "prompts": [list(prompt.messages) if chat else prompt.text] * n,
                "completions": [
                    [{"role": "assistant", "content": c}] if chat else c for c in completions
                ],
                **{k: [v] * n for k, v in fields.items()},
            }
            try:
                out = await self._run(f, kwargs)
                if not isinstance(out, list | tuple) or len(out) != n:
                    raise ValueError(f"returned {_short(out)}, not a list of {n} numbers")
            except Exception as exc:  # a user's function may raise anything
                return [_error(f, exc)] * n
            return [_checked(f, v) for v in out]

        async def one(completion: str) -> float | str:
            try:
                kwargs = {"prompt": prompt.text, "completion": completion, **fields}
                return _checked(f, await self._run(f, kwargs))
            except Exception as exc:
                return _error(f, exc)

        # the group's samples at once: a hanging function costs one deadline, not one per sample
        return list(await asyncio.gather(*(one(c) for c in completions)))

    async def _run(self, f: RewardFn, kwargs: dict[str, Any]) -> Any:
        if f.params is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in f.params}
        call = f.fn(**kwargs) if inspect.iscoroutinefunction(f.fn) else _in_thread(f.fn, kwargs)
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no value within reward_timeout_s = {self.timeout_s:g}") from None


def _in_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> asyncio.Future:
    """``fn(**kwargs)`` in a daemon thread of its own: a sync function that hangs past its
    deadline keeps only that thread, never a pool's worker nor the loop's shutdown."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if not future.done():
            future.set_exception(exc) if exc is not None else future.set_result(value)

    def run() -> None:
        try:
            value, exc = fn(**kwargs), None
        except BaseException as e:  # handed to the awaiting coroutine
            value, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop closed while the function hung: no one waits
            pass

    threading.Thread(target=run, name=f"reward-{fn.__name__}", daemon=True).start()
    return future


def _checked(f: RewardFn, value: Any) -> float | str:
    if not isinstance(value, Real):  # bools count as 0 and 1
        return f"reward {f.label}: returned {_short(value)}, not a number"
    if not math.isfinite(value):
        return f"reward {f.label}: returned {value}"
    return float(value)


def _error(f: RewardFn, exc: Exception) -> str:
    return f"reward {f.label}: {type(exc).__name__}: {exc}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
