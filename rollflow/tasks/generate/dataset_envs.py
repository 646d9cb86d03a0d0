"""Single-turn environments whose prompts come from a dataset (``dataset.py``: a hub id, local
json/jsonl/parquet/csv files, a ``save_to_disk`` or dataset-repository folder).

``dataset``: exact match of the stripped completion against the answer column.
``math``: the answer checked with math-verify (``\\frac{1}{2}``, ``0.5`` and ``\\boxed{1/2}`` all
match); ships ``data/math_small.jsonl`` (a few dozen small problems) as its default dataset.

Held-out split: a second source (``eval_path`` and/or ``eval_split``), or else a stable hash of
the prompt puts ``eval_fraction`` of the rows aside. Either way train and eval never share a
prompt. Rewards run in SingleTurnEnv's worker thread, off the event loop.

A row's prompt is text or chat messages (TRL's conversational format); messages go to the model
through its chat template (``chat.py``). ``limit_prompt_length`` drops (and counts) the prompts
longer than ``[prompt] max_prompt_length`` tokens once the tokenizer is known: never truncated.
"""

from __future__ import annotations

import importlib.util
import logging
import random
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from rollflow.infra.errors import ConfigError, InputError
from rollflow.tasks.generate.dataset import LoadedDataset, PromptRow, load_prompts
from rollflow.tasks.generate.environments import Prompt, SingleTurnEnv, Split, in_eval_split

log = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "data"


class DatasetEnv(SingleTurnEnv):
    """Prompts from a dataset; reward 1 when the stripped completion equals the answer.

    ``prompt_template`` wraps each prompt: ``{prompt}`` is replaced by the row's text (plain
    replacement, so LaTeX braces need no escaping); in a chat row it wraps the last user message.
    """

    name = "dataset"

    def __init__(
        self,
        path: str,
        *,
        format: str = "auto",
        split: str | None = None,
        subset: str | None = None,
        prompt_column: str = "prompt",
        answer_column: str | None = "answer",
        eval_path: str | None = None,
        eval_split: str | None = None,
        eval_fraction: float = 0.1,
        prompt_template: str = "{prompt}",
    ):
        if "{prompt}" not in prompt_template:
            raise ConfigError(
                f"env {self.name}: args.prompt_template {prompt_template!r} has no {{prompt}}; "
                "put {prompt} where the dataset's prompt goes"
            )
        columns = {"format": format, "prompt_column": prompt_column, "answer_column": answer_column}
        columns["subset"] = subset
        train = load_prompts(path, split=split, **columns)
        if eval_path is None and eval_split is None:
            if not 0 < eval_fraction < 1:
                raise ConfigError(
                    f"env {self.name}: args.eval_fraction must be in (0, 1), got {eval_fraction}"
                )
            held_out = [r for r in train.rows if in_eval_split(r.key, eval_fraction)]
            train_rows = [r for r in train.rows if not in_eval_split(r.key, eval_fraction)]
            self.num_skipped_rows = train.num_skipped
            eval_prefix = ""
            how = f"eval_fraction {eval_fraction} of {len(train.rows)} rows of {train.source}"
        else:
            held = load_prompts(eval_path or path, split=eval_split, **columns)
            if held.source == train.source:
                raise ConfigError(
                    f"env {self.name}: the eval source is the training source "
                    f"({train.source}); set a different args.eval_path or args.eval_split"
                )
            held_out = list(held.rows)
            train_rows = _without_prompts(train, {r.key for r in held_out})
            self.num_skipped_rows = train.num_skipped + held.num_skipped
            eval_prefix = "eval:"
            how = f"{train.source} with held-out {held.source}"
        if not train_rows or not held_out:
            raise InputError(
                f"env {self.name}: {how} leaves {len(train_rows)} training and "
                f"{len(held_out)} held-out prompts; both need at least one (more rows, or "
                "another args.eval_fraction / eval_path)"
            )
        self._rows: dict[Split, list[Prompt]] = {
            "train": [self._prompt(r, "", prompt_template) for r in train_rows],
            "eval": [self._prompt(r, eval_prefix, prompt_template) for r in held_out],
        }
        self.num_long_prompts = 0  # dropped by limit_prompt_length, also in num_skipped_rows

    def _prompt(self, row: PromptRow, prefix: str, template: str) -> Prompt:
        text = template.replace("{prompt}", row.prompt)
        messages = None
        if row.messages is not None:
            messages = list(row.messages)
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            last_user = users[-1] if users else len(messages) - 1
            messages[last_user] = {**messages[last_user], "content": text}
            messages = tuple(messages)
        return Prompt(
            self.name,
            f"{self.name}:{prefix}{row.index}",
            text,
            row.answer,
            messages=messages,
            fields=row.fields or None,
        )

    def limit_prompt_length(self, prompt_len: Callable[[Prompt], int], max_len: int) -> int:
        """Drop the prompts longer than ``max_len`` tokens (``prompt_len`` counts them as vLLM
        gets them); they are counted in ``num_skipped_rows`` and ``num_long_prompts`` and said in
        one warning, never truncated. Returns how many were dropped now."""
        kept = {
            split: [p for p in rows if prompt_len(p) <= max_len]
            for split, rows in self._rows.items()
        }
        dropped = sum(len(self._rows[s]) - len(kept[s]) for s in kept)
        if not dropped:
            return 0
        if not kept["train"] or not kept["eval"]:
            raise InputError(
                f"env {self.name}: every {'training' if not kept['train'] else 'held-out'} "
                f"prompt is longer than [prompt] max_prompt_length = {max_len} tokens; raise it"
            )
        longest = max(prompt_len(p) for rows in self._rows.values() for p in rows)
        log.warning(
            "env %s: dropped %d of %d prompts longer than [prompt] max_prompt_length = %d tokens "
            "(the longest has %d); they are not truncated",
            self.name,
            dropped,
            sum(len(rows) for rows in self._rows.values()),
            max_len,
            longest,
        )
        self._rows = kept
        self.num_long_prompts += dropped
        self.num_skipped_rows += dropped
        return dropped

    def prompts(self, split: Split, count: int, rng: random.Random) -> list[Prompt]:
        """Training: ``count`` prompts, without repeats until the set is used up. Eval: at most
        ``count`` distinct held-out prompts."""
        rows = self._rows[split]
        if split == "eval":
            return rng.sample(rows, min(count, len(rows)))
        out: list[Prompt] = []
        while len(out) < count:
            out += rng.sample(rows, min(len(rows), count - len(out)))
        return out

    def reward(self, prompt: Prompt, completion: str) -> float:
        return float(completion.strip() == prompt.answer.strip())

    def sft_examples(self, count: int, rng: random.Random) -> list[tuple[str, str]]:
        """(prompt, answer) pairs of the train split for a supervised warm start."""
        return [(p.text, p.answer) for p in self.prompts("train", count, rng)]


