"""A vLLM server's start on CPU, two ways alternating: its engine core forked from the API server
against spawned, or, on a host whose vLLM cache is empty, its model's class inspected in the API
server's process against in a fresh interpreter.

    .venv/bin/python bench/vllm_start.py                        # fork / spawn, 3 starts of each
    .venv/bin/python bench/vllm_start.py --starts 5
    .venv/bin/python bench/vllm_start.py --compare inspect      # in-process / subprocess

Each start is rollflow's own ``InferenceServer`` on the tiny char Llama, measured from spawn to
``/health`` answering; then every process of the server is read from ``/proc`` for its CPU
seconds (API server, engine core, and the children the API server ran and waited for), and the
server is stopped.

- ``fork``: what rollflow runs (``ROLLFLOW_VLLM_FORK_ENGINE=1``, set by the server for one rank
  on CPU, inference/plugin.py); ``spawn`` sets it to 0: vLLM's own CPU default, a second
  interpreter that imports vLLM again.
- ``inspect``: every start gets an empty ``VLLM_CACHE_ROOT``, as a new node or a new user's
  machine has; ``in-process`` is what rollflow runs (``ROLLFLOW_VLLM_INSPECT_IN_PROCESS=1``),
  ``subprocess`` sets it to 0: vLLM's own way, a fresh interpreter that imports vLLM again to
  inspect the model's class.

The two alternate, so that the machine's load falls on both alike; medians are printed with the
ratio of the first to the second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollflow.inference.protocol import FORK_ENGINE_ENV, INSPECT_IN_PROCESS_ENV  # noqa: E402
from rollflow.services.vllm_server import InferenceServer  # noqa: E402

from machine import alternate, tiny_char_llama  # noqa: E402 (this folder's)

MODES = {
    "fork": (("fork", {FORK_ENGINE_ENV: "1"}), ("spawn", {FORK_ENGINE_ENV: "0"})),
    "inspect": (
        ("in-process", {INSPECT_IN_PROCESS_ENV: "1"}),
        ("subprocess", {INSPECT_IN_PROCESS_ENV: "0"}),
    ),
}


def one_start(model: Path, env: dict[str, str], folder: Path, fresh_cache: bool) -> dict:
    if fresh_cache:
        env = {**env, "VLLM_CACHE_ROOT": str(folder / "vllm-cache")}
    server = InferenceServer(model, max_model_len=64, log_path=folder / "vllm.log", extra_env=env)
    start = time.monotonic()
    server.start()
    ready_s = time.monotonic() - start
    cpu = {"api": 0.0, "engine": 0.0, "children": 0.0}
    for pid in server.pids():
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        kind = "engine" if proc.name().startswith("VLLM::EngineCore") else "api"
        cpu[kind] += times.user + times.system
        if kind == "api":  # the finished children it waited for (vLLM's inspection)
            cpu["children"] += times.children_user + times.children_system
    server.stop()
    return {"ready_s": ready_s, **{f"{k}_cpu_s": v for k, v in cpu.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=3, help="starts of each mode")
    parser.add_argument("--compare", choices=sorted(MODES), default="fork")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rollflow-vllm-start-"))
    model = tiny_char_llama(root)
    (first, first_env), (second, second_env) = MODES[args.compare]
    envs = {first: first_env, second: second_env}

    def total(r: dict[str, float]) -> float:
        return r["api_cpu_s"] + r["engine_cpu_s"] + r["children_cpu_s"]

    def say(mode: str, i: int, r: dict[str, float]) -> None:
        print(
            f"{mode:10s} #{i + 1}: ready {r['ready_s']:.1f} s, CPU API server "
            f"{r['api_cpu_s']:.1f} s + engine core {r['engine_cpu_s']:.1f} s + children "
            f"{r['children_cpu_s']:.1f} s",
            flush=True,
        )

    def start(mode: str, i: int) -> dict:
        folder = root / f"{mode}-{i}"
        folder.mkdir()
        return one_start(model, envs[mode], folder, fresh_cache=args.compare == "inspect")

    med = alternate((first, second), args.starts, start, say)
    for mode, m in med.items():
        print(f"{mode:10s} median: ready {m['ready_s']:.1f} s, CPU {total(m):.1f} s")
    a, b = med[first], med[second]
    print(
        f"{first} / {second}: ready {a['ready_s'] / b['ready_s']:.2f}x, "
        f"CPU {total(a) / total(b):.2f}x"
    )


if __name__ == "__main__":
    main()
