"""An environment whose reward needs a server of its own (a judge or tool server: here a real
process over HTTP) loses it while the run's producer samples from a real vLLM server: its groups
become error rows (counted, never trained on), after ``sampling.env_quarantine_after`` of them
the environment is quarantined and the other one fills the batches; once the server is back, a
probe group succeeds and the environment gets groups again. Rides on the session's vLLM server.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from functools import partial

import pytest

from rollflow.infra import http
from rollflow.infra.config import load_config
from rollflow.infra.processes import ManagedProcess, free_port
from rollflow.tasks.generate.environments import SortLettersEnv
from rollflow.tasks.generate.generate_task import build_envs, make_rollout_context
from rollflow.tasks.generate.host import ProducerHost
from rollflow.tasks.generate.quarantine import group_error

pytestmark = pytest.mark.slow

JUDGE = """
import http.server, json, sys

class Judge(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps({"reward": float(body["completion"].strip() == body["answer"])}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Judge).serve_forever()
"""
JUDGED = f"{__name__}:JudgedSortEnv"


class JudgedSortEnv(SortLettersEnv):
    """sort_letters, scored by the judge server at ``url``."""

    def __init__(self, url: str = "", **kwargs):
        super().__init__(**kwargs)
        self.url = url

    def reward(self, prompt, completion: str) -> float:
        # The process's shared client: httpx.post would build a TLS context per call (~70 ms).
        answer = http.client().post(
            self.url, json={"completion": completion, "answer": prompt.answer}, timeout=5
        )
        answer.raise_for_status()
        return answer.json()["reward"]


def start_judge(port: int, log) -> ManagedProcess:
    judge = ManagedProcess("judge", [sys.executable, "-c", JUDGE, str(port)], log)
    judge.start()
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return judge
        assert judge.is_alive() and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def test_an_env_whose_server_is_down_is_quarantined_then_admitted_again(
    vllm_server, vllm_model_dirs, tmp_path
):
    port = free_port()
    model = str(vllm_model_dirs[0])
    cfg = load_config(
        None,
        [
            f"model.path='{model}'",
            f"envs=[{{name='{JUDGED}', args={{url='http://127.0.0.1:{port}/'}}}}, "
            "{name='reverse_letters'}]",
            f"run.storage='{tmp_path / 'runs'}'",
            "train.train_batch_size=8",
            "train.mini_batch_size=8",
            "train.max_staleness=0",
            "train.dynamic_sampling=false",  # each step takes exactly the groups it admitted
            "sampling.group_size=2",
            "sampling.max_tokens=6",
            "sampling.env_quarantine_after=2",
            "sampling.env_probe_every_s=0.5",
        ],
    )
    judge = start_judge(port, tmp_path / "judge.log")
    host = ProducerHost(
        cfg,
        build_envs(cfg),
        partial(make_rollout_context, cfg, model, temperature=1.0),
        [vllm_server.url],
        resumed_from=0,
    )
    step = 0

    def take() -> tuple[dict[str, list], dict]:
        """One step's groups by environment (error groups under 'error:<env>'), its metrics."""
        nonlocal step
        step += 1
        groups, metrics = host.take(step, timeout_s=120)
        host.set_version(step)  # as the step's sync would
        by_env: dict[str, list] = {}
        for g in groups:
            failed, _ = group_error(g.result)  # the quarantine's own rule
            by_env.setdefault(("error:" if failed else "") + g.prompt.env, []).append(g)
        return by_env, metrics

    try:
        up, metrics = take()
        assert set(up) == {JUDGED, "reverse_letters"}, up.keys()
        assert metrics["envs_quarantined"] == 0

        judge.stop(timeout_s=5)  # the judge server goes down
        quarantined_at = None
        for _ in range(8):
            down, metrics = take()
            if metrics[f"env_quarantined/{JUDGED}"] == 1:
                quarantined_at = step
                break
        assert quarantined_at is not None, "the judged env was never quarantined"
        errors = [s.error for g in down.get(f"error:{JUDGED}", []) for s in g.result]
        # Refused, or reset or cut short when the judge went down with a request in flight.
        transport = r"reward: (ConnectError|ReadError|WriteError|RemoteProtocolError): "
        assert errors and not [e for e in errors if not re.match(transport, e)], errors
        assert metrics["quarantines_total"] == 1 and metrics["envs_quarantined"] == 1
        # While down, the other environment fills the batches; the judged one gets only probes
        # (and the groups admitted before the quarantine), which fail: nothing of it is trained.
        set_aside = metrics["quarantine_set_aside_total"]
        for _ in range(2):
            down, metrics = take()
            assert JUDGED not in down and "reverse_letters" in down, down.keys()
        assert metrics["quarantine_set_aside_total"] > set_aside

        judge = start_judge(port, tmp_path / "judge.log")  # back, at the same address
        for _ in range(10):
            back, metrics = take()
            if metrics[f"env_quarantined/{JUDGED}"] == 0:
                break
            time.sleep(0.5)
        assert metrics[f"env_quarantined/{JUDGED}"] == 0, "the judged env never recovered"
        assert metrics["quarantine_probes_total"] >= 1
        for _ in range(3):
            if JUDGED in back:
                break
            back, metrics = take()
        assert JUDGED in back, {k: len(v) for k, v in back.items()}
    finally:
        host.close()
        judge.stop(timeout_s=5)
