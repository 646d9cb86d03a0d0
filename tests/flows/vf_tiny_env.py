"""A tiny verifiers environment for tests/flows/test_ecosystem_runs.py (needs `verifiers`):
`verifiers.load_environment("vf_tiny_env")` imports this module and calls `load_environment`."""

from __future__ import annotations


def load_environment(**kwargs):
    import verifiers as vf
    from datasets import Dataset

    rows = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(64)]

    def exact(completion, answer, **_):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        return float(text.strip() == answer)

    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows),
        system_prompt="Answer with the number only.",
        rubric=vf.Rubric(funcs=[exact]),
    )
