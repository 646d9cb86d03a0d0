"""One step's wave of generation on a lone vLLM server: wall time, CPU by process, iterations.

A run's step (workload (a), the quickstart's shape) sends one wave of requests: 64 prompts with
n = 8 completions of <= 8 tokens each, all at once. This bench starts one server as a run does
(rollflow's ``InferenceServer``: the CPU build, its engine core forked, one OpenMP thread per core
it was given), sends ``--waves`` such waves, and prints per wave the median wall time, the CPU
seconds of vLLM's engine core and of its API server (``psutil``), and the engine's iterations
(vLLM's ``vllm:iteration_tokens_total`` counter; log stats are switched on for this). Offline, in
one process, the same wave took 0.27-0.29 s in 9 iterations (2026-12-06): what a server costs
over that is the serving path (docs/performance.md, "Where a step's time goes").

    .venv/bin/python bench/vllm_wave.py [--waves 30] [--batch 0,64] [--forms ids,text] [VLLM_FLAG ...]

Extra arguments are ``vllm serve`` flags, e.g. ``--max-num-batched-tokens 8192``. ``--batch``
sends the wave's prompts as lists of K per request (vLLM's batched ``/v1/completions``); several
sizes are compared wave by wave on the one server: two server starts differ by up to 0.1 s per
wave (a list of 64 looked 22% faster across two runs, and was within 2% on one server).
``--forms``: ``ids`` is the request the run sends (token ids and log-probs only, nothing
detokenized: ``inference/plugin.py``), ``text`` the same without that (vLLM's default: the text
and each log-prob's token string made too); several are compared wave by wave, like sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # this tree's rollflow, and machine.py

import aiohttp  # noqa: E402
import psutil  # noqa: E402

from machine import Machine  # noqa: E402

ITERATIONS = "vllm:iteration_tokens_total_count"


def cpu_s(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


async def main(args: argparse.Namespace, vllm_flags: list[str]) -> dict:
    from rollflow.inference.protocol import TOKEN_IDS_ONLY
    from rollflow.infra.config import TinyModelSpec
    from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama, save_hf_dir
    from rollflow.services.vllm_server import InferenceServer

    root = Path(tempfile.mkdtemp(prefix="vllm-wave-"))
    tok = build_char_tokenizer()
    spec = TinyModelSpec(hidden_size=128, num_layers=2, max_position_embeddings=64)
    model = save_hf_dir(build_tiny_llama(spec, len(tok)), tok, root / "model")
    server = InferenceServer(
        model,
        max_model_len=64,
        extra_args=["--max-num-seqs", str(args.prompts * args.n), *vllm_flags],
        log_path=root / "vllm.log",
    )
    # The iteration counter needs vLLM's stats, which rollflow's servers leave off.
    command = server.command
    server.command = lambda: [a for a in command() if a != "--disable-log-stats"]
    server.start()
    try:
        rng = random.Random(0)
        prompts = [
            tok.encode("sort " + "".join(rng.sample("abcdefgh", rng.randint(3, 5))) + "=")
            for _ in range(args.prompts)
        ]
        (api,) = [
            p
            for p in psutil.Process(server.pids()[0]).children(recursive=True)
            if p.cmdline()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        ]
        engine = api.children(recursive=True)
        headers = {"Authorization": f"Bearer {server.api_key}"}
        async with aiohttp.ClientSession(headers=headers) as http:

            async def one(ids: list[int] | list[list[int]], form: str) -> int:
                body = {
                    "model": server.served_model_name,
                    "prompt": ids,
                    "n": args.n,
                    "max_tokens": args.max_tokens,
                    "temperature": 1.0,
                    "logprobs": 0,
                    "return_token_ids": True,
                }
                if form == "ids":
                    body["vllm_xargs"] = {TOKEN_IDS_ONLY: 1}
                    body["return_tokens_as_token_ids"] = True
                async with http.post(f"{server.url}/v1/completions", json=body) as r:
                    data = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"/v1/completions answered {r.status}: {data}")
                    return sum(len(c["token_ids"]) for c in data["choices"])

            async def iterations() -> float:
                async with http.get(f"{server.url}/metrics") as r:
                    text = await r.text()
                return sum(
                    float(x.split()[-1]) for x in text.splitlines() if x.startswith(ITERATIONS)
                )

            def requests(k: int) -> list:
                return [prompts[i : i + k] for i in range(0, len(prompts), k)] if k else prompts

            variants = [(k, form) for k in args.batch for form in args.forms]
            for _ in range(3):  # warm-up
                for k, form in variants:
                    await asyncio.gather(*(one(p, form) for p in requests(k)))
            # Each variant in turn, wave by wave, on the one server: the server's start and the
            # host's load vary more between runs than the variants do.
            walls = {v: [] for v in variants}
            cpu = {v: [0.0, 0.0, 0.0] for v in variants}  # iterations, engine, API server
            tokens = {v: 0 for v in variants}
            for _ in range(args.waves):
                for v in variants:
                    k, form = v
                    it0, e0, a0 = await iterations(), cpu_s(engine), cpu_s([api])
                    start = time.perf_counter()
                    tokens[v] += sum(await asyncio.gather(*(one(p, form) for p in requests(k))))
                    walls[v].append(time.perf_counter() - start)
                    it1, e1, a1 = await iterations(), cpu_s(engine), cpu_s([api])
                    for i, d in enumerate((it1 - it0, e1 - e0, a1 - a0)):
                        cpu[v][i] += d
        return {
            "vllm_flags": vllm_flags,
            "by_prompts_per_request_and_form": {
                f"{k or 1} {form}": {
                    "wave_s_median": round(statistics.median(walls[(k, form)]), 3),
                    "wave_s_min": round(min(walls[(k, form)]), 3),
                    "engine_cpu_s_per_wave": round(cpu[(k, form)][1] / args.waves, 3),
                    "api_server_cpu_s_per_wave": round(cpu[(k, form)][2] / args.waves, 3),
                    "iterations_per_wave": round(cpu[(k, form)][0] / args.waves, 1),
                    "tokens_per_wave": round(tokens[(k, form)] / args.waves, 1),
                }
                for k, form in variants
            },
        }
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waves", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=64, help="requests per wave")
    parser.add_argument("--n", type=int, default=8, help="completions per request")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--batch",
        type=lambda v: [int(k) for k in v.split(",")],
        default=[0],
        help="prompts per request, comma-separated to compare on one server, wave by wave "
        "(a list of prompts per request; 0: one each)",
    )
    parser.add_argument(
        "--forms",
        type=lambda v: v.split(","),
        default=["ids"],
        help="request forms, comma-separated to compare on one server, wave by wave: ids (the "
        "run's: no text made), text (vLLM's default)",
    )
    known, flags = parser.parse_known_args()
    machine = Machine()
    print(json.dumps(asyncio.run(main(known, flags))))
    print(machine.line())