def _without_prompts(loaded: LoadedDataset, held_out: set[str]) -> list[PromptRow]:
    """Training rows minus any whose prompt is also held out (said, not silent)."""
    rows = [r for r in loaded.rows if r.key not in held_out]
    if len(rows) < len(loaded.rows):
        log.warning(
            "dataset %s: dropped %d training rows whose prompt is also in the held-out set",
            loaded.source,
            len(loaded.rows) - len(rows),
        )
    return rows


# --------------------------------------------------------------------------- math

MATH_TEMPLATE = "{prompt}\nPut the final answer in \\boxed{}.\n"
MAX_EXPONENT = 10_000  # larger numeric exponents are not compared (see _too_costly)
MAX_FACTORIAL = 10_000


class MathEnv(DatasetEnv):
    """Math problems whose answers math-verify checks for equivalence, not string equality."""

    name = "math"

    def __init__(
        self,
        path: str = str(DATA_DIR / "math_small.jsonl"),
        *,
        prompt_column: str = "problem",
        answer_column: str = "answer",
        prompt_template: str = MATH_TEMPLATE,
        **kwargs,
    ):
        if importlib.util.find_spec("math_verify") is None:
            raise ConfigError(
                f"env {self.name} checks answers with math-verify, which is not installed: "
                "pip install math-verify"
            )
        if not answer_column:
            raise ConfigError(
                f"env {self.name}: args.answer_column is required (the reference answers' column)"
            )
        super().__init__(
            path,
            prompt_column=prompt_column,
            answer_column=answer_column,
            prompt_template=prompt_template,
            **kwargs,
        )

    def reward(self, prompt: Prompt, completion: str) -> float:
        from math_verify import parse

        gold = _parse_gold(prompt.answer)
        # math-verify's own timeouts use SIGALRM, which works only on the main thread; this runs in
        # a worker thread, so answers too costly to compare are refused before sympy sees them.
        predicted = parse(completion, parsing_timeout=None)
        if not predicted or _too_costly(predicted):
            return 0.0
        return float(verify(gold, predicted))


def verify(gold: list, predicted: list) -> bool:
    from math_verify import verify as math_verify

    return math_verify(gold, predicted, timeout_seconds=None)


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> list:
    import sympy
    from math_verify import parse

    # math-verify falls back to the raw string when LaTeX does not parse; a reference answer
    # must parse, or every completion would be compared as text.
    gold = parse(f"${answer}$", parsing_timeout=None)
    if not any(isinstance(value, sympy.Basic) for value in gold):
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    return gold


def _too_costly(values: list) -> bool:
    """True when comparing would evaluate a huge power or factorial (e.g. ``9^{9^{9^{99}}}``).

    Such a comparison ran for minutes holding the GIL (measured), which would stall every rollout
    of the process; math-verify's SIGALRM timeout cannot fire off the main thread.
    """
    import sympy

    for value in values:
        if not isinstance(value, sympy.Basic):
            continue
        for node in sympy.preorder_traversal(value):
            if isinstance(node, sympy.Pow) and node.exp.is_number:
                if abs(sympy.N(node.exp, 5)) > MAX_EXPONENT:
                    return True
            elif isinstance(node, sympy.factorial) and node.args[0].is_number:
                if abs(sympy.N(node.args[0], 5)) > MAX_FACTORIAL:
                    return True
    return False


class _QuietTimeoutNotice(logging.Filter):
    """math-verify warns once that its timeout is off; _too_costly is what bounds the work."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_QuietTimeoutNotice())
