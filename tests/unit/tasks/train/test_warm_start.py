"""The supervised warm start measures held-out accuracy on whole answers, however long."""

from rollflow.infra.config import TinyModelSpec
from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama
from rollflow.tasks.train.warm_start import warm_start


def test_answers_longer_than_eight_tokens_can_reach_the_target():
    tok = build_char_tokenizer()
    model = build_tiny_llama(
        TinyModelSpec(hidden_size=64, num_heads=2, intermediate_size=64), vocab_size=len(tok)
    )
    pairs = [(f"q{i}=", "abcdefghijkl") for i in range(8)]  # one 12-character answer
    steps, acc = warm_start(
        model,
        tok,
        pairs,
        pairs,
        target=1.0,
        max_steps=400,
        lr=1e-2,
        eval_every=25,
        progress=lambda _: None,
    )
    assert acc == 1.0 and steps < 400


def test_greedy_accuracy_decodes_what_hf_generate_decodes_from_left_padded_prompts():
    """The KV-cached decode loop (positions, mask, cache) against HF ``generate`` on the same model:
    pairs whose answers are generate's own greedy output score 1.0, one changed answer costs 1/n."""
    import torch

    from rollflow.infra.models.tiny import EOS_ID, PAD_ID
    from rollflow.tasks.train.warm_start import greedy_accuracy

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_llama(
        TinyModelSpec(hidden_size=64, num_heads=2, intermediate_size=64), vocab_size=len(tok)
    )
    prompts = [
        "sort ab=",
        "sort dcbahg=",
        "1+2=",
        "sort hhgfedcbaa=",
    ]  # different lengths: left padding
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(
        **enc, max_new_tokens=10, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    rows = out[:, enc.input_ids.shape[1] :].tolist()
    answers = [tok.decode(r[: r.index(EOS_ID)] if EOS_ID in r else r) for r in rows]
    assert len(set(answers)) > 1  # a random model, but not a constant one
    pairs = list(zip(prompts, answers, strict=True))
    assert greedy_accuracy(model, tok, pairs, max_new_tokens=10) == 1.0
    pairs[1] = (prompts[1], answers[1] + "x")
    assert greedy_accuracy(model, tok, pairs, max_new_tokens=10) == 0.75


def test_the_warm_start_runs_on_one_thread_and_gives_the_process_its_threads_back(
    tmp_path, monkeypatch
):
    """Two threads on shared cores spun ~15x the CPU for the same steps (WARM_START_THREADS)."""
    import torch

    from rollflow.tasks.train import warm_start as module

    seen = []

    def record(*_, **__):
        seen.append(torch.get_num_threads())
        return 0, 1.0

    monkeypatch.setattr(module, "warm_start", record)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        module.prepare_tiny_model(
            TinyModelSpec(hidden_size=64, num_heads=2, intermediate_size=64),
            train_pairs=[("q=", "a")],
            eval_pairs=[("q=", "a")],
            target=0.5,
            max_steps=1,
            lr=1e-3,
            cache_dir=tmp_path,
            recipe={},
            progress=lambda _: None,
        )
        assert seen == [module.WARM_START_THREADS] == [1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
