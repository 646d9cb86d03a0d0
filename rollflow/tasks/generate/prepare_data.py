"""``rollflow prepare``: a GSM8K- or MATH-style dataset as the ``math`` env reads it.

    rollflow prepare gsm8k openai/gsm8k data/gsm8k-train.jsonl --subset main --split train
    rollflow prepare math  EleutherAI/hendrycks_math data/math-train.jsonl --subset algebra

The source is anything ``dataset.py`` reads (a hub id through the hub cache, a local
json/jsonl/parquet/csv file, a ``save_to_disk`` or repository folder). Each output row has
``problem`` (the question), ``answer`` (the final answer alone) and ``solution`` (the source's
worked solution, a metadata column for plain reward functions): the ``math`` env's default
columns, so ``[[envs]] name = "math"`` with ``args = { path = OUT }`` needs no other key.

- GSM8K style: ``question`` and an ``answer`` whose last line is ``#### 42`` (thousands commas
  are dropped: ``#### 1,000`` -> ``1000``);
- MATH style: ``problem`` and a ``solution`` with the answer in ``\\boxed{}``, extracted by
  math-verify (the same library that checks completions), so every answer written is one the
  ``math`` env can check.

Invariant: every source row is written or counted as skipped with a reason (the loader's
malformed rows, and rows whose final answer cannot be found); the first few are named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollflow.infra.errors import InputError
from rollflow.tasks.generate.dataset import MAX_REPORTED, load_prompts

Style = Literal["gsm8k", "math"]
# The source columns of each style: (question, worked solution).
COLUMNS: dict[str, tuple[str, str]] = {
    "gsm8k": ("question", "answer"),
    "math": ("problem", "solution"),
}


@dataclass(frozen=True)
class Prepared:
    out: Path
    num_written: int
    num_skipped: int
    first_skipped: tuple[str, ...]

    def summary(self) -> str:
        skipped = (
            f"; {self.num_skipped} skipped ({'; '.join(self.first_skipped)}"
            f"{'; ...' if self.num_skipped > len(self.first_skipped) else ''})"
            if self.num_skipped
            else ""
        )
        return f"wrote {self.num_written} rows to {self.out}{skipped}"


def prepare(
    style: Style,
    source: str,
    out: str | Path,
    *,
    split: str | None = None,
    subset: str | None = None,
    question_column: str | None = None,
    solution_column: str | None = None,
) -> Prepared:
    """Read ``source`` in ``style`` and write ``out`` (``.jsonl`` or ``.parquet``)."""
    if style not in COLUMNS:
        raise InputError(f"prepare: unknown style {style!r}; use one of {', '.join(COLUMNS)}")
    out = Path(out)
    if out.suffix.lower() not in (".jsonl", ".parquet"):
        raise InputError(f"prepare: {out}: write a .jsonl or a .parquet file")
    question_col = question_column or COLUMNS[style][0]
    solution_col = solution_column or COLUMNS[style][1]
    loaded = load_prompts(
        source,
        prompt_column=question_col,
        answer_column=solution_col,
        split=split,
        subset=subset,
    )
    extract = _gsm8k_answer if style == "gsm8k" else _boxed_answer
    rows, skipped = [], list(loaded.first_skipped)
    num_skipped = loaded.num_skipped
    for row in loaded.rows:
        try:
            answer = extract(row.answer)
        except NoAnswer as exc:
            num_skipped += 1
            skipped.append(f"row {row.index}: {exc}")
            continue
        rows.append({"problem": row.prompt, "answer": answer, "solution": row.answer})
    if not rows:
        raise InputError(
            f"prepare {style}: {loaded.source}: no row has a final answer "
            f"({'; '.join(skipped[:MAX_REPORTED])})"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix.lower() == ".jsonl":
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    return Prepared(out, len(rows), num_skipped, tuple(skipped[:MAX_REPORTED]))


class NoAnswer(ValueError):
    """A solution whose final answer cannot be found (the row is skipped and counted)."""


def _gsm8k_answer(solution: str) -> str:
    """The number after GSM8K's ``####`` marker."""
    _, marker, final = solution.rpartition("####")
    if not marker:
        raise NoAnswer("no '#### <answer>' line in the solution")
    answer = final.strip().replace(",", "")
    if not answer:
        raise NoAnswer("nothing after '####'")
    return answer


def _boxed_answer(solution: str) -> str:
    """The ``\\boxed{}`` answer of a MATH solution as math-verify extracts it, kept only when the
    ``math`` env can check against it (its reference answers must parse)."""
    from math_verify import LatexExtractionConfig, parse

    from rollflow.tasks.generate.dataset_envs import _parse_gold

    if "\\boxed" not in solution and "\\fbox" not in solution:
        raise NoAnswer("no \\boxed{} answer in the solution")
    parsed = parse(
        solution,
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        parsing_timeout=None,
    )
    answer = str(parsed[1]).strip() if len(parsed) >= 2 else ""
    try:
        _parse_gold(answer)
    except ValueError:
        raise NoAnswer(f"math-verify cannot parse the \\boxed{{}} answer {answer!r}") from None
    return answer
