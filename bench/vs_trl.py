"""TRL's GRPOTrainer against rollflow: wall-clock seconds to a held-out reward threshold.

    .venv/bin/python bench/vs_trl.py --workload a          # tiny, ~0.4M params, ≤ 8 tokens
    .venv/bin/python bench/vs_trl.py --workload b          # ~10M params, ≥ 24-token completions
    .venv/bin/python bench/vs_trl.py --workload c          # (a)'s settings on the add env
    .venv/bin/python bench/vs_trl.py --compare base=c.json samples=s.json  # saved runs, per step
    .venv/bin/python bench/vs_trl.py --compare a=a.json --threshold 0.8  # steps to 0.8 from curves
    .venv/bin/python bench/vs_trl.py --workload r      # (a)'s settings on reverse_letters (unseen)
    .venv/bin/python bench/vs_trl.py --workload m      # (a)'s settings on mod_add (unseen)
    .venv/bin/python bench/vs_trl.py --workload a --only trl   # one side (e.g. to tune)
    .venv/bin/python bench/vs_trl.py --workload a --minibatches 1  # one optimizer step per generation
    .venv/bin/python bench/vs_trl.py --summary a.json a_5to9.json  # saved runs' wall-time summary

Both sides start from the same warm-started policy (rollflow's ``prepare_policy``: a tiny
character Llama trained by a short supervised pass, cached in ~/.cache/rollflow/models), on the
same environment, group size, prompts per step, learning rate (AdamW, constant, no warm-up,
weight decay 0, gradient clipping 1.0), sampling temperature 1.0 and completion length, the
same number of optimizer steps per generation batch (``--minibatches K``, (a) 4, (b) 1: TRL's
``steps_per_generation``, rollflow's ``train_batch_size = K · mini_batch_size``; each optimizer
step takes the workload's prompts per step), the same loss shape (PPO-clip ε = 0.2 on token ratios, no
KL term, reward − group mean as advantage: TRL's ``loss_type="dapo"``, ``scale_rewards="none"``,
``beta=0``). The rollflow side runs rollflow's defaults, whose gradient differs from TRL's in one
key: the ratio is taken against vLLM's log-probs (docs/concepts/trl-compatibility.md measures it).
TRL's exact loss is ``train.old_logprobs=trainer`` on top of the defaults
(tests/unit/trainer/test_trl_parity.py). Since 2026-11-28 TRL's split (the step's samples
shuffled into its optimizer steps, ``train.mini_batch_split=samples``) and TRL's token mean
(``train.token_mean=batch``, which counts the tokens of the groups the zero-advantage filter left
out) are rollflow's defaults; before, ``train.mini_batch_split=groups train.token_mean=mini_batch``.
Since 2026-11-29 the defaults' data differs from TRL's: dynamic sampling (on with the zero-advantage
filter) replaces a group without signal by a new one before a step takes it, where TRL trains on
the generation batch it sampled; ``train.dynamic_sampling=false`` gives TRL's data.

- TRL: ``GRPOTrainer`` with its own HF ``generate`` (no vLLM), in a child process, on CPU.
- rollflow: ``rollflow run`` (vLLM CPU, trainer service, Prefect flows) with ``model.path`` set
  to the same policy, ``max_staleness`` as given (``--staleness``; (a) 0, as the CPU quickstart,
  (b) 1), in a child process.

TRL need not be in the venv: ``--trl-path DIR`` (or ``ROLLFLOW_TRL_PATH=DIR``) names a folder
that holds it, put on the TRL child's ``PYTHONPATH`` only (rollflow's side never sees it), e.g.
``.venv/bin/python -m pip install --target /tmp/trl_pkgs --no-deps trl==1.16.0`` beside the
venv's torch, transformers, accelerate and datasets. (TRL imports the venv's vLLM, whose config
module needs ``openai_harmony``: the venv has it, from vLLM's ``oss-harmony``; it was missing for a
few minutes on 2026-11-25 while the venv was resynced, which is why the first runs installed
``openai-harmony`` beside TRL.)

Each side runs ``--seeds N`` times (``run.seed`` = 0..N-1, from ``--first-seed``: prompt order and sampling; (a), (c) 3,
(b) 1) and the ratios of the median times and of the median optimizer steps are printed: one
run's crossing of the threshold is noisy. Extra ``key=value`` overrides go to both sides' config;
those TRL has no counterpart for (``train.mini_batch_split``, ``train.old_logprobs``,
``train.token_mean``, ``train.filter_zero_advantage``, ``train.dynamic_sampling``) change rollflow
only, e.g.
``--only rollflow train.mini_batch_split=groups`` (the default before 2026-11-28).

Held-out reward: the env's reward (exact match for (a), the fraction of positions right for (b))
of greedy completions on the same 256 held-out prompts (rollflow's ``evaluate`` set), every ``--eval-every`` steps on both sides; TRL evaluates with HF generate in
a callback, rollflow with vLLM. Time to threshold counts training only: each side's evaluation
time is subtracted, and start-up (model load; for rollflow vLLM, trainer service and Prefect) is
reported apart. A side that has not reached the threshold by ``--max-steps`` or ``--max-s`` is
reported with the best reward it reached.

Wall time is the figure (issue 43). The summary (``--summary FILE...`` prints it again from
``--json-out`` files, seeds of several files merged) gives, per side, the medians over the seeds of
the training seconds to the threshold, the seconds per optimizer step (a run's training seconds
over its optimizer steps) and the optimizer steps to the threshold, then the mean held-out over
the common steps (per seed, the evaluations both sides reached: each side stops at its crossing,
so up to the faster side's), each with rollflow / TRL.

(a)'s threshold is 0.9 since 2026-12-06: the quickstart's warm start (2026-12-06) begins at
0.77-0.85 held-out (seeds 0-4), at or past the 0.8 it had before: both sides met 0.8 at or near
their first evaluation, which measured nothing. ``--threshold 0.8`` gives the old figure; the rows before that date use it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from machine import Machine, table  # noqa: E402

# (a)'s settings: the quickstart model, 8 prompts × 8 completions per optimizer step, ≤ 8 tokens.
TINY = [
    "sampling.group_size=8",
    "train.train_batch_size=8",
    "train.mini_batch_size=8",
    "sampling.max_tokens=8",
    "train.lr=2e-4",
]


def tiny(what: str, envs: list[str], threshold: float, max_steps: int, seeds: int) -> dict:
    """A workload with (a)'s settings on other environments; K = 4, on-policy."""
    return {
        "what": what,
        "overrides": [*envs, *TINY],
        "threshold": threshold,
        "eval_every": 10,
        "max_steps": max_steps,
        "minibatches": 4,
        "seeds": seeds,
        "staleness": 0,
    }


