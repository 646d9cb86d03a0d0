"""A vLLM server's first sampling requests on CPU: torch.compile on against off, the inductor
cache empty or warm.

    .venv/bin/python bench/vllm_first_request.py              # 2 starts of each, alternating
    .venv/bin/python bench/vllm_first_request.py --starts 3

Each start is rollflow's own ``InferenceServer`` on the tiny char Llama; once it answers
``/health``, three waves of completions with log-probs (the run's request: 8 prompts x 4, then
16 x 4, then 8 x 8) are sent, and each wave's wall time and the server's CPU seconds over it are
read. vLLM's sampler counts each sampled token's log-prob rank in a ``torch.compile``d helper
(also under ``--enforce-eager``), which inductor builds as C++ at the first such request.

- ``eager``: ``TORCH_COMPILE_DISABLE=1``, what rollflow gives a server on CPU;
- ``compile-cold``: compile on, an empty ``TORCHINDUCTOR_CACHE_DIR`` (a new machine, a fresh node);
- ``compile-warm``: compile on, one cache shared by the starts, filled by one start first.

The modes alternate, so that the machine's load falls on each alike; medians are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflow.infra.vllm_fleet.client import InferenceClient  # noqa: E402
from rollflow.services.vllm_server import InferenceServer  # noqa: E402

from machine import alternate, tiny_char_llama  # noqa: E402 (this folder's)

WAVES = ((8, 4), (16, 4), (8, 8))  # prompts x samples each


def _server_cpu_s(server: InferenceServer) -> float:
    total = 0.0
    for pid in server.pids():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


async def _waves(server: InferenceServer) -> list[tuple[float, float]]:
    out = []
    async with InferenceClient(server.url, timeout_s=300) as client:
        for prompts, n in WAVES:
            cpu, start = _server_cpu_s(server), time.monotonic()
            await asyncio.gather(
                *(
                    client.complete([1, 2, 3 + i], n=n, max_tokens=6, temperature=1.0)
                    for i in range(prompts)
                )
            )
            out.append((time.monotonic() - start, _server_cpu_s(server) - cpu))
    return out


def one_start(model: Path, env: dict[str, str], log: Path) -> dict[str, float]:
    server = InferenceServer(model, max_model_len=64, log_path=log, extra_env=env)
    server.start()
    try:
        waves = asyncio.run(_waves(server))
    finally:
        server.stop()
    return {
        "first_s": waves[0][0],
        "first_cpu_s": waves[0][1],
        "later_s": max(w[0] for w in waves[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=2, help="starts of each mode")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rollflow-vllm-first-"))
    model = tiny_char_llama(root)
    warm = root / "inductor-warm"

    def env_of(mode: str) -> dict[str, str]:
        if mode == "eager":
            return {"TORCH_COMPILE_DISABLE": "1"}
        cache = warm if mode == "compile-warm" else Path(tempfile.mkdtemp(dir=root))
        return {"TORCH_COMPILE_DISABLE": "0", "TORCHINDUCTOR_CACHE_DIR": str(cache)}

    one_start(model, env_of("compile-warm"), root / "vllm-fill.log")  # fills the warm cache

    def say(mode: str, i: int, r: dict[str, float]) -> None:
        print(
            f"{mode:12s} #{i + 1}: first request {r['first_s']:.2f} s ({r['first_cpu_s']:.2f} s "
            f"of the server's CPU), later ones at most {r['later_s']:.2f} s",
            flush=True,
        )

    modes = ("eager", "compile-cold", "compile-warm")
    med = alternate(
        modes,
        args.starts,
        lambda mode, i: one_start(model, env_of(mode), root / f"vllm-{mode}-{i}.log"),
        say,
    )
    for mode in modes:
        m = med[mode]
        print(f"{mode:12s} median: first request {m['first_s']:.2f} s, later {m['later_s']:.2f} s")


if __name__ == "__main__":
    main()
