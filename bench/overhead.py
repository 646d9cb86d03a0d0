"""Time per step spent in the control plane (Prefect and our orchestration) on the critical path.

    .venv/bin/python bench/overhead.py                 # 30 steps at max_staleness 0 and 1, ~8 min
    .venv/bin/python bench/overhead.py --steps 20 --staleness 0
    git worktree add /tmp/before HEAD~3 && .venv/bin/python bench/overhead.py --compare /tmp/before
    .venv/bin/python bench/overhead.py --sync background inline   # the sync off / on the trainer's path
    .venv/bin/python bench/overhead.py --staleness 0 --set model.tiny.hidden_size=512 \
        model.tiny.num_layers=8 sampling.max_tokens=64       # a longer step: the share at scale

Method 1, inside a real run (``rollflow run configs/quickstart.toml``: vLLM, trainer service,
Prefect flows) of a tiny step: the quickstart model, 16 groups × 4 completions of ≤ 8 tokens,
no evaluation and no checkpoint until the last step, so that a step is generate → advantage →
train → sync and nothing else. From the run's metrics and rollouts, per step after a warm-up:

- step: wall seconds from the previous step's commit to this one's (``step_s``; consecutive
  steps add up to the run's wall clock): the critical path;
- service time: what the services did on that path: the trainer's ``forward_backward``,
  ``optim_step`` and ``end_step`` calls, timed inside the train task (``train_s``), the weight sync from the pause request to the resume's
  answer (``sync_s``), and, at ``max_staleness = 0`` only, generation, whose every group starts
  when the previous sync publishes the weights: the longest request of the step (``max(generate_s)``
  over its rollouts; with S ≥ 1 generation overlaps training and is off the path);
- control plane = step − service time: Prefect flow and task runs, the producer hand-off, the
  advantage task (reads the step's rollouts, writes its batch), metrics, events and the commit;
- trainer busy: ``train_s`` plus what the sync holds the trainer for: the whole sync inline
  (``trainer.background_sync = false``), the capture of the weights (``capture_s``) with the
  background sync, whose broadcast then runs while the next step trains (``--sync`` runs both);
  trainer idle = 1 − busy / step;
- CPU per step of each process of the run (the private Prefect API, the run process, vLLM, the
  trainer), sampled with psutil from the first to the last measured step: on 2 shared cores the
  API's CPU is taken from the trainer and vLLM even where its latency is hidden.

Method 2, the Prefect machinery alone, in this process against a private Prefect API (as
``rollflow run`` starts one): a flow run of five no-op tasks (the step flow's generate,
advantage, train, sync, checkpoint), and the same five no-op functions called directly (the
baseline); the difference is what Prefect adds per step when nothing overlaps it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import duckdb  # noqa: E402

from rollflow.trainer.protocol import RANK_MAIN_MODULE  # noqa: E402

from machine import Machine, table  # noqa: E402

TINY = [
    "train.train_batch_size=16",
    "train.mini_batch_size=16",
    "sampling.group_size=4",
    "run.eval_every=0",
    "run.checkpoint_every=100000",
]


# How a process of the run is told apart, by its command line (first match wins).
ROLES = (
    ("prefect API", "prefect_server:create_app"),
    ("run process", "rollflow.cli"),
    ("trainer", RANK_MAIN_MODULE),
    ("vLLM", "vllm"),
    ("vLLM", "VLLM::"),
)


def _role(proc) -> str | None:
    try:
        line = " ".join(proc.cmdline()) or proc.name()
    except Exception:  # noqa: BLE001 - gone, or a zombie
        return None
    return next((role for role, mark in ROLES if mark in line), None)


def _cpu_by_role(root) -> dict[str, float]:
    """CPU seconds (user + system) of the run's processes so far, summed by role."""
    import psutil

    out: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        role = _role(proc)
        try:
            cpu = sum(proc.cpu_times()[:2])
        except psutil.Error:
            continue
        if role:
            out[role] = out.get(role, 0.0) + cpu
    return out


