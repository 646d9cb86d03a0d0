"""``rollflow prepare``: GSM8K- and MATH-style files as the ``math`` env reads them."""

import json
import random

from rollflow.cli import main
from rollflow.tasks.generate.environments import load_env

GSM8K = [
    {
        "question": f"Tom has {i} apples and buys {i} more. How many?",
        "answer": f"{i}+{i}={2 * i}\n#### {2 * i}",
    }
    for i in range(1, 9)
] + [
    {"question": "A farm sells 1000 eggs.", "answer": "It sells 1,000.\n#### 1,000"},
    {"question": "No marker here.", "answer": "The answer is 5."},
]
MATH = [
    {"problem": f"What is ${i}/2$?", "solution": f"It is $\\boxed{{\\frac{{{i}}}{{2}}}}$."}
    for i in range(1, 9)
] + [
    {"problem": "Simplify $\\sqrt{8}$.", "solution": "So $\\sqrt{8} = \\boxed{2\\sqrt{2}}$."},
    {"problem": "Unboxed?", "solution": "The answer is 3."},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prepare_gsm8k_writes_the_final_answers_and_counts_the_rest(tmp_path, capsys):
    src = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    out = tmp_path / "out" / "gsm8k.jsonl"
    assert main(["prepare", "gsm8k", src, str(out)]) == 0
    rows = read_jsonl(out)
    assert [r["answer"] for r in rows] == [str(2 * i) for i in range(1, 9)] + ["1000"]
    assert rows[0]["problem"] == GSM8K[0]["question"] and rows[0]["solution"] == GSM8K[0]["answer"]
    said = capsys.readouterr().out
    assert said.startswith(f"wrote 9 rows to {out}; 1 skipped (row 9: no '#### <answer>' line")
    env = load_env("math", {"path": str(out), "eval_fraction": 0.3})  # no column keys needed
    prompt = env.prompts("train", 1, random.Random(0))[0]
    assert env.reward(prompt, f"so \\boxed{{{prompt.answer}}}") == 1.0


def test_prepare_math_extracts_the_boxed_answer(tmp_path, capsys):
    src = write_jsonl(tmp_path / "math.jsonl", MATH)
    out = tmp_path / "math.parquet"
    assert main(["prepare", "math", src, str(out)]) == 0
    env = load_env("math", {"path": str(out), "eval_fraction": 0.3})
    answers = {p.answer for s in ("train", "eval") for p in env.prompts(s, 20, random.Random(0))}
    assert answers == {f"\\frac{{{i}}}{{2}}" for i in range(1, 9)} | {"2\\sqrt{2}"}
    assert "1 skipped (row 9: no \\boxed{} answer in the solution)" in capsys.readouterr().out
    prompt = next(p for p in env.prompts("eval", 20, random.Random(0)))
    assert env.reward(prompt, f"\\boxed{{{prompt.answer}}}") == 1.0


def test_prepare_errors_are_one_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "math.jsonl", MATH[-1:])
    assert main(["prepare", "math", src, str(tmp_path / "o.jsonl")]) == 2
    assert "no row has a final answer (row 0: no \\boxed{} answer" in capsys.readouterr().err
    assert main(["prepare", "gsm8k", src, str(tmp_path / "o.csv")]) == 2
    assert "write a .jsonl or a .parquet file" in capsys.readouterr().err
    assert main(["prepare", "gsm8k", src, str(tmp_path / "o.jsonl")]) == 2  # math columns
    assert "missing 'question'" in capsys.readouterr().err
