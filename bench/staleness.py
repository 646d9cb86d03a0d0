"""What staleness costs in learning per optimizer step, and why: settings side by side.

    .venv/bin/python bench/staleness.py                          # workload (a), the settings below
    .venv/bin/python bench/staleness.py --settings s0 s1 --seeds 2
    .venv/bin/python bench/staleness.py --workload c --settings s0 s1   # where vs_trl has (c)
    .venv/bin/python bench/staleness.py --minibatches 1 --settings s0 s1 s2   # learning by data age
    .venv/bin/python bench/staleness.py --settings s0 s0.25 --threshold 2 --max-steps 800  # equal-length curves

Each setting is a real rollflow run (``bench/vs_trl.py``'s rollflow side: the same warm-started
policy, environment, K = 4 optimizer steps per generation batch, lr and held-out evaluation),
stopped at the workload's held-out threshold. Per setting it prints the optimizer steps to the
threshold (and their ratio to on-policy, ``s0``, of the same seed) and, averaged over the run's
training steps, what explains them:

- data age: optimizer steps between the policy that sampled a group and the one that trains on
  it (``K · (step - 1 - version_started) + mini-batch index``, mean over the trained samples;
  from the committed rollouts: at S = 0 it is 0-3, the mini-batches of one batch);
- clip fraction: loss tokens whose PPO-clip branch won (no gradient);
- mismatch KL (k3 of KL(sampler ‖ trainer), the current policy against the one that sampled);
- the importance ratio's 5% / 50% / 95% quantiles (sampler → the trainer's old policy; only
  when the trainer recomputes old log-probs) and the fraction of tokens masked by the band;
- the share of groups kept (zero-advantage groups dropped) and the gradient norm;
- where a step's time went: the trainer waiting for data, the train phase, the whole step.

Learning per optimizer step is what this bench is about: seconds depend on the load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import duckdb  # noqa: E402
from vs_trl import WORKLOADS, prepare_model, rollflow_side  # noqa: E402

from machine import Machine, table  # noqa: E402

# name: (max_staleness, overrides, what it is)
SETTINGS = {
    "s0": (0, [], "on-policy: max_staleness 0"),
    "s0.25": (
        0.25,
        [],
        "max_staleness 0.25 (1 of K = 4 optimizer steps): weights sent one optimizer step before "
        "each step's end, the next step's groups sampled from them",
    ),
    "s0.5": (0.5, [], "max_staleness 0.5 (2 of K = 4 optimizer steps), as s0.25"),
    "s1": (1, [], "max_staleness 1, clip around the sampler's log-probs (the default loss)"),
    "s2": (2, [], "max_staleness 2, the default loss"),
    "s1-trainer": (
        1,
        ["train.old_logprobs=trainer", "train.loss.tis_cap=2"],
        "max_staleness 1, clip around the trainer's log-probs at the step's start, TIS cap 2",
    ),
    "s1-trainer-mask": (
        1,
        [
            "train.old_logprobs=trainer",
            "train.loss.tis_cap=2",
            "train.loss.mask_low=0.5",
            "train.loss.mask_high=2",
        ],
        "as s1-trainer, tokens whose sampler → trainer ratio leaves [0.5, 2] masked",
    ),
}


def diagnostics(storage: Path, k: int) -> dict:
    """Means over the run's trained steps of what explains its learning per optimizer step."""
    run = storage / "vs-trl"
    m = duckdb.sql(
        f"select * from read_parquet('{run}/metrics/*.parquet', union_by_name=true) where step > 0"
    ).df()
    ages = duckdb.sql(f"""
        select avg({k} * (step - 1 - version_started)) as age_batch,
               max({k} * (step - 1 - version_started)) as age_batch_max
        from read_parquet('{run}/rollouts/*/*.parquet', union_by_name=true) where error is null
    """).fetchall()[0]

    def mean(col: str) -> float:
        return float(m[col].mean()) if col in m and m[col].notna().any() else float("nan")

    return {
        # Mini-batch j of K trains after j optimizer steps of its own batch: + (K - 1) / 2 on average.
        "age_mean": ages[0] + (k - 1) / 2,
        "age_max": ages[1] + (k - 1),
        "clip_fraction": mean("clip_fraction"),
        "mismatch_kl": mean("mismatch_kl"),
        "is_q05": mean("is_ratio_q05"),
        "is_q50": mean("is_ratio_q50"),
        "is_q95": mean("is_ratio_q95"),
        "masked": mean("is_masked_fraction"),
        "groups_kept": mean("num_groups_kept"),
        "grad_norm": mean("grad_norm"),
        # Where a step's time went: the trainer waiting for data, training (with a mid-step sync
        # inside it), and the whole step on the run's clock.
        "wait_s": mean("trainer_wait_for_data_s"),
        "train_phase_s": mean("train_phase_s"),
        "step_s": mean("step_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="a")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds run from this one")
    parser.add_argument("--max-s", type=float, default=900.0, help="training seconds per run")
    parser.add_argument(
        "--max-steps",
        type=int,
        help="optimizer steps before a run gives up (default: the workload's)",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=40,
        help="optimizer steps between held-out evaluations (vs_trl's 10 makes a 3000-step run "
        "spend most of its time evaluating)",
    )
    parser.add_argument(
        "--minibatches",
        type=int,
        help="optimizer steps per generation batch, K (default: the workload's); with K = 1 the "
        "data age is max_staleness itself, so s0 s1 s2 measure learning against data age",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        help="held-out reward a run stops at (default: the workload's); above 1 every run goes "
        "to --max-steps, for curves of equal length",
    )
    parser.add_argument("--json-out", help="write every run's result and curve here")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    machine = Machine()
    w = WORKLOADS[args.workload]
    k = args.minibatches or w["minibatches"]
    threshold = args.threshold if args.threshold is not None else w["threshold"]
    model = prepare_model(args.workload, args.overrides)
    results = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for name in args.settings:
            staleness, overrides, _ = SETTINGS[name]
            spec = {
                "workload": args.workload,
                "extra": [*args.overrides, *overrides, f"run.seed={seed}"],
                "model": model,
                "threshold": threshold,
                "eval_every": args.eval_every,
                "max_steps": args.max_steps or w["max_steps"],
                "max_s": args.max_s,
                "staleness": staleness,
                "minibatches": k,
            }
            with tempfile.TemporaryDirectory(prefix="rollflow-bench-staleness-") as tmp:
                out = rollflow_side(spec, Path(tmp))
                out.update(diagnostics(Path(tmp), k), setting=name, seed=seed)
            results.append(out)
            if args.json_out:  # after every run: a long bench stopped early keeps what it has
                Path(args.json_out).write_text(json.dumps(results, default=str))
            print(
                f"seed {seed} {name}: {'reached' if out['reached'] else 'NOT reached'} at "
                f"{out['steps']} optimizer steps ({out['train_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    base = {r["seed"]: r["steps"] for r in results if r["setting"] == "s0" and r["reached"]}
    # One crossing of the threshold is noisy (held-out swings ~±0.05 between evaluations): the
    # mean held-out over the optimizer steps every run reached is the steadier comparison.
    common = min((r["curve"][-1][0] for r in results if r["curve"]), default=0)
    early = lambda r: [v for s, _, v in r["curve"] if s <= common]  # noqa: E731
    print(
        f"\nlearning per optimizer step by setting: workload ({args.workload}) {w['what']}, "
        f"K = {k}, threshold {threshold} held-out; means over each run's steps"
    )
    print(machine.line() + "\n")
    f2 = lambda x: f"{x:.2f}"  # noqa: E731
    print(
        table(
            [
                "setting",
                "seed",
                "reached",
                "optimizer steps",
                "vs s0 (same seed)",
                "best held-out",
                f"mean held-out, steps ≤ {common}",
                "data age mean / max (optimizer steps)",
                "clip fraction",
                "mismatch KL",
                "IS ratio q05 / q50 / q95",
                "masked",
                "groups kept",
                "grad norm",
                "per step: wait for data / train / whole s",
                "training s",
            ],
            [
                [
                    r["setting"],
                    r["seed"],
                    "yes" if r["reached"] else "NO",
                    r["steps"],
                    (
                        f"{'' if r['reached'] else '> '}{r['steps'] / base[r['seed']]:.2f}×"
                        if r["seed"] in base
                        else "–"
                    ),
                    f2(r["reward"]),
                    f"{statistics.fmean(early(r)):.3f}" if early(r) else "–",
                    f"{r['age_mean']:.1f} / {r['age_max']:.0f}",
                    f"{r['clip_fraction']:.3f}",
                    f"{r['mismatch_kl']:.4f}",
                    f"{f2(r['is_q05'])} / {f2(r['is_q50'])} / {f2(r['is_q95'])}",
                    f"{r['masked']:.3f}",
                    f"{r['groups_kept']:.1f}",
                    f"{r['grad_norm']:.3f}",
                    f"{r['wait_s']:.3f} / {r['train_phase_s']:.3f} / {r['step_s']:.3f}",
                    f"{r['train_s']:.0f}",
                ]
                for r in results
            ],
        )
    )
    for name in args.settings:
        steps = [r["steps"] for r in results if r["setting"] == name and r["reached"]]
        if steps:
            print(f"{name}: median {statistics.median(steps):.0f} optimizer steps to the threshold")
    print("\nheld-out curves (optimizer step, held-out reward):")
    for r in results:
        print(
            f"{r['setting']} seed {r['seed']}: "
            + ", ".join(f"({s}, {v:.2f})" for s, _, v in r["curve"])
        )
    for name in args.settings:
        print(f"  {name}: {SETTINGS[name][2]}")


if __name__ == "__main__":
    main()