def run_one(
    storage: Path,
    staleness: int,
    steps: int,
    warmup: int,
    tree: Path = ROOT,
    sync: str = "background",
    overrides: tuple[str, ...] = (),
) -> dict:
    """One run of the tiny step with the rollflow of ``tree``; its figures per measured step."""
    import psutil

    name = f"overhead-s{staleness}-{sync}-{abs(hash(str(tree))) % 10_000}"
    cmd = [
        sys.executable,
        "-m",
        "rollflow.cli",
        "run",
        str(ROOT / "configs/quickstart.toml"),
        f"run.name={name}",
        f"run.storage={storage}",
        f"run.num_steps={steps + warmup}",
        f"train.max_staleness={staleness}",
        *TINY,
        # (a checkout from before the background sync has no such key: leave it out there)
        *(["trainer.background_sync=false"] if sync == "inline" else []),
        *overrides,
    ]
    env = {
        **os.environ,
        "PREFECT_HOME": str(storage / f"prefect-{name}"),
        "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
    }
    log = open(storage / f"{name}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT, env=env)
    root = psutil.Process(proc.pid)
    metrics = storage / name / "metrics"
    first, last = f"step={warmup}.parquet", f"step={steps + warmup - 1}.parquet"
    cpu: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + 3600
    while proc.poll() is None and time.monotonic() < deadline:
        # CPU when the first measured step begins (its predecessor's metrics row) and when the
        # last measured one ends: the window the per-step means cover.
        for mark in (first, last):
            if mark not in cpu and (metrics / mark).exists():
                cpu[mark] = _cpu_by_role(root)
        time.sleep(0.05)
    returncode = proc.wait(timeout=60)
    log.close()
    if returncode or len(cpu) < 2:
        sys.exit(f"S={staleness} ({tree}) failed:\n{(storage / f'{name}.log').read_text()[-4000:]}")
    columns = duckdb.sql(
        f"select * from read_parquet('{storage}/{name}/metrics/*.parquet', union_by_name=true) limit 0"
    ).columns
    capture = "m.capture_s" if "capture_s" in columns else "null"
    m = duckdb.sql(f"""
        select m.step, m.step_s, m.train_s, m.train_phase_s, m.sync_s, {capture} as capture_s, m.generate_phase_s, m.advantage_phase_s,
               m.sync_phase_s, m.trainer_wait_for_data_s, g.gen_s
        from read_parquet('{storage}/{name}/metrics/*.parquet', union_by_name=true) m
        join (select step, max(generate_s) gen_s from read_parquet('{storage}/{name}/rollouts/*/*.parquet')
              group by step) g using (step)
        where m.step > {warmup} and m.step < {steps + warmup}  -- the last step also checkpoints
        order by m.step""").df()
    on_path = m.gen_s if staleness == 0 else m.gen_s * 0
    service = m.train_s + m.sync_s + on_path
    cpu_per_step = {r: (cpu[last].get(r, 0.0) - cpu[first].get(r, 0.0)) / len(m) for r in cpu[last]}
    # A step that captured handed the broadcast off; one that did not held the trainer through it.
    held = m.capture_s.where(m.capture_s.notna(), m.sync_s.fillna(0.0))
    return {
        "S": staleness,
        "sync": sync,
        "captured_steps": int(m.capture_s.notna().sum()),
        "tree": tree,
        "steps": len(m),
        "step_s": m.step_s.mean(),
        "train_s": m.train_s.mean(),
        "sync_s": m.sync_s.mean(),
        "gen_s": m.gen_s.mean(),
        "on_path_s": on_path.mean(),
        "service_s": service.mean(),
        "control_s": (m.step_s - service).mean(),
        "trainer_idle": (m.step_s - m.train_s - held).sum() / m.step_s.sum(),
        "trainer_busy_s": (m.train_s + held).mean(),
        "advantage_s": m.advantage_phase_s.mean(),
        "cpu_per_step_s": cpu_per_step,
    }


def prefect_noop(repeats: int, storage: Path) -> dict:
    """Wall seconds of a flow run of five no-op tasks, and of the five no-op calls alone."""
    os.environ.setdefault("PREFECT_HOME", str(storage / "prefect-noop"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    from rollflow.infra.prefect_api import local_prefect_api

    def work(step: int) -> dict:
        return {"step": step}

    stages = [
        task(name=n, cache_policy=NO_CACHE, persist_result=False)(work)
        for n in ("generate", "advantage", "train", "sync", "checkpoint")
    ]

    @flow(name="noop-step", persist_result=False, validate_parameters=False)
    def noop_step(step: int) -> None:
        for stage in stages:
            stage(step)

    def direct(step: int) -> None:
        for _ in stages:
            work(step)

    with local_prefect_api():
        noop_step(0)  # the first flow run pays for imports and connections
        flows, calls = [], []
        for step in range(repeats):
            start = time.perf_counter()
            noop_step(step)
            flows.append(time.perf_counter() - start)
            start = time.perf_counter()
            direct(step)
            calls.append(time.perf_counter() - start)
    return {"flow_s": statistics.median(flows), "direct_s": statistics.median(calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--noop-repeats", type=int, default=20)
    parser.add_argument(
        "--sync",
        nargs="+",
        default=["background"],
        choices=["background", "inline"],
        help="trainer.background_sync on (background) or off (inline); each runs",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        help="another rollflow checkout (e.g. a git worktree of an earlier commit): each setting "
        "runs with both, alternating, and the table shows both",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides after the tiny step's (e.g. a larger model.tiny or sampling.max_tokens)",
    )
    args = parser.parse_args()
    machine = Machine()
    trees = [ROOT] + ([args.compare.resolve()] if args.compare else [])
    with tempfile.TemporaryDirectory(prefix="rollflow-bench-overhead-") as tmp:
        rows = []
        for s in args.staleness:
            for sync in args.sync:
                for tree in trees:
                    rows.append(
                        run_one(Path(tmp), s, args.steps, args.warmup, tree, sync, tuple(args.set))
                    )
                    print(f"S={s} {sync} ({tree}): done", file=sys.stderr, flush=True)
        noop = prefect_noop(args.noop_repeats, Path(tmp))

    ms = lambda s: f"{s * 1000:.0f}"  # noqa: E731
    label = lambda r: "this tree" if r["tree"] == ROOT else str(r["tree"])  # noqa: E731
    print(
        f"\ncontrol plane on the critical path: quickstart model, 16 groups × 4 per step, "
        f"{args.steps} steps measured after {args.warmup}; means per step (ms)"
        + (f"; overrides: {' '.join(args.set)}" if args.set else "")
    )
    print(machine.line() + "\n")
    print(
        table(
            [
                "checkout",
                "max_staleness",
                "sync",
                "step",
                "train (trainer)",
                "sync (pause→resume)",
                "generation (longest request)",
                "… of it on the path",
                "service time",
                "control plane = step − service",
                "control plane share of the step",
                "trainer busy",
                "trainer idle share",
                "advantage task",
            ],
            [
                [
                    label(r),
                    r["S"],
                    f"{r['sync']} ({r['captured_steps']}/{r['steps']} captured)",
                    ms(r["step_s"]),
                    ms(r["train_s"]),
                    ms(r["sync_s"]),
                    ms(r["gen_s"]),
                    ms(r["on_path_s"]),
                    ms(r["service_s"]),
                    ms(r["control_s"]),
                    f"{r['control_s'] / r['step_s']:.0%}",
                    ms(r["trainer_busy_s"]),
                    f"{r['trainer_idle']:.0%}",
                    ms(r["advantage_s"]),
                ]
                for r in rows
            ],
        )
    )
    roles = sorted({role for r in rows for role in r["cpu_per_step_s"]})
    print(
        "\nCPU per step by process (ms of CPU, user + system; the machine has "
        f"{os.cpu_count()} cores, so a step of T ms has {os.cpu_count()}·T ms of CPU):\n"
    )
    print(
        table(
            ["checkout", "max_staleness", "sync", *roles, "Prefect API share of the step's cores"],
            [
                [
                    label(r),
                    r["S"],
                    r["sync"],
                    *(ms(r["cpu_per_step_s"].get(role, 0.0)) for role in roles),
                    f"{r['cpu_per_step_s'].get('prefect API', 0.0) / (r['step_s'] * os.cpu_count()):.0%}",
                ]
                for r in rows
            ],
        )
    )
    print(
        "\nAt max_staleness ≥ 1 generation should overlap training, so all trainer idle time is counted "
        "as control plane: an upper bound that includes any wait for generation that overlap did not hide."
    )
    step = rows[0]["step_s"]
    print(
        f"\nPrefect alone (median of {args.noop_repeats}): a flow run of 5 no-op tasks "
        f"{ms(noop['flow_s'])} ms, the 5 no-op calls directly {noop['direct_s'] * 1e6:.0f} µs; "
        f"Prefect per step = {noop['flow_s'] / step:.0%} of a max_staleness={rows[0]['S']} step "
        f"({ms(step)} ms) if nothing overlapped it"
    )


if __name__ == "__main__":
    main()