# Workloads: the quickstart config with these overrides.
WORKLOADS = {
    # 4 optimizer steps per generation batch on both sides: DESIGN.md's answer to a step this
    # small (one Prefect flow run per 4 optimizer steps). --minibatches 1 for one.
    # Threshold 0.9, not 0.8: the warm start begins at 0.77-0.85 (module docstring).
    "a": tiny("tiny: quickstart model (~0.4M), sort 3-5 letters, ≤ 8 tokens", [], 0.9, 4000, 3),
    # A second task for learning per optimizer step (issue 18): (a)'s settings on addition.
    # From the warm start's ~0.55 TRL's held-out plateaus at 0.62-0.75 within 1840 steps
    # (seed 0), never 0.8: this tiny model does not learn carrying to unseen sums in minutes.
    "c": tiny(
        "tiny on a second task: quickstart model (~0.4M), add a+b with a, b ≤ 49, ≤ 8 tokens",
        ["envs=[{name='add', args={max_value=49}}]"],
        0.7,
        3000,
        3,
    ),
    # Tasks written for issue 28 and tuned on by nobody: rollflow's defaults were chosen before
    # they existed. The thresholds sat between the warm start (~0.5) and the plateau; since the
    # quickstart's warm start of 2026-12-06 it begins at 0.80-0.87 on (r) and 0.82-0.87 on (s),
    # so (s)'s threshold is 0.93 (was 0.8, met at the start; both sides reached 0.93 on seeds 0-4).
    "r": tiny(
        "unseen string transformation: quickstart model (~0.4M), reverse 3-5 letters, ≤ 8 tokens",
        ["envs=[{name='reverse_letters', args={letters='abcdefgh', min_len=3, max_len=5}}]"],
        0.9,
        3000,
        5,
    ),
    "s": tiny(
        "unseen Caesar shift: quickstart model (~0.4M), 3-5 of 8 letters shifted by 1-3",
        [
            "envs=[{name='shift_letters', args={letters='abcdefgh', min_len=3, max_len=5, "
            "max_shift=3}}]"
        ],
        0.93,
        3000,
        5,
    ),
    # Not used for the comparison: a+b mod 3-9 did not move from 0.33 in 300 TRL steps, and the
    # warm start of a+b mod 10 had not reached 0.15 after 225 supervised steps.
    "m": tiny(
        "unseen modular arithmetic: quickstart model (~0.4M), a+b mod 10, a, b ≤ 99",
        ["envs=[{name='mod_add', args={max_value=99, min_mod=10, max_mod=10}}]"],
        0.7,
        3000,
        5,
    ),
    # Whole 24-28-letter answers are out of reach of a 10M model trained for minutes on 2 cores
    # (exact match still 0.00 after 400 supervised steps), so (b) scores the fraction of positions
    # right, and warm-starts for a fixed 200 steps (~5 min; held-out ~0.6).
    "b": {
        "what": "generation-dominated: ~10M char Llama, sort 24-28 letters (positions right), ≤ 32 tokens",
        "overrides": [
            "model.tiny.hidden_size=512",
            "model.tiny.num_layers=3",
            "model.tiny.intermediate_size=1536",
            "model.tiny.num_heads=8",
            "model.tiny.max_position_embeddings=96",
            "envs=[{name='sort_letters', args={letters='abcdefgh', min_len=24, max_len=28, "
            "partial_credit=true}}]",
            "model.warm_start_target=1.0",
            "model.warm_start_max_steps=200",
            "sampling.group_size=8",
            "train.train_batch_size=8",
            "train.mini_batch_size=8",
            "sampling.max_tokens=32",
            "train.lr=1e-4",
        ],
        "threshold": 0.7,
        "eval_every": 10,
        "max_steps": 1000,
        "minibatches": 1,
        "seeds": 1,
        "staleness": 1,
    },
}


