"""Tokens/s generated through the rollout producer against a plain client loop on the same vLLM.

    .venv/bin/python bench/producer_throughput.py                    # ~20 min on 2 cores (--profile: 23)
    .venv/bin/python bench/producer_throughput.py --levels 256 --group-sizes 16 --rounds 1
    .venv/bin/python bench/producer_throughput.py --fake-server --levels 64 --measure-s 3  # checks the code; no figures

One vLLM server (rollflow's ``InferenceServer``, the CPU build) serves a tiny character Llama built
here (nothing is downloaded): the quickstart's shape (0.4M parameters), random weights, up to
``--max-tokens`` 64 per completion (the eos token ends one at ~1/50 per token: ~36 tokens on
average), ``--max-num-seqs`` at the highest level (vLLM's CPU default of 128 would queue the rest
inside vLLM, for both sides alike). At this size a token costs vLLM's scheduler, model runner and
API server far more than its matmuls, and nothing else runs: vLLM is the bottleneck, so any CPU
the client side takes from the 2 cores shows as tokens lost.

For each level N (sequences generating at once) and group size G, two phases alternate on the
server (a b a b ... over ``--rounds``), so that load from elsewhere falls on both alike:

(a) the baseline: a plain asyncio loop (aiohttp, no connection limit) keeping N / G requests of
    ``n = G`` in flight, each the body rollflow sends (token-id prompt, temperature 1,
    ``max_tokens``, ``logprobs = 0``, ``return_token_ids``), prompts from the producer's own
    stream (``prompt_stream``, sort_letters), tokenised before the phase;
(b) the producer through its real entry points: ``ProducerHost`` (its loop thread, the
    ``InferencePool`` client, ``Sampler`` with retries, ``SingleTurnEnv``: tokenising, decoding and
    scoring in worker threads) and the generate task's body (``generate.fn``: take the step's
    groups, rows, Parquet written and committed to a local run storage), then ``set_version(step)``
    at once (no trainer). K = N / G groups in flight, B = K / 2 groups a step, ``max_staleness``
    3: admission is checked for every group, with room for K + B (K while a step is written), so
    that it holds nothing back as long as the step's writer keeps up (``blocked`` says whether it
    did). A producer with more than 256 requests in flight holds the rest in its client
    (``InferenceClient(max_connections=256)``): "in flight" counts those sent.

Each phase runs ``--warmup-s``, then measures for ``--measure-s`` (both × N / 256 above 256: a
wave of 1024 sequences of up to 64 tokens takes that much longer). Tokens/s: the completion tokens
of the groups that finished inside the window, over its length: (a) each answer as it arrives,
(b) each group as the producer stamped it finished, counted once a step has committed it to
Parquet (the phase goes on until a step holds a group finished after the window: first finished,
first out, so every group of the window is then committed). A writer that falls behind shows as
fewer groups finished, through admission (``blocked``). Where the producer's time goes, over the
same window: sequences in flight (mean, client side), CPU cores of this process by thread (the
producer's loop, its worker threads, the generate task; the baseline's loop) and of vLLM, the
admission's blocked seconds, the take's waits, the rows + Parquet + commit, and the loop lag
(``RolloutProducer.snapshot``). Rounds run a b, then b a, so that a drift in load cancels.
``--profile`` adds one producer phase per setting, not in the table, with cProfile on the loop
thread (its CPU clock, by own time).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import json
import logging
import math
import pstats
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # this tree's rollflow, and machine.py

import aiohttp  # noqa: E402
import psutil  # noqa: E402

from machine import Machine, table  # noqa: E402

ENV = "sort_letters"
MAX_STALENESS = 3
# Thread name -> the part of this process its CPU is counted in.
PARTS = (("rollout-producer", "loop"), ("asyncio_", "workers"), ("MainThread", "main"))


@dataclass
class Phase:
    """One phase's figures over its measuring window."""

    kind: str  # "baseline" or "producer"
    tokens_per_s: float
    tokens_per_sequence: float
    in_flight_mean: float  # sequences, client side
    cpu_cores: dict[str, float]  # this process by part, and "vLLM"
    producer: dict[str, float] = field(default_factory=dict)
    profile: str = ""


