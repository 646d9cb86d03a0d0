"""The ``rollflow`` command line.

    rollflow run CONFIG [key.path=value ...] [--dry-run]

Config errors are reported before anything heavy is imported, so a misspelt key fails at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollflow", description="Asynchronous RL post-training as Prefect flows.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train (or resume) the run a config describes")
    run.add_argument("config", help="TOML config, e.g. configs/quickstart.toml")
    run.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.lr=2e-4")
    run.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, then exit")
    # Overrides may come before or after flags: take every leftover key=value as an override.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if "=" not in e or e.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    return cmd_run(args)


def cmd_run(args: argparse.Namespace) -> int:
    from rollflow.infra.config import ConfigError, dump_config, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(json.dumps(dump_config(cfg), indent=2))
        return 0
    _quiet_prefect()
    from rollflow.flows.rl_run import rl_run
    from rollflow.infra.prefect_api import local_prefect_api

    with local_prefect_api():
        rl_run(dump_config(cfg))
    return 0


def _quiet_prefect() -> None:
    """Per-step progress is ours to print; Prefect logs warnings and errors unless asked for more."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")


if __name__ == "__main__":
    sys.exit(main())