def load_cfg(workload: str, extra: list[str], minibatches: int = 1):
    """The workload's config; with K mini-batches an outer step samples K times the prompts."""
    from rollflow.infra.config import load_config

    cfg = load_config(ROOT / "configs/quickstart.toml", [*WORKLOADS[workload]["overrides"], *extra])
    if minibatches == 1:
        return cfg
    prompts = cfg.train.mini_batch_size
    return load_config(
        ROOT / "configs/quickstart.toml",
        [
            *WORKLOADS[workload]["overrides"],
            *extra,
            f"train.train_batch_size={prompts * minibatches}",
            f"train.mini_batch_size={prompts}",
        ],
    )


def eval_prompts(cfg):
    """The held-out prompts of rollflow's ``evaluate`` (same seed, same count)."""
    from rollflow.tasks.generate.generate_task import build_envs
    from rollflow.tasks.generate.rollouts import select_prompts

    envs, out = build_envs(cfg), []
    for i, name in enumerate(sorted(envs)):
        out += select_prompts(
            {name: envs[name]},
            {name: 1.0},
            cfg.sampling.num_eval_prompts,
            "eval",
            seed=cfg.run.seed * 7919 + i,
        )
    return out


# ------------------------------------------------------------------------------ TRL


def trl_child(spec: dict) -> dict:
    import random

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollflow.tasks.generate.environments import Prompt
    from rollflow.tasks.generate.generate_task import build_envs

    t_start = time.perf_counter()
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    cfg = load_cfg(spec["workload"], spec["extra"], spec["minibatches"])
    s, t = cfg.sampling, cfg.train
    tok = AutoTokenizer.from_pretrained(spec["model"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], torch_dtype=torch.float32)
    env = next(iter(build_envs(cfg).values()))
    rng = random.Random(cfg.run.seed)
    bos = tok.bos_token
    train = env.prompts("train", spec["max_steps"] * t.mini_batch_size, rng)
    # TRL tokenizes a text prompt with the tokenizer's special tokens (this one adds <bos>), so it
    # gets the bare text; the ids must be rollflow's (bos + text): a doubled <bos> is a context the
    # policy never saw in its warm start: TRL then needed 1680 optimizer steps to 0.8, not 450 (seed 0).
    dataset = Dataset.from_list([{"prompt": p.text, "answer": p.answer} for p in train])
    for p in train[:16]:
        ids = tok(text=[p.text])["input_ids"][0]
        assert ids == tok(bos + p.text, add_special_tokens=False)["input_ids"], (
            f"TRL would see other prompt ids than rollflow: {ids}"
        )
    held_out = eval_prompts(cfg)

    def env_reward(
        prompts, completions, answer, **_
    ):  # the env's own reward, as rollflow scores it
        return [
            env.reward(Prompt(env.name, "", p, a), c)
            for p, c, a in zip(prompts, completions, answer, strict=True)
        ]

    @torch.no_grad()
    def evaluate(m) -> float:
        m.eval()
        enc = tok(
            [bos + p.text for p in held_out],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        out = m.generate(
            **enc,
            max_new_tokens=s.max_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        texts = tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        m.train()
        return sum(env.reward(p, x) for x, p in zip(texts, held_out, strict=True)) / len(held_out)

    curve, state = [], {"eval_s": 0.0, "reached": None, "train_start": None}

    class HeldOut(TrainerCallback):
        def on_train_begin(self, args, st, control, **kw):
            state["train_start"] = time.perf_counter()

        def on_step_end(self, args, st, control, model=None, **kw):
            if st.global_step % spec["eval_every"]:
                return
            e0 = time.perf_counter()
            reward = evaluate(model)
            state["eval_s"] += time.perf_counter() - e0
            train_s = time.perf_counter() - state["train_start"] - state["eval_s"]
            curve.append((st.global_step, round(train_s, 2), reward))
            print(f"TRL step {curve[-1]}", file=sys.stderr, flush=True)  # progress, live
            if reward >= spec["threshold"] and state["reached"] is None:
                state["reached"] = (st.global_step, train_s, reward)
                control.should_training_stop = True
            if train_s > spec["max_s"]:
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=spec["out"],
        per_device_train_batch_size=s.group_size * t.mini_batch_size,
        gradient_accumulation_steps=1,
        steps_per_generation=t.train_batch_size // t.mini_batch_size,
        num_generations=s.group_size,
        max_completion_length=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        beta=0.0,
        epsilon=t.loss.eps_low,
        epsilon_high=t.loss.eps_high,
        loss_type="dapo",
        scale_rewards="none",
        num_iterations=1,
        max_steps=spec["max_steps"],
        logging_steps=spec["eval_every"],  # into log_history: the diagnostics of --json-out
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=cfg.run.seed,
        disable_dropout=True,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=env_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[HeldOut()],
    )
    initial = evaluate(model)
    setup_s = time.perf_counter() - t_start
    trainer.train()
    last = curve[-1] if curve else (0, 0.0, initial)
    reached = state["reached"]
    return {
        "side": "TRL",
        "initial": initial,
        "reached": reached is not None,
        "steps": reached[0] if reached else last[0],
        "train_s": reached[1] if reached else last[1],
        "reward": reached[2] if reached else max(r for _, _, r in curve or [last]),
        "setup_s": setup_s,
        "eval_s": state["eval_s"],
        "curve": curve,
        "log": [
            {k: v for k, v in row.items() if k in TRL_LOG_KEYS} for row in trainer.state.log_history
        ],
    }


# What --json-out keeps of each side's per-step logs, to compare the two runs' training.
TRL_LOG_KEYS = ("step", "reward", "grad_norm", "frac_reward_zero_std", "clip_ratio/region_mean")
ROLLFLOW_LOG_KEYS = (
    "reward_mean",
    "grad_norm",
    "num_groups_kept",
    "clip_fraction",
    "num_optim_steps",
)


# ------------------------------------------------------------------------------ rollflow


def rollflow_side(spec: dict, tmp: Path) -> dict:
    """A real run with model.path = the shared policy; followed through its metrics, stopped at
    the threshold."""
    import pyarrow.parquet as pq
    import toml

    from rollflow.infra.config import dump_config

    name = "vs-trl"
    k = spec["minibatches"]  # optimizer steps per outer step: steps are counted as optimizer steps
    config = dump_config(load_cfg(spec["workload"], spec["extra"], spec["minibatches"]))
    config["model"] = {"path": spec["model"]}  # the shared policy, not the tiny recipe
    (tmp / "rollflow.toml").write_text(toml.dumps(config))
    cmd = [
        sys.executable,
        "-m",
        "rollflow.cli",
        "run",
        str(tmp / "rollflow.toml"),
        f"run.name={name}",
        f"run.storage={tmp}",
        f"run.num_steps={spec['max_steps'] // k}",
        f"run.eval_every={spec['eval_every'] // k}",
        f"train.max_staleness={spec['staleness']}",
        "run.checkpoint_every=100000",
        "metrics.sinks=[]",
    ]
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp / "prefect"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    log = open(tmp / "rollflow.log", "w")
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    metrics_dir = tmp / name / "metrics"
    rows: dict[int, dict] = {}
    reached, shown = None, 0
    try:
        while proc.poll() is None and reached is None:
            time.sleep(0.5)
            for f in sorted(metrics_dir.glob("*.parquet")) if metrics_dir.exists() else []:
                step = int(f.stem.split("=")[1])
                if step not in rows:
                    try:
                        rows[step] = pq.read_table(f).to_pylist()[0]
                    except Exception:  # noqa: BLE001 - being written; read it next time
                        continue
            train_s, curve = 0.0, []
            for step in sorted(rows):
                r = rows[step]
                if step == 0 or step - 1 not in rows and step != min(s for s in rows if s > 0):
                    continue
                train_s += r["step_s"] - (r.get("eval_phase_s") or 0.0)
                if r.get("eval_reward") is not None:
                    curve.append((step * k, round(train_s, 2), r["eval_reward"]))
                    if step * k > shown:  # progress, live
                        shown = step * k
                        print(f"rollflow step {curve[-1]}", file=sys.stderr, flush=True)
                    if r["eval_reward"] >= spec["threshold"]:
                        reached = curve[-1]
                        break
            if curve and curve[-1][1] > spec["max_s"]:
                break
    finally:
        wall_s = time.perf_counter() - start
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode not in (0, -signal.SIGTERM, None) and reached is None and not curve:
        sys.exit("rollflow failed:\n" + (tmp / "rollflow.log").read_text()[-4000:])
    first = sum(r["step_s"] for s, r in rows.items() if s > 0)
    last = curve[-1] if curve else (0, 0.0, rows.get(0, {}).get("eval_reward", float("nan")))
    return {
        "side": "rollflow",
        "initial": rows.get(0, {}).get("eval_reward"),
        "reached": reached is not None,
        "steps": (reached or last)[0],
        "train_s": (reached or last)[1],
        "reward": reached[2] if reached else max(r for _, _, r in curve or [last]),
        "setup_s": wall_s - first,
        "eval_s": sum(r.get("eval_phase_s") or 0.0 for r in rows.values()),
        "curve": curve,
        "log": [
            {"step": step * k, **{key: rows[step].get(key) for key in ROLLFLOW_LOG_KEYS}}
            for step in sorted(rows)
            if step > 0
        ],
    }


# ------------------------------------------------------------------------------ main


@contextlib.contextmanager
def seed_folder(keep: Path | None, seed: int):
    """A seed's folder: ``keep/seed-N`` (made, kept), or a temporary one."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="rollflow-bench-trl-") as tmp:
            yield tmp
        return
    folder = keep / f"seed-{seed}"
    folder.mkdir(parents=True, exist_ok=False)
    yield str(folder)


def common_steps(runs: list[dict]) -> dict[int, int]:
    """Per seed: the last evaluation every run of the seed reached (runs without one left out)."""
    ends: dict[int, int] = {}
    for r in runs:
        if r["curve"]:
            ends[r["seed"]] = min(ends.get(r["seed"], r["curve"][-1][0]), r["curve"][-1][0])
    return ends


def mean_held_out(run: dict, horizon: dict[int, int]) -> float:
    """The run's mean held-out over the evaluations at or before its seed's horizon."""
    rewards = [x for step, _, x in run["curve"] if step <= horizon.get(run["seed"], -1)]
    return statistics.fmean(rewards) if rewards else float("nan")


def wall_time_summary(results: list[dict]) -> str:
    """Per side, medians over the seeds of training s to the threshold, s per optimizer step and
    optimizer steps, the mean held-out over the common steps, and rollflow / TRL for each."""
    runs = {side: [r for r in results if r["side"] == side] for side in ("TRL", "rollflow")}
    runs = {side: rs for side, rs in runs.items() if rs}
    horizon = common_steps(results)
    figures = {
        side: {
            "train_s": statistics.median(r["train_s"] for r in rs),
            "s_per_step": statistics.median(r["train_s"] / max(1, r["steps"]) for r in rs),
            "steps": statistics.median(r["steps"] for r in rs),
            "held_out": statistics.fmean(mean_held_out(r, horizon) for r in rs),
        }
        for side, rs in runs.items()
    }
    rows = [
        [
            side,
            " ".join(str(r["seed"]) for r in runs[side]),
            f"{sum(r['reached'] for r in runs[side])}/{len(runs[side])}",
            f"{f['train_s']:.1f}",
            f"{f['s_per_step']:.3f}",
            f"{f['steps']:g}",
            f"{f['held_out']:.3f}",
        ]
        for side, f in figures.items()
    ]
    if len(figures) == 2:
        mine, trl = figures["rollflow"], figures["TRL"]
        rows.append(
            [
                "rollflow / TRL",
                "",
                "",
                f"{mine['train_s'] / trl['train_s']:.2f}×",
                f"{mine['s_per_step'] / trl['s_per_step']:.2f}×",
                f"{mine['steps'] / trl['steps']:.2f}×",
                f"{mine['held_out'] / trl['held_out']:.2f}× "
                f"({mine['held_out'] - trl['held_out']:+.3f})",
            ]
        )
    unreached = any(not r["reached"] for r in results)
    return table(
        [
            "side",
            "seeds",
            "reached",
            "median training s to threshold",
            "median s per optimizer step",
            "median optimizer steps to threshold",
            "mean held-out over common steps ("
            + ", ".join(f"seed {k}: ≤ {v}" for k, v in sorted(horizon.items()))
            + ")",
        ],
        rows,
    ) + (
        "\n(a run that did not reach the threshold counts its whole training time and steps: "
        "a lower bound)"
        if unreached
        else ""
    )


def compare(files: list[str], threshold: float | None = None) -> None:
    """Learning per optimizer step across saved runs: the crossing of a threshold is one noisy
    evaluation (held-out swings ±0.05 between evaluations), so the mean held-out over the
    evaluations every run reached is printed beside it. ``threshold``: the steps to it are read
    from each curve (runs made with ``--threshold 2`` run their whole length: equal curves)."""
    runs = []
    for item in files:
        label, _, path = item.partition("=")
        for r in json.loads(Path(path).read_text())["results"]:
            runs.append({**r, "label": f"{r['side']} ({label})"})
            if threshold is not None and r["curve"]:
                crossed = [step for step, _, x in r["curve"] if x >= threshold]
                runs[-1]["reached"] = bool(crossed)
                runs[-1]["steps"] = crossed[0] if crossed else r["curve"][-1][0]
    horizon = common_steps(runs)  # per seed: the last evaluation every run of the seed reached
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]
        means = [mean_held_out(r, horizon) for r in mine]
        rows.append(
            [
                label,
                " ".join(str(r["seed"]) for r in mine),
                " ".join(str(r["steps"]) + ("" if r["reached"] else "+") for r in mine),
                f"{statistics.median(r['steps'] for r in mine):g}",
                " ".join(f"{m:.3f}" for m in means),
                f"{statistics.fmean(means):.3f}",
            ]
        )
    print(
        table(
            [
                "runs",
                "seeds",
                "optimizer steps to the threshold",
                "median",
                "mean held-out over the steps all runs of the seed reached ("
                + ", ".join(f"seed {k}: ≤ {v}" for k, v in sorted(horizon.items()))
                + ")",
                "mean over seeds",
            ],
            rows,
        )
    )


def prepare_model(workload: str, extra: list[str]) -> str:
    from rollflow.flows.rl_run import prepare_policy

    return str(prepare_policy(load_cfg(workload, extra)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="a")
    parser.add_argument("--only", choices=["trl", "rollflow"])

    def per_workload(key: str) -> str:
        return (
            "default: the workload's ("
            + ", ".join(f"{name}: {w[key]}" for name, w in WORKLOADS.items())
            + ")"
        )

    parser.add_argument(
        "--staleness", type=float, help="rollflow's max_staleness; " + per_workload("staleness")
    )
    parser.add_argument(
        "--minibatches",
        type=int,
        help="optimizer steps per generation batch (TRL steps_per_generation, rollflow "
        "mini-batches); " + per_workload("minibatches"),
    )
    parser.add_argument("--max-steps", type=int)
    parser.add_argument(
        "--max-s", type=float, default=1800.0, help="training seconds before a side gives up"
    )
    parser.add_argument("--threshold", type=float)
    parser.add_argument(
        "--eval-every",
        type=int,
        help="optimizer steps between evaluations (a multiple of --minibatches; default the "
        "workload's, (a) 10 → 8). Evaluations far apart give the steps' cost without them: "
        "rollflow generates the next batch while it evaluates (the training seconds leave the "
        "evaluation out, and with it that generation)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        help="runs per side, run.seed = 0..N-1, and the medians' ratio; " + per_workload("seeds"),
    )
    parser.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="the first run.seed (default 0): --first-seed 5 --seeds 5 runs seeds 5..9, to add "
        "seeds to an earlier --json-out (--compare reads both files of a side)",
    )
    parser.add_argument(
        "--trl-path",
        default=os.environ.get("ROLLFLOW_TRL_PATH"),
        help="a folder holding TRL, on the TRL child's PYTHONPATH only (default: $ROLLFLOW_TRL_PATH)",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=1,
        help="TRL's torch threads (default 1, as rollflow's trainer on 2 cores: two OpenMP threads "
        "wait at every barrier for the one that shares a busy core; 0: torch's default)",
    )
    parser.add_argument(
        "--json-out", help="write every run's result, curve and per-step log to this JSON file"
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="LABEL=FILE",
        help="no runs: compare --json-out files' runs per optimizer step (steps to the threshold, "
        "mean held-out over the steps every run of a seed reached), each side of FILE labelled LABEL",
    )
    parser.add_argument(
        "--summary",
        nargs="+",
        metavar="FILE",
        help="no runs: the wall-time summary (per side and rollflow / TRL) of --json-out files, "
        "their seeds merged",
    )
    parser.add_argument(
        "--keep-runs",
        type=Path,
        metavar="DIR",
        help="keep each seed's folder under DIR/seed-N (rollflow's run: metrics per step with "
        "their phases, log, events), to see where a step's time goes",
    )
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for both sides")
    args = parser.parse_args()
    if args.trl_child:
        print(json.dumps(trl_child(json.loads(args.trl_child))))
        return
    if args.compare:
        compare(args.compare, args.threshold)
        return
    if args.summary:
        print(
            wall_time_summary(
                [r for f in args.summary for r in json.loads(Path(f).read_text())["results"]]
            )
        )
        return

    trl_paths = [args.trl_path] if args.trl_path else None  # None: the interpreter's own path
    if (
        args.only != "rollflow"
        and importlib.machinery.PathFinder.find_spec("trl", trl_paths) is None
    ):
        sys.exit(
            "bench/vs_trl.py needs TRL: .venv/bin/pip install -e '.[bench]', or --trl-path DIR "
            "(or pass --only rollflow)"
        )
    trl_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in [args.trl_path, os.environ.get("PYTHONPATH")] if p
        ),
    }
    machine = Machine()
    w = WORKLOADS[args.workload]
    args.minibatches = args.minibatches or w["minibatches"]
    args.staleness = w["staleness"] if args.staleness is None else args.staleness
    model = prepare_model(args.workload, args.overrides)
    spec = {
        "workload": args.workload,
        "extra": args.overrides,
        "model": model,
        "threshold": args.threshold or w["threshold"],
        # Both sides evaluate after the same optimizer steps: a multiple of K, where rollflow's
        # outer steps end (more evaluations are more chances for a noisy crossing).
        "eval_every": args.minibatches
        * max(1, (args.eval_every or w["eval_every"]) // args.minibatches),
        "max_steps": args.max_steps or w["max_steps"],
        "max_s": args.max_s,
        "staleness": args.staleness,
        "minibatches": args.minibatches,
        "threads": args.trl_threads,
    }
    seeds = args.seeds or w["seeds"]
    results = []

    def save(results: list[dict]) -> None:  # after every run: a long bench may be cut short
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"spec": spec, "results": results}))

    first = args.first_seed
    # a fresh storage and Prefect home per seed (the same run name resumes)
    for seed in range(first, first + seeds):
        run = {
            **spec,
            "extra": [*args.overrides, f"run.seed={seed}"],
        }  # prompt order and sampling, both sides
        with seed_folder(args.keep_runs, seed) as tmp:
            if args.only != "rollflow":
                child = subprocess.run(
                    [sys.executable, __file__, "--trl-child", json.dumps({**run, "out": tmp})],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,  # its result; its stderr (progress, errors) passes through
                    text=True,
                    env=trl_env,
                )
                if child.returncode:
                    sys.exit("TRL failed: its stderr is above")
                results.append({**json.loads(child.stdout.strip().splitlines()[-1]), "seed": seed})
                save(results)
                print(
                    f"seed {seed} TRL: done ({results[-1]['train_s']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            if args.only != "trl":
                results.append({**rollflow_side(run, Path(tmp)), "seed": seed})
                save(results)
                print(
                    f"seed {seed} rollflow: done ({results[-1]['train_s']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

    cfg = load_cfg(args.workload, args.overrides, args.minibatches)
    print(
        f"\nworkload ({args.workload}) {w['what']}: group {cfg.sampling.group_size}, "
        f"{cfg.train.mini_batch_size} prompts per optimizer step, {args.minibatches} optimizer step(s) per "
        f"generation batch, lr {cfg.train.lr:g}, threshold "
        f"{spec['threshold']} held-out reward (the env's: {cfg.envs[0].name}); rollflow max_staleness "
        f"{args.staleness}; seeds {first}..{first + seeds - 1}"
    )
    print(machine.line() + "\n")
    trl = {r["seed"]: r["train_s"] for r in results if r["side"] == "TRL"}
    print(
        table(
            [
                "side",
                "seed",
                "held-out at start",
                "reached",
                "optimizer steps",
                "training s to threshold (or to the end)",
                "vs TRL (same seed)",
                "s per optimizer step",
                "best held-out",
                "start-up s",
                "evaluation s (excluded)",
            ],
            [
                [
                    r["side"],
                    r["seed"],
                    f"{r['initial']:.3f}",
                    "yes" if r["reached"] else "NO",
                    r["steps"],
                    f"{r['train_s']:.1f}",
                    f"{r['train_s'] / trl.get(r['seed'], float('nan')):.2f}×",
                    f"{r['train_s'] / max(1, r['steps']):.3f}",
                    f"{r['reward']:.3f}",
                    f"{r['setup_s']:.0f}",
                    f"{r['eval_s']:.0f}",
                ]
                for r in results
            ],
        )
    )
    # Medians over the seeds: one run's crossing of the threshold is noisy (held-out swings
    # ~±0.1 between evaluations).
    print("\n" + wall_time_summary(results))
    for r in results:
        print(
            f"\n{r['side']} seed {r['seed']} curve (step, training s, held-out): "
            + ", ".join(
                f"({s}, {t:.0f}, {x:.2f})"
                for s, t, x in r["curve"][:: max(1, len(r["curve"]) // 15)]
            )
        )


if __name__ == "__main__":
    main()
