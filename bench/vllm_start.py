"""A vLLM server's start on CPU: its engine core forked from the API server against spawned.

    .venv/bin/python bench/vllm_start.py              # 3 starts of each, alternating
    .venv/bin/python bench/vllm_start.py --starts 5

Each start is rollflow's own ``InferenceServer`` on the tiny char Llama, measured from spawn to
``/health`` answering; then every process of the server is read from ``/proc`` for its CPU
seconds (API server, engine core), and the server is stopped. "fork" is what rollflow runs
(``ROLLFLOW_VLLM_FORK_ENGINE=1``, set by the server for one rank on CPU, inference/plugin.py);
"spawn" sets it to 0: vLLM's own CPU default, a second interpreter that imports vLLM again.
The two alternate, so that the machine's load falls on both alike; medians are printed with the
ratio fork / spawn.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflow.inference.protocol import FORK_ENGINE_ENV  # noqa: E402
from rollflow.services.vllm_server import InferenceServer  # noqa: E402

from machine import alternate, tiny_char_llama  # noqa: E402 (this folder's)


def one_start(model: Path, mode: str, log: Path) -> dict[str, float]:
    server = InferenceServer(
        model,
        max_model_len=64,
        log_path=log,
        extra_env={FORK_ENGINE_ENV: "1" if mode == "fork" else "0"},
    )
    start = time.monotonic()
    server.start()
    ready_s = time.monotonic() - start
    cpu = {"api": 0.0, "engine": 0.0}
    for pid in server.pids():
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        kind = "engine" if proc.name().startswith("VLLM::EngineCore") else "api"
        cpu[kind] += times.user + times.system
    server.stop()
    return {"ready_s": ready_s, "api_cpu_s": cpu["api"], "engine_cpu_s": cpu["engine"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=3, help="starts of each mode")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rollflow-vllm-start-"))
    model = tiny_char_llama(root)

    def say(mode: str, i: int, r: dict[str, float]) -> None:
        print(
            f"{mode:5s} #{i + 1}: ready {r['ready_s']:.1f} s, CPU API server "
            f"{r['api_cpu_s']:.1f} s + engine core {r['engine_cpu_s']:.1f} s",
            flush=True,
        )

    med = alternate(
        ("fork", "spawn"),
        args.starts,
        lambda mode, i: one_start(model, mode, root / f"vllm-{mode}-{i}.log"),
        say,
    )
    for mode, m in med.items():
        total = m["api_cpu_s"] + m["engine_cpu_s"]
        print(f"{mode:5s} median: ready {m['ready_s']:.1f} s, CPU {total:.1f} s")
    f, s = med["fork"], med["spawn"]
    cpu_ratio = (f["api_cpu_s"] + f["engine_cpu_s"]) / (s["api_cpu_s"] + s["engine_cpu_s"])
    print(f"fork / spawn: ready {f['ready_s'] / s['ready_s']:.2f}x, CPU {cpu_ratio:.2f}x")


if __name__ == "__main__":
    main()