class Window:
    """The measuring window, on a thread of its own: from ``warmup_s`` after it is made, for
    ``measure_s``, CPU seconds of this process by thread part and of the vLLM server, and the
    sequences in flight (``in_flight()``) every 50 ms; ``on_open`` / ``on_close`` run at its edges."""

    def __init__(self, pids, in_flight, warmup_s, measure_s, on_open=None, on_close=None) -> None:
        self.t0 = time.monotonic() + warmup_s
        self.t1 = self.t0 + measure_s
        self.servers = [psutil.Process(p) for p in pids]
        self.in_flight, self.samples = in_flight, []
        self.on_open, self.on_close = on_open or (lambda: None), on_close or (lambda: None)
        self._thread = threading.Thread(target=self._run, name="window", daemon=True)
        self._thread.start()

    def _cpu(self) -> dict[str, float]:
        names = {t.native_id: t.name for t in threading.enumerate()}
        out = {"vLLM": sum(sum(p.cpu_times()[:2]) for p in self.servers)}
        busy = psutil.cpu_times()  # the whole machine's: the rest is other people's work
        out["machine"] = sum(busy) - busy.idle - busy.iowait
        for t in psutil.Process().threads():
            name = names.get(t.id, "")
            part = next((p for prefix, p in PARTS if name.startswith(prefix)), "other")
            out[part] = out.get(part, 0.0) + t.user_time + t.system_time
        return out

    def _run(self) -> None:
        time.sleep(max(0.0, self.t0 - time.monotonic()))
        self.on_open()
        start, cpu0 = time.monotonic(), self._cpu()
        while time.monotonic() < self.t1:
            self.samples.append(self.in_flight())
            time.sleep(0.05)
        elapsed, cpu = time.monotonic() - start, self._cpu()
        self.on_close()
        self.cores = {k: (v - cpu0.get(k, 0.0)) / elapsed for k, v in cpu.items()}

    def result(self) -> tuple[dict[str, float], float]:
        """CPU cores by part over the window, and the mean sequences in flight."""
        self._thread.join()
        return self.cores, sum(self.samples) / max(1, len(self.samples))

    def rate(self, events: list[tuple[float, int, int]]) -> tuple[float, float]:
        """Tokens/s and tokens per sequence of the (time, tokens, sequences) events inside."""
        inside = [e for e in events if self.t0 <= e[0] < self.t1]
        tokens, sequences = sum(e[1] for e in inside), sum(e[2] for e in inside)
        return tokens / (self.t1 - self.t0), tokens / max(1, sequences)


