"""The whole job as one Prefect flow: prepare the policy, start the services, loop the steps.

Running the same config again resumes: the run continues after its last committed checkpoint,
never redoing a committed step (see docs/architecture.md, "Resume").
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

from prefect import flow

from rollflow.flows.artifacts import RunProgress, publish_summary
from rollflow.flows.train_step import train_step
from rollflow.infra.config import RunConfig, dump_config, validate_config
from rollflow.infra.context import RunContext
from rollflow.infra.deployment import RunServices
from rollflow.infra.storage import RunStorage
from rollflow.tasks.generate.task import build_envs, evaluate
from rollflow.tasks.train.warm_start import prepare_tiny_model

LOCAL_CACHE = Path("~/.cache/rollflow/checkpoints").expanduser()


def say(message: str) -> None:
    print(message, flush=True)


@flow(name="rl-run", flow_run_name="{config[run][name]}", persist_result=False, validate_parameters=False)
def rl_run(config: dict) -> dict:
    """Train the policy of ``config`` (a RunConfig as a dict) for ``run.num_steps`` steps."""
    cfg = config if isinstance(config, RunConfig) else validate_config(config)
    storage = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options)
    _record_config(storage, cfg)
    base_model = prepare_policy(cfg)
    committed = storage.committed_steps("checkpoints")
    resumed_from = committed[-1] if committed else 0
    if resumed_from >= cfg.run.num_steps:
        say(f"run {cfg.run.name}: all {cfg.run.num_steps} steps are already committed in {storage.uri}")
        return summarize(storage)
    if resumed_from:
        say(f"run {cfg.run.name}: resuming after committed step {resumed_from}")
        policy_dir = storage.local_copy("checkpoints", resumed_from, LOCAL_CACHE)
    else:
        policy_dir = base_model
    storage.append_event("run_started", resumed_from=resumed_from)
    progress = RunProgress(cfg.run.name, cfg.run.num_steps, resumed_from)
    log_dir = _log_dir(storage)
    with RunServices(cfg, policy_dir, resumed_from or None, log_dir, progress=say) as services:
        ctx = RunContext(config=cfg, model_path=str(base_model), trainer=services.trainer,
                         inference=services.inference_ep)
        if resumed_from == 0 and not storage.read_metrics():
            ev = evaluate(ctx)
            storage.write_metrics(0, {"eval_reward": ev["eval_reward"],
                                      **{f"eval_reward/{e}": r for e, r in ev["eval_reward_by_env"].items()}})
            say(f"step 0: held-out reward {_fmt_env(ev['eval_reward'], ev['eval_reward_by_env'])}")
        for step in range(resumed_from + 1, cfg.run.num_steps + 1):
            services.check_alive()
            metrics = train_step(ctx, step, resumed_from)
            say(progress_line(step, cfg.run.num_steps, metrics))
            progress.update(step)
        storage.append_event("training_finished", step=cfg.run.num_steps)
    publish_summary(storage)
    return summarize(storage, say)


def prepare_policy(cfg: RunConfig) -> Path | str:
    """The starting policy: the configured HF model, or a tiny model warm-started on the envs."""
    if cfg.model.path is not None:
        return cfg.model.path
    envs = build_envs(cfg)
    rng = random.Random(cfg.run.seed)
    train_pairs, eval_pairs = [], []
    for name in sorted(envs):
        env = envs[name]
        if not hasattr(env, "sft_examples"):
            raise ValueError(f"[model.tiny] needs envs with sft_examples() for its warm start; {name!r} has none")
        train_pairs += env.sft_examples(4096, rng)
        eval_pairs += [(p.text, p.answer) for p in env.prompts("eval", 128, rng)]
    recipe = {"envs": [e.model_dump() for e in cfg.envs], "target": cfg.model.warm_start_target,
              "max_steps": cfg.model.warm_start_max_steps, "lr": cfg.model.warm_start_lr}
    return prepare_tiny_model(cfg.model.tiny, train_pairs=train_pairs, eval_pairs=eval_pairs,
                              target=cfg.model.warm_start_target, max_steps=cfg.model.warm_start_max_steps,
                              lr=cfg.model.warm_start_lr, cache_dir=cfg.model.cache_dir, recipe=recipe,
                              progress=say)


def _record_config(storage: RunStorage, cfg: RunConfig) -> None:
    """Write config.json once; a rerun with a different config says what changed."""
    resolved = dump_config(cfg)
    old = storage.read_json("config.json")
    if old is None:
        storage.write_json("config.json", resolved)
    elif old != resolved:
        changed = sorted(_diff(old, resolved))
        say(f"note: config differs from the run's first config.json in {', '.join(changed)}; "
            "continuing with the new values")


def _diff(a: dict, b: dict, prefix: str = "") -> set[str]:
    out = set()
    for key in set(a) | set(b):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out |= _diff(x, y, f"{prefix}{key}.")
        elif x != y:
            out.add(prefix + key)
    return out


def _log_dir(storage: RunStorage) -> Path:
    if storage.is_local:
        return Path(storage.path("logs"))
    return Path("~/.cache/rollflow/logs").expanduser() / storage.run


def _fmt_env(total: float, by_env: dict[str, float]) -> str:
    parts = ", ".join(f"{k} {v:.2f}" for k, v in by_env.items())
    return f"{total:.3f} ({parts})" if len(by_env) > 1 else f"{total:.3f}"


def progress_line(step: int, num_steps: int, m: dict) -> str:
    """One line per step: reward, what was kept, loss, and where the time went."""
    line = (f"step {step}/{num_steps}: reward {m['reward_mean']:.3f}, kept {m['num_groups_kept']} groups, "
            f"loss {m.get('loss', math.nan):+.4f} | gen {m['generate_phase_s']:.2f}s "
            f"train {m['train_phase_s']:.2f}s sync {m['sync_phase_s']:.2f}s | step {m['step_s']:.2f}s")
    if "eval_reward" in m:
        by_env = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("eval_reward/")}
        line += f"\n  held-out reward {_fmt_env(m['eval_reward'], by_env)}"
    return line


def summarize(storage: RunStorage, out=lambda _: None) -> dict:
    """First and last held-out reward of the run, and where its data is."""
    evals = [(r["step"], r["eval_reward"]) for r in storage.read_metrics()
             if r.get("eval_reward") is not None and not math.isnan(r["eval_reward"])]
    summary = {"run": storage.run, "uri": storage.uri, "steps_committed": storage.committed_steps("checkpoints")[-1:]}
    if evals:
        summary.update(first_eval_reward=evals[0][1], last_eval_reward=evals[-1][1])
        out(f"done: held-out reward {evals[0][1]:.3f} (step {evals[0][0]}) -> {evals[-1][1]:.3f} "
            f"(step {evals[-1][0]}); rollouts in {storage.uri}/rollouts")
    summary["finished_at"] = time.time()
    return summary
