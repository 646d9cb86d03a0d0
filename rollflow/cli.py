"""The ``rollflow`` command line.

    rollflow run CONFIG [key.path=value ...] [--dry-run]
    rollflow plan CONFIG [key.path=value ...] [--gpus N] [--nodes M]
    rollflow status [RUN] [--storage ROOT] [--storage-option KEY=VALUE ...] [--config CONFIG]
    rollflow scale [RUN] --servers N [--storage ROOT] [--storage-option ...] [--config CONFIG]
    rollflow deploy [CONFIG ...] [--pool NAME] [--prefect-file prefect.yaml]
    rollflow export [RUN] --step N [--out DIR] [--merged] [--storage ROOT] [--storage-option ...]
                    [--config CONFIG]
    rollflow ui [--port N] [--host HOST] [--home DIR] [--timeout S]
    rollflow prepare {gsm8k,math} SOURCE OUT [--split S] [--subset S]
    rollflow eval CONFIG (--checkpoint STEP | --model PATH) [--samples K] [key.path=value ...]

``status``, ``scale`` and ``export`` find the run as ``rollflow run`` does: by its config file, or
by its name, storage root and storage options (infra/storage_access.py).

Config errors are reported before anything heavy is imported, so a misspelt key fails at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rollflow.infra.metric_names import Metric

# `rollflow run`'s exit status when it stopped because the Prefect API or the object store did
# not answer within its deadline setting (EX_TEMPFAIL: rerun it once the service is back).
OUTAGE_EXIT = 75


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rollflow", description="Asynchronous RL post-training as Prefect flows."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train (or resume) the run a config describes")
    run.add_argument("config", help="TOML config, e.g. configs/quickstart.toml")
    run.add_argument(
        "overrides",
        nargs="*",
        help="key.path=value overrides, e.g. train.lr=2e-4; ~key.path or key.path=none removes a key",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="run the preflight (config, model folder or cache, storage, envs, metric sinks, disk; "
        "no download), print the resolved config, exit",
    )
    run.add_argument(
        "--debug",
        action="store_true",
        help="print tracebacks and Prefect's log on the terminal too (they are always in run.log)",
    )
    plan = sub.add_parser(
        "plan",
        help="print where every process of the run goes: devices, weight-group ranks, and the "
        "commands of the trainer nodes you start yourself",
    )
    plan.add_argument("config", help="TOML config, e.g. configs/quickstart.toml")
    plan.add_argument("overrides", nargs="*", help="key.path=value overrides")
    plan.add_argument("--gpus", type=int, help="GPUs per node (default: this machine's)")
    plan.add_argument("--nodes", type=int, help="nodes (default: trainer.num_nodes)")
    status = sub.add_parser("status", help="a table of a run's steps: reward, evaluation, timings")
    add_run_arguments(status)
    scale = sub.add_parser(
        "scale",
        help="grow or shrink a running run's vLLM fleet (up to inference.max_servers); the run "
        "applies it within seconds, a rerun starts with it",
    )
    scale.add_argument("--servers", type=int, required=True, help="how many vLLM servers")
    add_run_arguments(scale)
    deploy = sub.add_parser(
        "deploy",
        help="register the deployments of prefect.yaml on the Prefect server "
        "(PREFECT_API_URL), creating their work pools when missing",
    )
    deploy.add_argument(
        "configs",
        nargs="*",
        metavar="CONFIG",
        help="register rl-run/<config name> for these configs only (default: every deployment)",
    )
    deploy.add_argument(
        "--pool", help="work pool of prefect.yaml to deploy on, e.g. rollflow-gpu-kubernetes"
    )
    deploy.add_argument("--prefect-file", default="prefect.yaml", help="default: prefect.yaml")
    export = sub.add_parser(
        "export", help="write a committed checkpoint as a Hugging Face model folder"
    )
    export.add_argument(
        "--step", type=int, required=True, help="a step with a committed checkpoint"
    )
    export.add_argument("--out", help="folder to create, default: exports/<run>-step-<N>")
    export.add_argument(
        "--merged",
        action="store_true",
        help="LoRA runs: write the merged model instead of the adapter alone",
    )
    add_run_arguments(export)
    ui = sub.add_parser(
        "ui",
        help="start a local Prefect server with its UI (until Ctrl-C) and print the URL and the "
        "PREFECT_API_URL=... rollflow run line that runs against it",
    )
    ui.add_argument("--port", type=int, help="default: 4200 when free, else a free port (printed)")
    ui.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default: 127.0.0.1); 0.0.0.0 serves every interface, and the UI's "
        "pages then call the API at the address the browser opened them at",
    )
    ui.add_argument(
        "--home",
        help="PREFECT_HOME of the server: its database (runs stay from one start to the next) "
        "and server.log; default: ~/.rollflow/prefect",
    )
    ui.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="seconds the server has to answer /api/health (default: 180)",
    )
    serve = sub.add_parser(
        "serve",
        help="start a vLLM server of the config's model as a run starts its own, for runs to "
        "sample from (inference.urls); prints the lines that hand its URL and key to a run; "
        "until Ctrl-C",
    )
    serve.add_argument("config", help="TOML config (its model and inference sections)")
    serve.add_argument("overrides", nargs="*", help="key.path=value overrides")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="default: 8000")
    serve.add_argument(
        "--dry-run", action="store_true", help="print the server's command line, start nothing"
    )
    prepare = sub.add_parser(
        "prepare",
        help="write a GSM8K- or MATH-style dataset (a hub id or a local file) as the math env "
        "reads it: problem, answer (the final answer alone), solution",
    )
    prepare.add_argument(
        "style",
        choices=["gsm8k", "math"],
        help="gsm8k: question + answer ending '#### 42'; math: problem + solution with \\boxed{}",
    )
    prepare.add_argument(
        "source", help="hub id (read through the hub cache) or local json/jsonl/parquet/csv file"
    )
    prepare.add_argument("out", help="the .jsonl or .parquet file to write")
    prepare.add_argument("--split", help="split of the source (default: train)")
    prepare.add_argument("--subset", help="configuration of a hub dataset, e.g. main for gsm8k")
    prepare.add_argument("--question-column", help="default: question (gsm8k), problem (math)")
    prepare.add_argument("--solution-column", help="default: answer (gsm8k), solution (math)")
    evaluate = sub.add_parser(
        "eval",
        help="evaluate a committed checkpoint of the config's run, or a model folder, on the "
        "config's held-out prompts on vLLM: mean reward and pass@k per env; Parquet in "
        "<run>/evals/, a table here",
    )
    evaluate.add_argument("config", help="the run's TOML config (its envs, sampling, run)")
    evaluate.add_argument("overrides", nargs="*", help="key.path=value overrides")
    which = evaluate.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--checkpoint", type=int, metavar="STEP", help="a step with a committed checkpoint"
    )
    which.add_argument("--model", metavar="PATH", help="a Hugging Face model folder")
    evaluate.add_argument(
        "--samples",
        type=int,
        metavar="K",
        help="samples per prompt (default: sampling.eval_samples, 1 = greedy); K > 1 reports "
        "pass@1..K",
    )
    # Overrides may come before or after flags: take every leftover key=value as an override.
    args, extra = parser.parse_known_args(argv)
    if args.command in ("run", "plan", "eval", "serve"):
        unknown = [
            e for e in extra if e.startswith("-") or ("=" not in e and not e.startswith("~"))
        ]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.overrides = [*args.overrides, *extra]
        commands = {"run": cmd_run, "plan": cmd_plan, "eval": cmd_eval, "serve": cmd_serve}
        return commands[args.command](args)
    if args.command != "run":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        commands = {
            "status": cmd_status,
            "scale": cmd_scale,
            "deploy": cmd_deploy,
            "export": cmd_export,
            "ui": cmd_ui,
            "prepare": cmd_prepare,
        }
        return commands[args.command](args)
    raise AssertionError(args.command)  # pragma: no cover


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How a command on an existing run finds it: by name and storage, or by its config."""
    parser.add_argument("run", nargs="?", help="run name (run.name); default: the config's")
    parser.add_argument(
        "--storage", help="storage root (run.storage); default: the config's, else runs"
    )
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an fsspec option of the storage (run.storage_options), repeatable, e.g. "
        "endpoint_url=http://127.0.0.1:9000; never credentials: those stay in the environment",
    )
    parser.add_argument(
        "--config",
        help="the run's TOML config: its run.name, run.storage, run.storage_options and "
        "run.storage_secret (the flags above win over them)",
    )