async def baseline(args, url: str, pids: list[int], prompts_T: list[list[int]], n: int, g: int):
    """Phase (a): N / G requests of n = G always in flight; each answer's tokens counted."""
    from rollflow.inference.protocol import COMPLETIONS
    from rollflow.infra.vllm_fleet.keys import auth_headers

    events, state = [], {"in_flight": 0}
    next_prompt = itertools.cycle(prompts_T).__next__
    connector = aiohttp.TCPConnector(limit=0)

    async def worker(http: aiohttp.ClientSession) -> None:
        while True:
            body = {
                **{"model": "policy", "prompt": next_prompt(), "n": g, "logprobs": 0},
                **{"max_tokens": args.max_tokens, "temperature": 1.0, "top_p": 1.0},
                "return_token_ids": True,
            }
            state["in_flight"] += g
            try:
                async with http.post(url + COMPLETIONS.path, json=body) as response:
                    data = json.loads(await response.read())
            finally:
                state["in_flight"] -= g
            tokens = sum(len(c["token_ids"]) for c in data["choices"])
            events.append((time.monotonic(), tokens, g))

    window = Window(pids, lambda: state["in_flight"], *_span(args, n))
    async with aiohttp.ClientSession(connector=connector, headers=auth_headers(url)) as http:
        workers = [asyncio.create_task(worker(http)) for _ in range(n // g)]
        await asyncio.sleep(window.t1 - time.monotonic() + 0.1)
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    cores, in_flight = window.result()
    return Phase("baseline", *window.rate(events), in_flight, cores)


def producer(args, model_dir: Path, url: str, key: str, pids: list[int], n: int, g: int, name: str):
    """Phase (b): the producer host and the generate task's body, step after step."""
    from rollflow.infra.config import load_config
    from rollflow.infra.context import RunContext
    from rollflow.infra.http import Endpoint
    from rollflow.tasks.generate.generate_task import build_envs, generate, make_rollout_context
    from rollflow.tasks.generate.host import ProducerHost

    k = n // g
    b = max(1, k // 2)
    cfg = load_config(ROOT / "configs/quickstart.toml", _overrides(args, name, g, k, b))
    make_ctx = partial(make_rollout_context, cfg, str(model_dir), temperature=1.0)
    host = ProducerHost(cfg, build_envs(cfg), make_ctx, [url], resumed_from=0)
    ctx = RunContext(
        config=cfg,
        model_path=str(model_dir),
        trainer=Endpoint("trainer", "http://127.0.0.1:9", "unused"),  # never called
        inference=[Endpoint("vllm", url, key)],
    )
    sent = host.client.clients[0].max_connections  # requests beyond it wait in the client
    profiler = cProfile.Profile(time.thread_time) if args.profiling else None

    def open_window() -> None:  # on the producer's loop: cProfile profiles the thread it starts on
        host.loop.call_soon_threadsafe(host.producer._lags_s.clear)
        if profiler:
            host.loop.call_soon_threadsafe(profiler.enable)

    def close_window() -> None:
        if profiler:
            host.loop.call_soon_threadsafe(profiler.disable)

    in_flight = lambda: min(host.client.in_flight[0], sent) * g  # noqa: E731
    window = Window(pids, in_flight, *_span(args, n), open_window, close_window)
    groups, steps = [], []  # steps: (take wait s, rows + Parquet + commit s, producer metrics)
    try:
        for step in itertools.count(1):
            t = time.perf_counter()
            rollouts = generate.fn(ctx, step)  # take the step's groups, write and commit them
            total_s = time.perf_counter() - t
            host.set_version(step)  # no trainer: the step's "weights" are served at once
            if window.t0 <= time.monotonic() < window.t1:
                wait_s = rollouts.producer["take_wait_s"]
                steps.append((wait_s, total_s - wait_s, rollouts.producer))
            taken = host.producer._taken[step]  # this step's groups, with when each finished
            groups += [(x.finished_s, _num_tokens(x.result), g) for x in taken]
            # First finished, first out: once a group finished after the window, every one that
            # finished inside it is committed.
            if max(x.finished_s for x in taken) >= window.t1:
                break
            if time.monotonic() > window.t1 + 120:
                raise TimeoutError(f"{name}: no group finished after the window in 120 s")
    finally:
        host.close()
    cores, in_flight = window.result()
    figures = _producer_figures(steps)
    rate, per_seq = window.rate(groups)
    return Phase("producer", rate, per_seq, in_flight, cores, figures, _top(profiler))


def _num_tokens(result) -> int:
    return sum(len(s.completion_ids) for s in result) if isinstance(result, list) else 0


def _producer_figures(steps: list[tuple[float, float, dict]]) -> dict[str, float]:
    """The producer's own numbers over the window's steps (the last step's, or differences)."""
    from rollflow.infra.metric_names import Metric

    if not steps:
        keys = ["steps", "take_wait_s", "write_s", "blocked_s", "stale_dropped"]
        return dict.fromkeys([*keys, "lag_p99_s", "lag_max_s", "retries"], math.nan)
    first, last = steps[0][2], steps[-1][2]
    return {
        "steps": len(steps),
        "take_wait_s": sum(s[0] for s in steps),
        "write_s": sum(s[1] for s in steps),
        "blocked_s": last[Metric.PRODUCER_BLOCKED_S] - first[Metric.PRODUCER_BLOCKED_S],
        "stale_dropped": last[Metric.STALE_DROPPED_TOTAL] - first[Metric.STALE_DROPPED_TOTAL],
        "lag_p99_s": last[Metric.LOOP_LAG_P99_S],
        "lag_max_s": last[Metric.LOOP_LAG_MAX_S],
        "retries": last[Metric.RETRIES_TOTAL],
    }


def _span(args, n: int) -> tuple[float, float]:
    """Warm-up and measuring seconds at level ``n``: longer above 256 (a wave of 1024 sequences
    takes as long as 64 steps of 1024 tokens)."""
    scale = max(1.0, n / 256)
    return args.warmup_s * scale, args.measure_s * scale


def _overrides(args, name: str, g: int, k: int, b: int) -> list[str]:
    return [
        f"run.name={name}",
        f"run.storage={args.root / 'runs'}",
        f"model.tiny.max_position_embeddings={args.max_model_len}",
        f"sampling.group_size={g}",
        f"sampling.max_tokens={args.max_tokens}",
        "sampling.temperature=1.0",
        f"train.train_batch_size={b}",
        f"train.mini_batch_size={b}",
        f"train.max_staleness={MAX_STALENESS}",
        f"train.max_in_flight_groups={k}",
        "train.dynamic_sampling=false",  # every admitted group is served, as vLLM's own loop
    ]


def _top(profiler: cProfile.Profile | None) -> str:
    if profiler is None:
        return ""
    time.sleep(0.2)  # the disable has run on the loop
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    return out.getvalue()


def start_server(args) -> tuple[object, str, str, list[int], Path]:
    """The tiny model, built here, and a server for it: (server, url, key, pids, model dir)."""
    from rollflow.infra.config import TinyModelSpec
    from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama, save_hf_dir

    tok = build_char_tokenizer()
    spec = TinyModelSpec(max_position_embeddings=args.max_model_len)  # the quickstart's shape
    model_dir = save_hf_dir(build_tiny_llama(spec, len(tok)), tok, args.root / "model")
    if args.fake_server:
        from rollflow.testing.fake_openai import FakeOpenAI

        server = FakeOpenAI(latency_s=0.05, latency_jitter_s=0.05)
        return server, server.start(), "", [], model_dir
    from rollflow.services.vllm_server import InferenceServer

    server = InferenceServer(
        model_dir,
        max_model_len=args.max_model_len,
        extra_args=["--max-num-seqs", str(max(args.levels))],
        log_path=args.root / "vllm.log",
    )
    server.start()
    return server, server.url, server.api_key, server.pids(), model_dir


def settle(pids: list[int], timeout_s: float = 20.0) -> None:
    """Wait until vLLM has let go of the last phase's requests (its CPU falls below 0.1 core)."""
    procs = [psutil.Process(p) for p in pids]
    deadline = time.monotonic() + timeout_s
    while procs and time.monotonic() < deadline:
        cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)
        time.sleep(0.5)
        if sum(sum(p.cpu_times()[:2]) for p in procs) - cpu0 < 0.05:
            return


def prompt_ids(model_dir: Path, count: int = 4096) -> list[list[int]]:
    """The producer's prompts, as token ids the way rollflow sends them (bos first)."""
    from transformers import AutoTokenizer

    from rollflow.tasks.generate.environments import load_env
    from rollflow.tasks.generate.producer import prompt_stream

    tok = AutoTokenizer.from_pretrained(model_dir)
    stream = prompt_stream({ENV: load_env(ENV, {})}, {ENV: 1.0}, 64, seed=1)
    return [tok(p.text).input_ids for p in itertools.islice(stream, count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[16, 2])
    parser.add_argument("--rounds", type=int, default=2, help="a, b pairs per setting")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--measure-s", type=float, default=15.0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--fake-server", action="store_true", help="checks the code; no figures")
    args = parser.parse_args()
    args.root = Path(tempfile.mkdtemp(prefix="producer-throughput-"))
    args.max_model_len, args.profiling = 128, False
    # Groups dropped as stale are counted in the table; a warning each would bury it.
    logging.getLogger("rollflow.tasks.generate.producer").setLevel(logging.ERROR)
    machine = Machine()
    server, url, key, pids, model_dir = start_server(args)
    results: dict[tuple[int, int], list[Phase]] = {}
    profiles: dict[tuple[int, int], str] = {}
    try:
        prompts_T = prompt_ids(model_dir)
        for n, g in itertools.product(args.levels, args.group_sizes):
            phases = results[n, g] = []
            for r in range(args.rounds):
                for kind in ("baseline", "producer")[:: 1 if r % 2 == 0 else -1]:
                    if kind == "baseline":
                        phase = asyncio.run(baseline(args, url, pids, prompts_T, n, g))
                    else:
                        phase = producer(args, model_dir, url, key, pids, n, g, f"p{n}-{g}-{r}")
                    settle(pids)
                    phases.append(phase)
                    print(
                        f"{n} × {g}, round {r + 1}, {kind}: {phase.tokens_per_s:.0f} tok/s, "
                        f"other processes {_other_cores(phase):.2f} cores",
                        file=sys.stderr,
                        flush=True,
                    )
            if args.profile:
                args.profiling = True
                profiles[n, g] = producer(
                    args, model_dir, url, key, pids, n, g, f"prof{n}-{g}"
                ).profile
                args.profiling = False
                settle(pids)
    finally:
        server.stop()
        shutil.rmtree(args.root, ignore_errors=True)
    report(args, machine, results, profiles)


def _mean(phases: list[Phase], figure) -> float:
    return sum(figure(p) for p in phases) / len(phases)


def _client_cores(p: Phase) -> float:
    return sum(v for k, v in p.cpu_cores.items() if k not in ("vLLM", "machine"))


def _other_cores(p: Phase) -> float:
    return p.cpu_cores["machine"] - p.cpu_cores["vLLM"] - _client_cores(p)


def _rows(n: int, g: int, phases: list[Phase]) -> tuple[list, list]:
    """One setting's row of each table: speed, and where the producer's time goes."""
    a = [p for p in phases if p.kind == "baseline"]
    b = [p for p in phases if p.kind == "producer"]
    ratios = [pb.tokens_per_s / pa.tokens_per_s for pa, pb in zip(a, b, strict=True)]
    base_tok_s, prod_tok_s = _mean(a, lambda p: p.tokens_per_s), _mean(b, lambda p: p.tokens_per_s)
    speed = [n, g, n // g, f"{base_tok_s:.0f}", f"{prod_tok_s:.0f}"]
    speed += [f"{prod_tok_s / base_tok_s:.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"]
    speed += ["ok" if prod_tok_s / base_tok_s >= 0.9 else "MISSED"]

    def pair(figure, fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(_mean(a, figure))} / {fmt.format(_mean(b, figure))}"

    prod = {k: _mean(b, lambda p, k=k: p.producer[k]) for k in b[0].producer}
    parts = [_mean(b, lambda p, k=k: p.cpu_cores.get(k, 0.0)) for k in ("loop", "workers", "main")]
    where = [
        f"{n} × {g}",
        pair(lambda p: p.in_flight_mean, "{:.0f}"),
        pair(lambda p: p.tokens_per_sequence, "{:.1f}"),
        pair(lambda p: p.cpu_cores["vLLM"]),
        pair(_client_cores),
        pair(_other_cores),
        " / ".join(f"{c:.2f}" for c in parts),
        f"{prod['blocked_s']:.2f}",
        f"{prod['stale_dropped']:.1f}",
        f"{prod['steps']:.0f}: {prod['take_wait_s']:.1f} / {prod['write_s']:.2f}",
        f"{prod['lag_p99_s'] * 1e3:.1f} / {prod['lag_max_s'] * 1e3:.1f}",
        f"{prod['retries']:.0f}",
    ]
    return speed, where


def report(args, machine: Machine, results: dict, profiles: dict) -> None:
    rows = [_rows(n, g, phases) for (n, g), phases in results.items()]
    print(
        f"\nrollout producer against a plain client loop, one vLLM server, tiny char Llama "
        f"(hidden 128, 2 layers), max_tokens {args.max_tokens}, temperature 1; "
        f"{args.rounds} rounds (a, b) of {args.warmup_s:.0f} s warm-up + {args.measure_s:.0f} s"
        + (" — FAKE SERVER: checks the code, no figures" if args.fake_server else "")
    )
    print(machine.line() + "\n")
    header = ["sequences in flight N", "group size G", "requests in flight N / G"]
    header += ["baseline tok/s", "producer tok/s", "ratio (each round)", "≥ 0.9"]
    print(table(header, [r[0] for r in rows]))
    print("\nwhere the producer's time goes (a: baseline, b: producer; means over rounds):\n")
    header = ["N × G", "sequences in flight a / b", "tokens per completion a / b"]
    header += ["vLLM CPU cores a / b", "client CPU cores a / b", "other processes' CPU cores a / b"]
    header += ["b's client CPU: loop / worker threads / generate task", "admission blocked s"]
    header += ["groups dropped as stale"]
    header += ["steps in window: take waits / rows + Parquet + commit s"]
    header += ["loop lag p99 / max ms", "retries"]
    print(table(header, [r[1] for r in rows]))
    for (n, g), text in profiles.items():
        print(f"\n### the producer's loop thread, {n} × {g} (cProfile, thread CPU, own time)\n")
        print(text)


if __name__ == "__main__":
    main()
