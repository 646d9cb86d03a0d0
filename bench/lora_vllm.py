"""vLLM's runtime LoRA loading through its API: does a load inside rollflow's pause(keep) → load →
reset prefix cache → resume work, what does it cost, and how much slower does vLLM generate
through an adapter than with merged weights? (``train.lora.sync = "adapter"`` loads the adapter
in the workers instead of through ``/v1/load_lora_adapter``: docs/lora.md says why.)

    .venv/bin/python bench/lora_vllm.py            # ~3 min on 2 cores

One tiny Llama (hidden 256, 4 layers) and two rank-8 adapters on every projection (random B, so
they change the output). Server A serves the base as ``base`` and the adapter as ``policy``
(``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); server B serves peft's merge of the same
adapter. Measured:

- a load of the second adapter (a new path, ``load_inplace``) between pause(keep) and resume,
  with requests in flight: seconds, and whether greedy output then equals transformers + peft;
- generation of 32 prompts x 24 tokens (temperature 1), through the adapter (A) and merged (B),
  best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

from rollflow.inference import protocol  # noqa: E402
from rollflow.infra.config import LoraSection, TinyModelSpec  # noqa: E402
from rollflow.infra.models.tiny import (  # noqa: E402
    EOS_ID,
    build_char_tokenizer,
    build_tiny_llama,
    save_hf_dir,
)
from rollflow.infra.vllm_fleet.client import InferenceClient  # noqa: E402
from rollflow.services.vllm_server import InferenceServer  # noqa: E402
from rollflow.trainer import lora  # noqa: E402

from machine import Machine, table  # noqa: E402

PROMPT_IDS = [1, 10, 11, 12, 13]
MAX_LEN = 128
CFG = LoraSection(rank=8, alpha=16.0)


def make_models(root: Path) -> tuple[Path, list[Path], Path]:
    """The base, two adapters in peft's format, and the merge of the first."""
    tok = build_char_tokenizer()
    spec = TinyModelSpec(
        hidden_size=256, intermediate_size=1024, num_layers=4, max_position_embeddings=MAX_LEN
    )
    base = save_hf_dir(build_tiny_llama(spec, len(tok)), tok, root / "base")
    adapters, merged = [], None
    for seed in (1, 2):
        model = build_tiny_llama(spec, len(tok))
        lora.apply_lora(model, CFG)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        full = model.state_dict()
        adapters.append(lora.save_adapter(root / f"adapter-{seed}", full, CFG, str(base)))
        if merged is None:
            plain = build_tiny_llama(spec, len(tok))
            plain.load_state_dict(lora.merged_state(full, CFG))
            merged = save_hf_dir(plain, tok, root / "merged")
    return base, adapters, merged


def peft_greedy(base: Path, adapter: Path, max_tokens: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([PROMPT_IDS]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=0,
        )
    return out[0, len(PROMPT_IDS) :].tolist()


async def generate_s(url: str, repeats: int) -> float:
    """Best wall time of 32 prompts x 24 tokens at temperature 1."""
    best = float("inf")
    async with InferenceClient(url, timeout_s=300) as client:
        for _ in range(repeats):
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    client.complete(PROMPT_IDS + [14 + i % 20], max_tokens=24, temperature=1.0)
                    for i in range(32)
                )
            )
            best = min(best, time.perf_counter() - start)
    return best


async def reload_in_pause(url: str, adapter: Path) -> dict:
    """pause(keep) with requests in flight → load the adapter at a new path → reset → resume."""
    async with InferenceClient(url, timeout_s=300) as client:
        flight = [
            asyncio.ensure_future(client.complete(PROMPT_IDS, max_tokens=24, temperature=1.0))
            for _ in range(8)
        ]
        await asyncio.sleep(0.2)
        start = time.perf_counter()
        await client.pause(mode="keep")
        paused = time.perf_counter()
        body = {"lora_name": "policy", "lora_path": str(adapter), "load_inplace": True}
        status, answer = await client._send(protocol.LOAD_LORA_ADAPTER, body, None, 120)
        if status != 200:  # the answer is plain text, not JSON
            raise RuntimeError(f"load_lora_adapter: HTTP {status}: {answer[:300]!r}")
        loaded = time.perf_counter()
        await client.reset_prefix_cache()
        await client.resume()
        done = time.perf_counter()
        finished = await asyncio.gather(*flight)
        (greedy,) = await client.complete(PROMPT_IDS, max_tokens=12, temperature=0.0)
    return {
        "pause_s": paused - start,
        "load_s": loaded - paused,
        "total_s": done - start,
        "in_flight_finished": sum(len(c.token_ids) for (c,) in finished),
        "greedy": greedy.token_ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    machine = Machine()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, (first, second), merged = make_models(root)
        with_lora = InferenceServer(
            base,
            served_model_name="base",
            max_model_len=MAX_LEN,
            extra_args=["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
            + ["--lora-modules", f"policy={first}"],
            extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
            startup_timeout_s=600,
            log_path=root / "vllm-lora.log",
        )
        start = time.perf_counter()
        with_lora.start()
        lora_start_s = time.perf_counter() - start
        try:
            adapter_gen_s = asyncio.run(generate_s(with_lora.url, args.repeats))
            reload = asyncio.run(reload_in_pause(with_lora.url, second))
        except Exception:
            print((root / "vllm-lora.log").read_text()[-3000:])
            raise
        finally:
            with_lora.stop()
        expected = peft_greedy(base, second, 12)
        plain = InferenceServer(merged, max_model_len=MAX_LEN, log_path=root / "vllm.log")
        start = time.perf_counter()
        plain.start()
        plain_start_s = time.perf_counter() - start
        try:
            merged_gen_s = asyncio.run(generate_s(plain.url, args.repeats))
        finally:
            plain.stop()
    print("\nruntime LoRA loading inside pause(keep) → load → reset prefix cache → resume\n")
    print(
        table(
            ["pause ms", "load ms", "pause to resume ms", "in-flight tokens done", "greedy = peft"],
            [
                [
                    f"{reload['pause_s'] * 1000:.0f}",
                    f"{reload['load_s'] * 1000:.0f}",
                    f"{reload['total_s'] * 1000:.0f}",
                    str(reload["in_flight_finished"]),
                    f"{reload['greedy'] == expected} ({reload['greedy']} vs {expected})",
                ]
            ],
        )
    )
    print(f"\n32 prompts x 24 tokens, temperature 1, best of {args.repeats}\n")
    print(
        table(
            ["served", "server start s", "generation s"],
            [
                ["adapter (--enable-lora)", f"{lora_start_s:.0f}", f"{adapter_gen_s:.2f}"],
                ["merged weights", f"{plain_start_s:.0f}", f"{merged_gen_s:.2f}"],
            ],
        )
    )
    print(f"\nadapter / merged generation time: {adapter_gen_s / merged_gen_s:.2f}x")
    print("\n" + machine.line())


if __name__ == "__main__":
    main()