def open_run_of(args: argparse.Namespace):
    """The ``RunStorage`` and ``RunAddress`` of the run the flags name (raises ``InputError``,
    ``StorageError``: one line each)."""
    from rollflow.infra.storage_access import open_run, run_address

    address = run_address(args.run, args.storage, args.storage_option, args.config)
    return open_run(address), address


def cmd_run(args: argparse.Namespace) -> int:
    from rollflow.infra.terminal import quiet_prefect_console

    quiet_prefect_console(args.debug)  # before anything imports Prefect
    from rollflow.infra.config import ConfigError, dump_config, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        for line in config_error_lines(str(exc)):
            print(f"error: {line}", file=sys.stderr)
        return 2
    # Credentials in run.storage_options never reach Prefect or config.json (infra/secrets.py).
    from rollflow.infra.secrets import take_secrets_out

    moved = take_secrets_out(cfg.run)
    if moved:
        print(
            f"note: run.storage_options {', '.join(moved)} kept out of the stored config "
            "(better: the environment, or run.storage_secret)",
            file=sys.stderr,
        )
    # Preflight before the Prefect API or any service starts: model, storage, envs, sinks, disk.
    from rollflow.flows.preflight import PreflightError, preflight

    try:
        preflight(cfg, dry_run=args.dry_run, note=lambda line: print(line, file=sys.stderr))
    except PreflightError as exc:
        for line in exc.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(dump_config(cfg), indent=2))
        return 0
    return _train(cfg, args)


