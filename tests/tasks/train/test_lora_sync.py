"""A LoRA policy through the real weight plane: the trainer service (FSDP2 on 1 and 2 ranks,
DeepSpeed ZeRO-3 on 2) trains adapters for a few optimizer steps and syncs to a real vLLM server
after each one (the second as the background sync does it: captured, then sent while the trainer
takes the next step); vLLM's greedy output then equals transformers + peft running the trainer's
own adapter of that version on the base model."""

from __future__ import annotations

import pytest
import torch

from rollflow.infra.config import LoraSection, LossConfig, TrainerSection, TrainSection
from rollflow.infra.storage import RunStorage
from rollflow.tasks.sync.weights import GroupSpec, join, leave, publish
from rollflow.tasks.train.launch import TrainerProcess
from rollflow.tasks.train.lora import ADAPTER_DIR
from rollflow.tasks.train.protocol import ServiceArgs

from conftest import PROMPT_IDS
from trainer_support import make_rows, write_batch

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

STEPS, MAX_TOKENS = 3, 16


def greedy(url: str) -> tuple[list[int], list[float]]:
    """vLLM's greedy completion of the prompt: token ids and their log-probs."""
    import asyncio

    from rollflow.infra.inference.client import InferenceClient

    async def go():
        async with InferenceClient(url, timeout_s=60) as client:
            return await client.complete(PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0.0)

    (completion,) = asyncio.run(go())
    return completion.token_ids, completion.logprobs


def peft_greedy(base_dir, adapter_dir) -> tuple[list[int], list[float]]:
    """transformers + peft: the base model with the adapter, greedy, and each token's log-prob."""
    from transformers import AutoModelForCausalLM

    from rollflow.infra.models.tiny import EOS_ID

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([PROMPT_IDS]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=0,
        )[0]
        logp = model(input_ids=out[None]).logits[0, :-1].float().log_softmax(-1)
    tokens = out[len(PROMPT_IDS) :]
    return tokens.tolist(), logp[len(PROMPT_IDS) - 1 :].gather(-1, tokens[:, None])[:, 0].tolist()


@pytest.mark.parametrize(
    ("backend", "zero_stage", "num_ranks"),
    # (one FSDP2 rank runs in tests/flows/test_run.py's LoRA run, which syncs every step; the
    # greedy equality is checked here, on the sharded cases, to keep the suite short)
    [("fsdp2", None, 2), ("deepspeed", 3, 2)],
    ids=["fsdp2-2", "zero3-2"],
)
def test_vllm_serves_the_trainers_adapter_after_every_sync(
    vllm_server, vllm_model_dirs, tmp_path, backend, zero_stage, num_ranks
):
    base = vllm_model_dirs[0]  # what the server serves at the start
    storage = RunStorage(str(tmp_path / "runs"), "lora")
    for step in range(1, STEPS + 1):
        rows = make_rows(16, seed=step, step=step, max_completion=12)
        for r in rows:  # no EOS: training would teach the policy to stop at once
            r["completion_ids"] = r["completion_ids"][:-1] or [5]
            r["completion_logprobs"] = r["completion_logprobs"][: len(r["completion_ids"])]
        write_batch(storage, step, rows)
    args = ServiceArgs(
        model_path=str(base),
        storage_root=str(tmp_path / "runs"),
        run="lora",
        train=TrainSection(
            lr=2e-2,
            lora=LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"]),
        ),
        trainer=TrainerSection(
            backend=backend,
            zero_stage=zero_stage,
            num_ranks=num_ranks,
            device="cpu",
            startup_timeout_s=600,
        ),
    )
    # The run's token is vLLM's key: the weight group admits only this trainer.
    proc = TrainerProcess(args, token=vllm_server.api_key, log_dir=tmp_path / "logs")
    proc.start()
    client = proc.client
    url = vllm_server.url
    served = [greedy(url)]
    try:
        proc.wait_healthy()
        join(client, [(url, 1)], GroupSpec.single(), timeout_s=60)
        try:
            trained = 0
            for step in range(1, STEPS + 1):
                while trained < step:
                    trained += 1
                    client.forward_backward(trained, loss=LossConfig())
                    client.optim_step()
                export = tmp_path / f"export-{step}"
                client.export_hf(str(export))  # the adapter of this version
                if step == 2:  # background sync: capture, train on, then send the capture (vLLM
                    # must then equal this export, not the weights of the step trained since)
                    client.weights_capture(step)
                    trained += 1
                    client.forward_backward(trained, loss=LossConfig())
                    client.optim_step()
                stats = publish(client, [url], step, timeout_s=60)
                served.append(greedy(url))
                tokens, logprobs = peft_greedy(base, export / ADAPTER_DIR)
                assert served[-1][0] == tokens, f"step {step}: vLLM {served[-1]} != peft {tokens}"
                assert served[-1][1] == pytest.approx(logprobs, abs=1e-4)
                print(f"\nstep {step}: synced {stats['bytes']} bytes in {stats}, greedy {tokens}")
        finally:
            leave(client, [url], timeout_s=10)
    finally:
        proc.stop(timeout_s=30)
    assert len({tuple(t) for t, _ in served}) > 1, "training never changed vLLM's greedy output"
