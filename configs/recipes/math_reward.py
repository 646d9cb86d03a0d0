"""The plain reward function of the Qwen3 and Llama 3 math recipes (configs/recipes/*-math.toml).

`rewards = [{ fn = "configs/recipes/math_reward.py:accuracy" }]`: 1.0 when the completion's final
answer equals the example's `answer` column, checked by math-verify (`\\boxed{1/2}`, `0.5` and
`\\frac{1}{2}` all match), else 0.0. Copy it next to your own config and change it freely.
"""

import logging

from math_verify import parse, verify

# Its "timeout is disabled" notice, once per call, says what the comment below says.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def accuracy(completion: str, answer: str, **kwargs) -> float:
    # rollflow calls a function in a worker thread with its own deadline (reward_timeout_s), so
    # math-verify's signal-based timeouts are switched off.
    gold = parse(f"${answer}$", parsing_timeout=None)
    predicted = parse(completion, parsing_timeout=None)
    return float(bool(gold) and verify(gold, predicted, timeout_seconds=None))