def config_error_lines(message: str) -> list[str]:
    """``c.toml: invalid config`` + one indented line per problem -> ``c.toml: <problem>`` each."""
    head, *details = message.splitlines()
    if not details:
        return [head]
    source = head.removesuffix("invalid config").rstrip(": ")
    return [f"{source}: {line.strip()}" for line in details]


def _train(cfg, args: argparse.Namespace) -> int:
    """The run itself. An error is one line (its traceback in run.log, and here with --debug);
    Ctrl-C or SIGTERM stops it: one line with what is committed and the command that resumes."""
    from rollflow.infra import terminal
    from rollflow.infra.config import dump_config
    from rollflow.infra.outage import OutageStop, install_stop_handler, pending_reason
    from rollflow.infra.prefect_api import local_prefect_api
    from rollflow.infra.storage import RunStorage

    terminal.stop_on_sigterm()
    install_stop_handler()  # a service's outage past its deadline stops the run as Ctrl-C does
    log_path = None
    loaded = {}

    def import_run_flow() -> None:  # ~7 s, while the private Prefect API starts on another core
        from rollflow.flows.rl_run import rl_run

        loaded["rl_run"] = rl_run

    try:
        storage = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options)
        log_path = terminal.attach_run_log(storage.log_dir(), args.debug)
        with local_prefect_api(meanwhile=import_run_flow):
            loaded["rl_run"](dump_config(cfg))
    except KeyboardInterrupt as exc:
        terminal.log_failure(exc, log_path)
        print(terminal.stopped_line(exc, cfg, args.config, args.overrides), file=sys.stderr)
        if isinstance(exc, OutageStop) or pending_reason():
            # A service the run needs did not answer in time. Threads still in a request to it
            # would hold the exit until their clients give up (minutes); all that the run
            # started is stopped already.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(OUTAGE_EXIT)
        return 143 if isinstance(exc, terminal.Stopped) else 130
    except Exception as exc:
        terminal.log_failure(exc, log_path)
        if pending_reason():  # the outage's stop, then a failed call to that service on the way out
            line = terminal.stopped_line(KeyboardInterrupt(), cfg, args.config, args.overrides)
            print(line, file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(OUTAGE_EXIT)
        if args.debug:
            import traceback

            traceback.print_exception(exc, file=sys.stderr)
        print(f"error: {terminal.one_line(exc)}", file=sys.stderr)
        if log_path is not None and not args.debug:
            print(f"  (traceback in {log_path}; --debug prints it here)", file=sys.stderr)
        return 1
    return 0


# (metrics key, header, format): every cell is 8 characters wide.
STATUS_COLUMNS = (
    (Metric.STEP, "step", "{:>8}"),
    (Metric.REWARD_MEAN, "reward", "{:>8.3f}"),
    (Metric.EVAL_REWARD, "eval", "{:>8.3f}"),
    (Metric.NUM_GROUPS_KEPT, "kept", "{:>8}"),
    (Metric.LOSS, "loss", "{:>+8.4f}"),
    (Metric.STALENESS_MEAN, "stale", "{:>8.2f}"),
    (Metric.STALENESS_MAX, "stale_mx", "{:>8}"),
    (Metric.GENERATE_PHASE_S, "gen_s", "{:>8.2f}"),
    (Metric.ADVANTAGE_PHASE_S, "adv_s", "{:>8.2f}"),
    (Metric.TRAIN_PHASE_S, "train_s", "{:>8.2f}"),
    (Metric.TRAINER_WAIT_FOR_DATA_S, "wait_s", "{:>8.2f}"),
    (Metric.SYNC_PHASE_S, "sync_s", "{:>8.2f}"),
    (Metric.STEP_S, "step_s", "{:>8.2f}"),
)
ALWAYS_SHOWN = {
    Metric.STEP,
    Metric.REWARD_MEAN,
    Metric.EVAL_REWARD,
    Metric.NUM_GROUPS_KEPT,
    Metric.LOSS,
}


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the placement plan of a config on this machine or the one ``--gpus/--nodes`` describe."""
    from rollflow.infra.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        print(render_plan(cfg, args.gpus, args.nodes))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def render_plan(cfg, gpus: int | None = None, nodes: int | None = None) -> str:
    """The plan of ``cfg`` as ``rollflow plan`` prints it (raises ``PlanError`` if impossible)."""
    from rollflow.infra.placement import Machine, make_plan, resolve_addresses
    from rollflow.infra.storage import RunStorage
    from rollflow.services.trainer_process import node_argv

    cfg = resolve_addresses(cfg)
    here = Machine.here()
    machine = Machine(
        gpus=here.gpus if gpus is None else gpus,
        nodes=nodes or cfg.trainer.num_nodes,
        cpus=here.cpus,
        visible=here.visible if gpus is None else None,  # --gpus: another machine
    )
    plan = make_plan(cfg, machine)
    log_dir = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options).log_dir()
    commands = {
        p.name: node_argv(
            cfg.trainer, p.node, log_dir / "trainer-args.json", cfg.trainer.master_port, p.env
        )
        for p in plan.trainer_nodes
        if p.node > 0
    }
    return plan.render(commands)


def cmd_status(args: argparse.Namespace) -> int:
    """Print one line per metrics row of a run (reads Parquet only: fast).

    Staleness and timing columns appear when some row has them (runs of older versions lack some).
    """
    from rollflow.infra.errors import InputError, StorageError
    from rollflow.infra.events import Event, has_event
    from rollflow.infra.storage_access import storage_errors

    try:
        storage, address = open_run_of(args)
        with storage_errors(address):
            rows = storage.read_metrics()
            committed = storage.committed_steps("checkpoints")
            finished = has_event(storage, Event.TRAINING_FINISHED)
    except (InputError, StorageError) as exc:
        return fail(exc)
    if not rows:
        print(
            f"error: no metrics for run {storage.run!r} in {storage.uri}; "
            "is --storage the run's run.storage?",
            file=sys.stderr,
        )
        return 2
    present = set().union(*rows)
    columns = [c for c in STATUS_COLUMNS if c[0] in ALWAYS_SHOWN or c[0] in present]
    print(" ".join(f"{header:>8}" for _, header, _ in columns))
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            missing = value is None or value != value  # absent or NaN
            cells.append(f"{'-':>8}" if missing else fmt.format(value))
        print(" ".join(cells))
    print(
        f"{len(committed)} steps committed (last: {committed[-1] if committed else '-'})"
        f"{', training finished' if finished else ''}; data in {storage.uri}"
    )
    return 0


def fail(exc: Exception) -> int:
    """A command on a run that could not be done: its one line (a config's: one per problem)."""
    from rollflow.infra.errors import ConfigError
    from rollflow.infra.terminal import one_line

    lines = config_error_lines(str(exc)) if isinstance(exc, ConfigError) else [one_line(exc)]
    for line in lines:
        print(f"error: {line}", file=sys.stderr)
    return 2


def cmd_scale(args: argparse.Namespace) -> int:
    """Ask a run for ``--servers`` vLLM servers (``control/fleet.json`` in its storage)."""
    from rollflow.infra.errors import InputError, StorageError
    from rollflow.infra.storage_access import storage_errors
    from rollflow.infra.vllm_fleet.fleet import scale_run

    try:
        _, address = open_run_of(args)
        with storage_errors(address):
            print(scale_run(address.run, args.servers, address.root, address.options))
    except (InputError, StorageError) as exc:
        return fail(exc)
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    """Register deployments on the configured Prefect server (see flows/deploy.py)."""
    from pathlib import Path

    from rollflow.flows.deploy import deploy
    from rollflow.infra.errors import InputError, ServiceError

    try:
        deploy(Path(args.prefect_file), args.configs, args.pool)
    except (InputError, ServiceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Copy a committed checkpoint, less its trainer state, to a Hugging Face model folder."""
    from rollflow.infra.errors import InputError, StorageError
    from rollflow.infra.export import export_checkpoint
    from rollflow.infra.storage_access import storage_errors

    try:
        storage, address = open_run_of(args)
        out = args.out or f"exports/{address.run}-step-{args.step}"
        with storage_errors(address):
            path = export_checkpoint(
                storage, args.step, out, show_progress=sys.stderr.isatty(), merged=args.merged
            )
    except (InputError, StorageError) as exc:
        return fail(exc)
    if (path / "adapter_config.json").exists():
        print(
            f"exported the LoRA adapter of step {args.step} of run {address.run} to {path}; load it "
            f"with PeftModel.from_pretrained(base_model, {str(path)!r}) or `vllm serve BASE "
            f"--enable-lora --lora-modules policy={path}` (--merged writes the merged model)"
        )
        return 0
    print(
        f"exported step {args.step} of run {address.run} to {path}; load it with "
        f"AutoModelForCausalLM.from_pretrained({str(path)!r}) or `vllm serve {path}`"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """A checkpoint or a model folder on the config's held-out prompts (flows/evaluate_model.py)."""
    from rollflow.infra.terminal import quiet_prefect_console

    quiet_prefect_console(False)  # before anything imports Prefect
    from rollflow.infra.config import ConfigError, load_config

    if args.samples is not None and args.samples < 1:
        print(f"error: --samples {args.samples}: give 1 or more", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        return fail(exc)
    from rollflow.flows.evaluate_model import evaluate_model
    from rollflow.infra.errors import InferenceError, InputError, StorageError
    from rollflow.tasks.generate.evaluation import render_table

    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    try:
        result = evaluate_model(
            cfg, step=args.checkpoint, model=args.model, samples=args.samples, progress=say
        )
    except (InputError, StorageError, InferenceError) as exc:
        return fail(exc)
    print(render_table(result.evaluation))
    print(f"{result.label}: written to {', '.join(result.written)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """A vLLM server of the config's model for runs to use (services/started_server.py)."""
    from rollflow.infra.config import load_config
    from rollflow.infra.errors import InputError, ServiceError

    try:
        cfg = load_config(args.config, [*args.overrides, "inference.urls=[]"])
        from rollflow.flows.rl_run import prepare_policy
        from rollflow.services.started_server import serve

        return serve(cfg, prepare_policy(cfg), args.host, args.port, args.dry_run)
    except (InputError, ServiceError) as exc:
        return fail(exc)


def cmd_prepare(args: argparse.Namespace) -> int:
    """A GSM8K- or MATH-style dataset as the math env reads it (tasks/generate/prepare_data.py)."""
    from rollflow.infra.errors import InputError
    from rollflow.tasks.generate.prepare_data import prepare

    try:
        prepared = prepare(
            args.style,
            args.source,
            args.out,
            split=args.split,
            subset=args.subset,
            question_column=args.question_column,
            solution_column=args.solution_column,
        )
    except InputError as exc:
        return fail(exc)
    print(
        f'{prepared.summary()}; train on it with [[envs]] name = "math", '
        f'args = {{ path = "{prepared.out}" }}'
    )
    return 0


def cmd_ui(args: argparse.Namespace) -> int:
    """Hold a local Prefect server with its UI until Ctrl-C (infra/prefect_ui.py)."""
    from rollflow.infra.errors import ServiceError
    from rollflow.infra.prefect_ui import serve

    try:
        serve(
            args.host, args.port, args.home, args.timeout, out=lambda line: print(line, flush=True)
        )
    except ServiceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
