"""Screenshots of the Prefect UI for the docs: the run form, a running run, a finished run and
its artifacts, made the way a user meets them.

Starts a real `prefect server` (its UI included) in a temporary home, registers the quickstart's
deployment with `rollflow deploy`, starts a process worker, then in the distribution's Chromium
(`apt-get install chromium`) fills the run form (a short run: a smaller model, a few steps) and
submits it from the form itself. The pictures go to docs/assets/ui/.

    .venv/bin/python scripts/ui_screenshots.py [--steps 4] [--out docs/assets/ui]

About 4 minutes on 2 cores. The same form is driven by the suite (tests/deployed_run.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollflow.infra.processes import free_port  # noqa: E402
from rollflow.testing.browser import (  # noqa: E402
    browser,
    chromium,
    deployment_id,
    shoot_artifact,
    shoot_flow_run,
    submit_run_form,
    wait_for,
)

# The quickstart made small enough for a picture in minutes (tests/deployed_run.py's TINY).
SMALL = [
    "model.tiny.hidden_size=64",
    "model.tiny.num_heads=2",
    "model.tiny.intermediate_size=128",
    "model.warm_start_target=0.3",
    "model.warm_start_max_steps=50",
    "sampling.group_size=4",
    "sampling.num_eval_prompts=16",
    "train.train_batch_size=8",
    "train.mini_batch_size=4",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="the run's steps (typed in the form)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/assets/ui")
    args = parser.parse_args()
    if chromium() is None:
        print("ui_screenshots: no Chromium; install it: apt-get install chromium", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="rollflow-ui-"))
    port = free_port()
    api, ui = f"http://127.0.0.1:{port}/api", f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    bin_dir = Path(sys.executable).parent
    started: list[subprocess.Popen] = []

    def start(name: str, argv: list[str]) -> None:
        log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - kept open for the process
        started.append(
            subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )

    try:
        start(
            "server",
            [
                str(bin_dir / "rollflow"),
                "ui",
                "--port",
                str(port),
                "--home",
                str(tmp / "prefect-home"),
            ],
        )
        wait_for(lambda: _answers(f"{api}/health"), 180, f"prefect server at {api}")
        subprocess.run(
            [str(bin_dir / "rollflow"), "deploy", "configs/quickstart.toml"],
            env=env,
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        start(
            "worker",
            [
                str(bin_dir / "prefect"),
                "worker",
                "start",
                "--pool",
                "rollflow-cpu",
                "--type",
                "process",
            ],
        )
        overrides = [
            f"run.storage={tmp / 'runs'}",
            f"model.cache_dir={tmp / 'models'}",
            f"run.eval_every={max(1, args.steps // 2)}",
            *SMALL,
        ]
        shots = tmp / "shots"
        with browser() as page:
            run = submit_run_form(
                page,
                ui,
                api,
                deployment_id(api, "rl-run/quickstart"),
                {"Name (Optional)": "from-the-form", "Num Steps (Optional)": str(args.steps)},
                overrides,
                shots,
            )
            print(f"ui_screenshots: submitted flow run {run.flow_run_id} from the form")
            wait_for(
                lambda: (tmp / "runs/from-the-form/checkpoints/step=1/_SUCCESS").exists(),
                420,
                "the run's first step",
            )
            shoot_flow_run(page, ui, run.flow_run_id, shots / "running-run.png")
            state = lambda: _read(f"{api}/flow_runs/{run.flow_run_id}")["state"]["type"]  # noqa: E731
            wait_for(
                lambda: state() in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"),
                600,
                "the run's end",
            )
            print(f"ui_screenshots: the run ended {state()}")
            shoot_flow_run(page, ui, run.flow_run_id, shots / "finished-run.png")
            shoot_flow_run(
                page, ui, run.flow_run_id, shots / "finished-run-artifacts.png", tab="Artifacts"
            )
            drawn = shoot_artifact(
                page, ui, api, "from-the-form-curves", shots / "curves-artifact.png"
            )
            print(f"ui_screenshots: the curves artifact shows a {drawn}-pixel-wide plot")
        args.out.mkdir(parents=True, exist_ok=True)
        for shot in sorted(shots.glob("*.png")):
            shutil.copy(shot, args.out / shot.name)
            print(f"ui_screenshots: {args.out / shot.name}")
        return 0 if state() == "COMPLETED" else 1
    finally:
        for proc in reversed(started):
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in started:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _read(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def _answers(url: str) -> bool:
    try:
        _read(url)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
