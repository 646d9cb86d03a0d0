"""The rollout producer's event-loop lag with 256 and 1024 rollouts in flight (goal: p99 ≤ 10 ms).

    .venv/bin/python bench/event_loop.py                                   # ~4 min
    .venv/bin/python bench/event_loop.py --latency-s 0.25 --jitter-s 0.25  # stress: 4x the request rate
    .venv/bin/python bench/event_loop.py --rollouts 1024 --group-sizes 1 --measure-s 10 --profile

What runs, as in a real run-flow process:

- the fake OpenAI server (``rollflow.testing.fake_openai``) in a separate process, so that it
  does not share the producer's GIL, answering each request after ``--latency-s`` plus a uniform
  ``0..--jitter-s`` (defaults 1 + U(0, 2) s, mean 2 s: a GPU vLLM serving hundreds of sequences
  of a few hundred tokens; the jitter keeps answers from arriving in lockstep);
- per setting, a fresh child process holding a ``RolloutProducer`` on its own loop thread (as
  ``ProducerHost`` does, heap frozen as it does) that drives the real path: ``group_runner`` →
  ``SingleTurnEnv`` (``sort_letters``) → ``Sampler`` → ``InferenceClient``, with the quickstart's
  character tokenizer, rewards in a worker thread;
- a consumer thread doing what the generate task does: ``take(step)``, the rows of the step
  (``to_rows`` + ``rows_to_table``), then ``set_version(step)`` at once (no training), so the
  producer keeps ``K = rollouts / group_size`` groups in flight
  (``train_batch_size = K / 4``, ``max_staleness = 3``).

Figures, over the measuring window after a warm-up:

- lag p50/p99/max: the producer's own figure (``RolloutProducer.snapshot``: how late a 100 ms
  sleep wakes up, sampled at 10 Hz). "lag samples got / expected" below expected means the loop
  stood still for whole sampling periods;
- baseline: the same loop with nothing to do (an exhausted prompt source), in the same run: the
  lag the machine itself imposes (scheduling on a shared machine); "p99 vs idle" is the ratio;
- loop CPU per rollout, loop thread busy, and the CPU time of the longest loop iterations: what
  our code puts on the loop, nearly independent of how loaded the machine is.

``group size 1`` sends one request per rollout (as multi-turn envs do); ``16`` is the quickstart
(one request with ``n = 16`` per group). The client opens at most 256 connections
(``InferenceClient(max_connections=256)``), so at 1024 single-request rollouts 768 wait in the
client's queue. ``--profile`` adds the top functions of the loop thread (cProfile on the thread's
CPU clock, by own time) for each setting.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # this tree's rollflow, and machine.py

from machine import Machine, table  # noqa: E402


def child(setting: dict) -> dict:
    """One setting in this (fresh) process; returns its figures."""
    import psutil

    from rollflow.infra.config import load_config
    from rollflow.infra.models.tiny import build_char_tokenizer
    from rollflow.infra.schema import rows_to_table
    from rollflow.infra.vllm_fleet.client import InferenceClient
    from rollflow.tasks.generate.generate_task import build_envs, make_rollout_context
    from rollflow.tasks.generate.host import freeze_heap, unfreeze_heap
    from rollflow.tasks.generate.producer import RolloutProducer, prompt_stream
    from rollflow.tasks.generate.rollouts import SamplingStats, group_runner, to_rows

    rollouts, group_size = setting["rollouts"], setting["group_size"]
    idle = rollouts == 0
    groups_in_flight = max(4, rollouts // group_size)
    batch = groups_in_flight // 4
    cfg = load_config(
        ROOT / "configs/quickstart.toml",
        [
            f"sampling.group_size={max(2, group_size)}",
            "sampling.max_tokens=8",
            "train.max_staleness=3",
            f"train.train_batch_size={batch}",
            f"train.mini_batch_size={batch}",
        ],
    )
    tok_dir = tempfile.mkdtemp(prefix="rollflow-bench-tok-")
    build_char_tokenizer(cfg.model.tiny.alphabet).save_pretrained(tok_dir)
    envs = build_envs(cfg)

    loop = asyncio.new_event_loop()
    iteration_cpu_s: list[float] = []  # thread CPU of each loop iteration in the window
    run_once = loop._run_once

    def timed_run_once() -> None:  # what one iteration costs, whatever else runs on the machine
        start = time.thread_time()
        run_once()
        if window_open.is_set():
            iteration_cpu_s.append(time.thread_time() - start)

    window_open = threading.Event()
    loop._run_once = timed_run_once
    threading.Thread(target=loop.run_forever, name="rollout-producer", daemon=True).start()

    def on_loop(coro, timeout_s: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    async def build():
        client = InferenceClient(setting["url"], timeout_s=cfg.inference.request_timeout_s)
        ctx = make_rollout_context(cfg, tok_dir, client, SamplingStats(), temperature=1.0)
        prompts = iter(()) if idle else prompt_stream(envs, {"sort_letters": 1.0}, batch, seed=0)
        producer = RolloutProducer(
            group_runner(envs, ctx, group_size),
            prompts,
            train_batch_size=batch,
            max_staleness=3,
            max_in_flight=groups_in_flight,
            lag_interval_s=setting["lag_interval_s"],
        )
        producer.start()
        return client, producer

    async def snapshot():
        return producer.snapshot()

    async def loop_cpu_s() -> float:
        return time.thread_time()  # the CPU time of the loop thread itself

    client, producer = on_loop(build())
    freeze_heap()  # as ProducerHost does once its producer runs
    done = {"rollouts": 0, "in_flight": [], "stop": False}

    def consume() -> None:  # what the generate task does with each step's groups
        step = 0
        while not done["stop"] and not idle:
            step += 1
            try:
                groups = on_loop(producer.take(step, timeout_s=30), timeout_s=40)
            except Exception:  # TimeoutError or the producer finished: the window is over
                return
            rows = to_rows(
                "bench",
                step,
                [g.prompt for g in groups],
                [g.result for g in groups],
                group_size,
                [(g.version_started, g.version_finished) for g in groups],
            )
            rows_to_table(rows)
            loop.call_soon_threadsafe(producer.set_version, step)
            done["rollouts"] += len(rows)
            done["in_flight"].append(len(producer._tasks))

    threading.Thread(target=consume, name="generate-task", daemon=True).start()
    # Timed by the loop thread's own CPU clock: what the loop spends, not what it waits for.
    profiler = cProfile.Profile(time.thread_time) if setting["profile"] else None
    proc = psutil.Process()
    time.sleep(setting["warmup_s"])
    # The warm-up (connections, first tokenizer calls) is not measured. Not waited for: a loop
    # stuck in one long callback would hold the window's start back.
    loop.call_soon_threadsafe(producer._lags_s.clear)
    window_open.set()
    if profiler:
        loop.call_soon_threadsafe(profiler.enable)  # profiles the thread that enables it
    cpu0, t0, rollouts0, in_flight0 = (
        sum(proc.cpu_times()[:2]),
        time.monotonic(),
        done["rollouts"],
        len(done["in_flight"]),
    )
    loop_cpu0 = on_loop(loop_cpu_s())
    time.sleep(setting["measure_s"])
    elapsed, cpu = time.monotonic() - t0, sum(proc.cpu_times()[:2]) - cpu0
    loop_cpu = on_loop(loop_cpu_s()) - loop_cpu0
    window_open.clear()
    iterations = sorted(iteration_cpu_s)
    rollouts_done, in_flight = done["rollouts"] - rollouts0, done["in_flight"][in_flight0:]
    done["stop"] = True
    if profiler:
        loop.call_soon_threadsafe(profiler.disable)
    snap = on_loop(snapshot())
    on_loop(producer.finish())
    on_loop(client.aclose())
    unfreeze_heap()
    result = {
        **setting,
        "lag_p50_s": snap["loop_lag_p50_s"],
        "lag_p99_s": snap["loop_lag_p99_s"],
        "lag_max_s": snap["loop_lag_max_s"],
        "num_lag_samples": len(producer._lags_s),
        "num_lag_expected": int(setting["measure_s"] / setting["lag_interval_s"]),
        "rollouts_per_s": rollouts_done / elapsed,
        "cpu_cores": cpu / elapsed,
        "iteration_cpu_p99_s": iterations[int(0.99 * (len(iterations) - 1))] if iterations else 0.0,
        "iteration_cpu_max_s": iterations[-1] if iterations else 0.0,
        "loop_busy": loop_cpu / elapsed,
        "loop_cpu_per_rollout_s": loop_cpu / max(1, rollouts_done),
        "groups_in_flight_mean": sum(in_flight) / len(in_flight) if in_flight else float("nan"),
        "groups_in_flight_target": 0 if idle else groups_in_flight,
    }
    if profiler:
        time.sleep(0.2)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        result["profile_text"] = out.getvalue()
    return result


def start_fake_server(latency_s: float, jitter_s: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollflow.testing.fake_openai",
            "--port",
            "0",
            "--latency-s",
            str(latency_s),
            "--latency-jitter-s",
            str(jitter_s),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    match = re.search(r"(http://\S+)", line)
    if not match:
        proc.kill()
        sys.exit(f"the fake OpenAI server did not start: {line!r}")
    return proc, match.group(1)


def run_setting(setting: dict) -> dict:
    deadline_s = setting["warmup_s"] + setting["measure_s"] + 120
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(setting)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=deadline_s,
    )
    if proc.returncode:
        sys.exit(f"setting {setting} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--latency-s", type=float, default=1.0)
    parser.add_argument("--jitter-s", type=float, default=2.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--measure-s", type=float, default=30.0)
    parser.add_argument("--lag-interval-s", type=float, default=0.1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    machine = Machine()
    server, url = start_fake_server(args.latency_s, args.jitter_s)
    try:
        common = {
            "url": url,
            "warmup_s": args.warmup_s,
            "measure_s": args.measure_s,
            "lag_interval_s": args.lag_interval_s,
            "profile": args.profile,
        }
        results = [run_setting({**common, "rollouts": 0, "group_size": 1, "profile": False})]
        for rollouts in args.rollouts:
            for g in args.group_sizes:
                results.append(run_setting({**common, "rollouts": rollouts, "group_size": g}))
                print(f"{rollouts} rollouts, group size {g}: done", file=sys.stderr, flush=True)
    finally:
        server.kill()
        server.wait()

    base = results[0]
    ms = lambda s: f"{s * 1000:.1f}"  # noqa: E731
    rows = []
    for r in results:
        name = "idle loop (baseline)" if r["rollouts"] == 0 else f"{r['rollouts']}"
        rows.append(
            [
                name,
                "–" if not r["rollouts"] else r["group_size"],
                "–"
                if not r["rollouts"]
                else f"{r['groups_in_flight_mean']:.0f} / {r['groups_in_flight_target']}",
                ms(r["lag_p50_s"]),
                ms(r["lag_p99_s"]),
                ms(r["lag_max_s"]),
                f"{r['lag_p99_s'] / max(base['lag_p99_s'], 1e-4):.1f}×",
                "ok" if r["lag_p99_s"] <= 0.010 else "MISSED",
                f"{r['rollouts_per_s']:.0f}",
                "–" if not r["rollouts"] else f"{r['loop_cpu_per_rollout_s'] * 1000:.2f}",
                f"{r['loop_busy']:.0%}",
                f"{ms(r['iteration_cpu_p99_s'])} / {ms(r['iteration_cpu_max_s'])}",
                f"{r['cpu_cores']:.2f}",
                f"{r['num_lag_samples']} / {r['num_lag_expected']}",
            ]
        )
    print(
        f"\nproducer event-loop lag; fake server latency {args.latency_s} s + U(0, {args.jitter_s}) s "
        f"in its own process; {args.measure_s:.0f} s measured after {args.warmup_s:.0f} s warm-up"
    )
    print(machine.line() + "\n")
    print(
        table(
            [
                "rollouts in flight",
                "group size",
                "groups in flight (mean / K)",
                "lag p50 ms",
                "lag p99 ms",
                "lag max ms",
                "p99 vs idle",
                "p99 ≤ 10 ms",
                "rollouts/s",
                "loop CPU ms/rollout",
                "loop thread CPU busy",
                "iteration CPU p99 / max ms",
                "process CPU cores",
                "lag samples (got / expected)",
            ],
            rows,
        )
    )
    for r in results:
        if "profile_text" in r:
            print(
                f"\n### profile of the loop thread: {r['rollouts']} rollouts, group size {r['group_size']}\n"
            )
            print(r["profile_text"])


if __name__ == "__main__":
    main()
