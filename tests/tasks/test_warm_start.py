"""The supervised warm start measures held-out accuracy on whole answers, however long."""

from rollflow.infra.config import TinyModelSpec
from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama
from rollflow.tasks.train.warm_start import warm_start


def test_answers_longer_than_eight_tokens_can_reach_the_target():
    tok = build_char_tokenizer()
    model = build_tiny_llama(TinyModelSpec(hidden_size=64, num_heads=2, intermediate_size=64), vocab_size=len(tok))
    pairs = [(f"q{i}=", "abcdefghijkl") for i in range(8)]  # one 12-character answer
    steps, acc = warm_start(model, tok, pairs, pairs, target=1.0, max_steps=400, lr=1e-2, eval_every=25,
                            progress=lambda _: None)
    assert acc == 1.0 and steps < 400
