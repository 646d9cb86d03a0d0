"""Real architectures end to end: Llama (GQA), Qwen2 (GQA, tied embeddings, qkv bias) and Qwen3
(q/k norm), each a tiny random model with a locally trained byte-level BPE tokenizer and a chat
template, through vLLM (the CPU build), the trainer service (FSDP2, one gloo rank) and a weight
sync over the weight group.

vLLM serves one seed of the model; the trainer starts from another and broadcasts its weights, so
the log-probs can only agree if the sync loaded every tensor (tied and biased ones included).
Then vLLM samples chat-formatted prompts at the trainer's sampling behaviour; the trainer's
``forward`` takes its log-probs of the same tokens. Per token, the KL estimate
``exp(d) - 1 - d`` (d = trainer - vLLM) must stay below 1e-3, at temperature 1 and at 0.7 with
top_p 0.9; there, the stored log-probs must also be those of the tempered, nucleus-cut policy
(checked against transformers), not the raw temperature-1 ones.

Each architecture runs at one behaviour (one trainer start each): what an architecture can break
is the sync and the forward (its tensors), the same at any behaviour; what a behaviour can break
is the log-prob of a tempered, nucleus-cut policy, the same code for every architecture.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollflow.gpu_kernels.logprobs import reference_logprobs_entropy
from rollflow.infra.config import SamplingSection, TrainerServiceSection, TrainSection
from rollflow.infra.models.tiny_chat import ARCHS, save_tiny_chat_model
from rollflow.infra.schema import rows_to_table
from rollflow.infra.storage import RunStorage
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.services.trainer_process import TrainerProcess
from rollflow.services.vllm_server import InferenceServer
from rollflow.tasks.sync.weights import GroupSpec, join, leave, publish
from rollflow.trainer.protocol import ServiceArgs

pytestmark = pytest.mark.slow

MAX_LEN = 128
MAX_TOKENS = 16
KL_BOUND = 1e-3
BEHAVIOURS = {"t1": (1.0, 1.0), "t07-p09": (0.7, 0.9)}
BEHAVIOUR_OF = {"llama": "t07-p09", "qwen2": "t1", "qwen3": "t1"}
assert set(BEHAVIOUR_OF) == set(ARCHS) and set(BEHAVIOUR_OF.values()) == set(BEHAVIOURS)
PROMPTS = [
    [{"role": "user", "content": "What is 12+30?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "sort the letters"}],
    [{"role": "user", "content": "count the words"}],
]


@pytest.fixture(scope="module", params=ARCHS)
def arch_server(request, tmp_path_factory):
    """One arch: the trainer's model (seed 1), and vLLM serving another seed of it (seed 0)."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    served = save_tiny_chat_model(arch, root / "served", seed=0)
    policy = save_tiny_chat_model(arch, root / "policy", seed=1)
    srv = InferenceServer(served, max_model_len=MAX_LEN, log_path=root / "vllm.log")
    start = time.monotonic()
    srv.start()
    print(f"\n{arch}: vLLM healthy after {time.monotonic() - start:.0f}s")
    yield arch, root, policy, srv
    srv.stop()


def _trainer(root, policy, behaviour: tuple[float, float], name: str, token: str) -> TrainerProcess:
    """The trainer of a run whose token is vLLM's key: the weight group admits only the run."""
    temperature, top_p = behaviour
    args = ServiceArgs(
        model_path=str(policy),
        storage_root=str(root / "runs"),
        run=name,
        train=TrainSection(),
        trainer=TrainerServiceSection(device="cpu", startup_timeout_s=300, request_timeout_s=120),
        sampling=SamplingSection(temperature=temperature, top_p=top_p),
    )
    return TrainerProcess(args, token=token, log_dir=root / name / "logs")


def _sample(url: str, prompts_ids: list[list[int]], behaviour) -> list[tuple[list[int], object]]:
    temperature, top_p = behaviour

    async def go():
        async with InferenceClient(url, timeout_s=120) as client:
            return await asyncio.gather(
                *(
                    client.complete(
                        ids,
                        n=4,
                        max_tokens=MAX_TOKENS,
                        temperature=temperature,
                        top_p=top_p,
                        seed=7,
                    )
                    for ids in prompts_ids
                )
            )

    results = asyncio.run(go())
    return [(ids, c) for ids, group in zip(prompts_ids, results, strict=True) for c in group]


