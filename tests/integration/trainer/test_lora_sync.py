"""A LoRA policy through the real weight plane: the trainer service (FSDP2 on 2 ranks, DeepSpeed
ZeRO-3 on 2) trains adapters for a few optimizer steps and syncs to a real vLLM server after each
one (the second as the background sync does it: captured, then sent while the trainer takes the
next step); vLLM's greedy output then equals transformers + peft running the trainer's own adapter
of that version on the base model. With ``train.lora.sync = "adapter"`` (FSDP2 on 2 ranks) vLLM
serves the adapter itself, each sync carries the adapter's bytes only, and a restarted server
comes back serving the last version."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rollflow.infra.config import LoraSection, LossConfig, TrainerServiceSection, TrainSection
from rollflow.infra.errors import ConfigError
from rollflow.infra.export import ADAPTER as ADAPTER_DIR
from rollflow.infra.storage import RunStorage
from rollflow.services.trainer_process import TrainerProcess
from rollflow.services.vllm_server import InferenceServer
from rollflow.services.zero_adapter import write_zero_adapter
from rollflow.tasks.sync.weights import GroupSpec, join, leave, publish, rejoin
from rollflow.trainer.protocol import ServiceArgs

from conftest import PROMPT_IDS, VLLM_MAX_LEN, restore_weights
from trainer_support import make_rows, write_batch

peft = pytest.importorskip("peft")
# The merged case takes the session's vllm_server by name (getfixturevalue): joins its group.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_server")]

STEPS, MAX_TOKENS = 3, 16
LORA = LoraSection(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])


@pytest.fixture(scope="module")
def vllm_adapter_server(vllm_model_dirs, tmp_path_factory):
    """A real vLLM server serving the first of ``vllm_model_dirs`` with a zero adapter as the
    policy (``train.lora.sync = "adapter"``), per module."""
    root = tmp_path_factory.mktemp("adapter-server")
    initial = write_zero_adapter(root / "v0", vllm_model_dirs[0], LORA)  # as a run writes it
    srv = InferenceServer(
        vllm_model_dirs[0],
        max_model_len=VLLM_MAX_LEN,
        lora_adapter=initial,
        log_path=root / "vllm.log",
    )
    srv.start()
    yield srv
    srv.stop()


def test_a_zero_adapter_that_fits_no_layer_is_a_config_error(vllm_model_dirs, tmp_path):
    """Written by a child process (the run loads no trainer code): its config error comes back
    as one, naming the child's log."""
    nowhere = LORA.model_copy(update={"target_modules": ["no_such_proj"]})
    with pytest.raises(ConfigError, match=r"matched no linear layer.*see .*bad\.log"):
        write_zero_adapter(tmp_path / "bad", vllm_model_dirs[0], nowhere)


def greedy(url: str) -> tuple[list[int], list[float]]:
    """vLLM's greedy completion of the prompt: token ids and their log-probs."""
    import asyncio

    from rollflow.infra.vllm_fleet.client import InferenceClient

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
    ("backend", "zero_stage", "num_ranks", "sync"),
    # (one FSDP2 rank runs in tests/integration/flows/test_run.py's LoRA run, which syncs every step; the
    # greedy equality is checked here, on the sharded cases, to keep the suite short)
    [("fsdp2", None, 2, "merged"), ("deepspeed", 3, 2, "merged"), ("fsdp2", None, 2, "adapter")],
    ids=["fsdp2-2", "zero3-2", "fsdp2-2-adapter"],
)
def test_vllm_serves_the_trainers_adapter_after_every_sync(
    request, vllm_model_dirs, tmp_path, backend, zero_stage, num_ranks, sync
):
    server = request.getfixturevalue("vllm_server" if sync == "merged" else "vllm_adapter_server")
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
        train=TrainSection(lr=2e-2, lora=LORA.model_copy(update={"sync": sync})),
        trainer=TrainerServiceSection(
            backend=backend,
            zero_stage=zero_stage,
            num_ranks=num_ranks,
            device="cpu",
            startup_timeout_s=600,
        ),
    )
    # The run's token is vLLM's key: the weight group admits only this trainer.
    proc = TrainerProcess(args, token=server.api_key, log_dir=tmp_path / "logs")
    proc.start()
    client = proc.client
    url = server.url
    served = [greedy(url)]
    if sync == "adapter":  # the zero adapter served before the first sync: the base model
        assert served[0][0] == peft_greedy(base, server.lora_adapter)[0]
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
                if sync == "adapter":  # the adapter's bytes (64-byte aligned) and a 16-byte header
                    adapter = load_file(export / ADAPTER_DIR / "adapter_model.safetensors")
                    num_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
                    assert num_bytes < stats["bytes"] <= num_bytes + 64 * len(adapter) + 16
            if sync == "adapter":  # a restarted server starts from its first adapter; the
                # re-join gives it the last version, as the supervisor's restart does
                client.end_step(STEPS)  # the trainer's weights are now those of step STEPS
                server.stop()
                server.start()
                assert rejoin(client, [(url, 1)], GroupSpec.single(), 60, 60) == STEPS
                export = tmp_path / "export-last"
                client.export_hf(str(export))
                assert greedy(url)[0] == peft_greedy(base, export / ADAPTER_DIR)[0]
        finally:
            leave(client, [url], timeout_s=10)
    finally:
        proc.stop(timeout_s=30)
        if sync == "merged":  # the session's server: back to the policy the other tests expect
            restore_weights(server, base)
    assert len({tuple(t) for t, _ in served}) > 1, "training never changed vLLM's greedy output"