def _rows(samples, name: str) -> list[dict]:
    return [
        dict(
            run=name,
            step=1,
            env="chat",
            prompt_id=str(i // 4),
            group_index=i // 4,
            sample_index=i % 4,
            prompt_text="",
            completion_text="",
            prompt_ids=ids,
            completion_ids=c.token_ids,
            completion_logprobs=c.logprobs,
            reward=0.0,
            advantage=1.0,
            version_started=1,
            version_finished=1,
            finish_reason=c.finish_reason,
            error=None,
            generate_s=0.0,
            reward_s=0.0,
            info="{}",
        )
        for i, (ids, c) in enumerate(samples)
    ]


def _hf_logprobs(model, prompt_ids, completion_ids, temperature, top_p) -> list[float]:
    """transformers' log-probs of the completion under the given sampling behaviour."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state[0]
        n = len(prompt_ids)
        hidden_N_H = hidden[n - 1 : n - 1 + len(completion_ids)]
        logp_N, _ = reference_logprobs_entropy(
            hidden_N_H,
            model.get_output_embeddings().weight,
            torch.tensor(completion_ids),
            temperature=temperature,
            top_p=top_p,
        )
    return logp_N.tolist()


def test_vllm_and_trainer_agree_after_a_weight_sync(arch_server):
    arch, root, policy, srv = arch_server
    behaviour_name = BEHAVIOUR_OF[arch]
    behaviour = BEHAVIOURS[behaviour_name]
    name = f"{arch}-{behaviour_name}"
    trainer = _trainer(root, policy, behaviour, name, token=srv.api_key)
    trainer.start()
    try:
        trainer.wait_healthy()
        join(trainer.client, [(srv.url, 1)], GroupSpec.single(), timeout_s=60)
        try:
            assert publish(trainer.client, [srv.url], 1, timeout_s=60)["version"] == 1
        finally:
            leave(trainer.client, [srv.url], timeout_s=30)

        tokenizer = AutoTokenizer.from_pretrained(policy)
        prompts_ids = [
            tokenizer(
                tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            ).input_ids
            for m in PROMPTS
        ]
        samples = _sample(srv.url, prompts_ids, behaviour)
        rows = _rows(samples, name)
        storage = RunStorage(str(root / "runs"), name)
        storage.write_step_table("batches", 1, rows_to_table(rows))
        out = trainer.client.forward(1)
        got = {
            (r["group_index"], r["sample_index"]): r["logprobs"]
            for r in storage.read_step_table("logprobs", 1).to_pylist()
        }
        assert out.num_sequences == len(rows)
    finally:
        trainer.stop(timeout_s=30)

    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    kls, diffs_raw, num_tokens = [], [], 0
    for row in rows:
        vllm_N = row["completion_logprobs"]
        trainer_N = got[(row["group_index"], row["sample_index"])]
        assert len(trainer_N) == len(vllm_N)
        for a, b in zip(trainer_N, vllm_N, strict=True):
            d = a - b
            kls.append(math.exp(d) - 1 - d)
        num_tokens += len(vllm_N)
        # The stored log-probs are the sampling policy's (tempered, nucleus-cut) ...
        hf_N = _hf_logprobs(model, row["prompt_ids"], row["completion_ids"], *behaviour)
        assert max(abs(a - b) for a, b in zip(hf_N, vllm_N, strict=True)) < 1e-3
        # ... which at T = 0.7 / top_p 0.9 are not the raw temperature-1 ones.
        raw_N = _hf_logprobs(model, row["prompt_ids"], row["completion_ids"], 1.0, 1.0)
        diffs_raw += [abs(a - b) for a, b in zip(raw_N, vllm_N, strict=True)]
    print(
        f"\n{name}: {num_tokens} tokens, per-token KL max {max(kls):.2e} mean "
        f"{sum(kls) / len(kls):.2e}; |vLLM - raw T=1| max {max(diffs_raw):.3f}"
    )
    assert num_tokens >= 3 * 4 * 2
    assert max(kls) < KL_BOUND
    if behaviour != (1.0, 1.0):
        assert max(diffs_raw) > 0.05
