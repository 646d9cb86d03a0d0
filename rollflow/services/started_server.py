"""The run's side of a vLLM server started before the run: ``StartedServer``.

With ``inference.urls`` set (or the environment's ``ROLLFLOW_VLLM_URLS``), each server of the
fleet is one that someone started elsewhere (`rollflow serve`, a cluster's deployment, a test's
shared server), as TRL's ``vllm_mode="server"`` samples from a `trl vllm-serve` started apart. A
``StartedServer`` stands where a local ``InferenceServer`` does, under the same supervisor
(``vllm_supervisor.py``), without a process of the run's: it is ready once it answers with the
run's key and serves the ``policy`` model; it is judged alive by the supervisor's health probes
alone; a "restart" waits for it to answer again (whoever runs it restarts it), after which the
weight group is formed anew and it gets the trainer's weights; stopping it leaves it serving.

What it serves at start is whatever it was started with: the run replaces its weights with the
trainer's before the first sample (``RunServices.start``). This module imports no torch.
"""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

import httpx

from rollflow.inference import protocol
from rollflow.infra import http
from rollflow.infra.config.loading import URLS_ENV
from rollflow.infra.errors import ConfigError, InferenceError
from rollflow.infra.vllm_fleet import keys

POLL_S = 1.0
SERVED_NAME = "policy"  # the model name every request of the run names (`--served-model-name`)


def started_servers_key() -> str:
    """The servers' key, which the run's environment holds (never its config: the deployment's
    parameters are readable by everyone who reads the Prefect API)."""
    key = os.environ.get(protocol.KEY_ENV, "")
    if not key:
        raise ConfigError(
            f"inference.urls names vLLM servers started elsewhere, but {protocol.KEY_ENV} is not "
            "set: every route of a rollflow-started server needs its key; set it to the key "
            "`rollflow serve` printed (or the one it was given in the same variable)"
        )
    return key


class StartedServer:
    """Server ``slot`` of the fleet, at ``url``, started before the run: what the supervisor
    asks of an ``InferenceServer`` (spawn, wait_ready, is_alive, stop, url)."""

    def __init__(self, url: str, key: str, slot: int, startup_timeout_s: float):
        self._url, self.slot, self.startup_timeout_s = url.rstrip("/"), slot, startup_timeout_s
        keys.register(self._url, key)  # every client of the URL in this process sends it

    @property
    def url(self) -> str:
        return self._url

    @property
    def log_path(self) -> str:
        """Where its log is, for ``see ...`` in messages."""
        return f"the log of the vLLM server at {self.url} (started outside this run)"

    def ended(self) -> str:
        return "it stopped answering (this run did not start it)"

    def pids(self) -> list[int]:
        return []  # not the run's processes

    def is_alive(self) -> bool:
        """Its process is not the run's: the supervisor's health probes judge it."""
        return True

    def spawn(self) -> None:
        """Nothing to start: it was started before the run."""

    def start(self) -> StartedServer:
        """After a death: wait for whoever runs it to bring it back."""
        return self.wait_ready()

    def wait_ready(self) -> StartedServer:
        """Return once it answers ``/health`` with the run's key and serves the ``policy`` model;
        raise ``InferenceError`` saying what it answered at the deadline."""
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer yet"
        while True:
            last, ready = self._probe()
            if ready:
                return self
            if time.monotonic() >= deadline:
                raise InferenceError(
                    f"vLLM server {self.slot} at {self.url} (inference.urls, started outside this "
                    f"run) was not ready within inference.startup_timeout_s = "
                    f"{self.startup_timeout_s:g}s: {last}"
                )
            time.sleep(POLL_S)

    def _probe(self) -> tuple[str, bool]:
        """(what it answered, whether it is ready to serve the run)."""
        headers = keys.auth_headers(self.url)
        try:
            health = http.client().get(self.url + protocol.HEALTH.path, headers=headers, timeout=5)
            if health.status_code in (401, 403):
                return (
                    f"it refuses the key in {protocol.KEY_ENV} ({health.status_code}): give the "
                    "key it was started with",
                    False,
                )
            if health.status_code != 200:
                return f"/health answered {health.status_code}", False
            models = http.client().get(self.url + protocol.MODELS.path, headers=headers, timeout=5)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}", False
        if models.status_code != 200:
            return f"{protocol.MODELS.path} answered {models.status_code}", False
        served = [m.get("id") for m in models.json().get("data", [])]
        if SERVED_NAME not in served:
            return (
                f"it serves {served}, not {SERVED_NAME!r}: start it with --served-model-name "
                f"{SERVED_NAME} (as `rollflow serve` does)",
                False,
            )
        return "ready", True

    def stop(self, timeout_s: float = 30.0) -> None:
        """Leave it serving: the run did not start it (the weight group is left by the run)."""


def serve(cfg, policy, host: str, port: int, dry_run: bool = False, out=print) -> int:
    """`rollflow serve`: a vLLM server of ``policy`` as the run would start it (its dtype,
    tensor parallelism, the config's vLLM arguments), for runs to use through ``inference.urls``;
    held until Ctrl-C. Its key is the environment's ``ROLLFLOW_VLLM_KEY``, else a new one, printed
    with the lines that hand both to a run. Returns the exit code."""
    from rollflow.infra.placement import Machine
    from rollflow.services.vllm_server import InferenceServer
    from rollflow.services.vllm_supervisor import max_model_len

    inf = cfg.inference
    on_gpu = inf.device == "cuda" or (inf.device == "auto" and Machine.here().gpus > 0)
    args = inf.standalone_vllm_args(on_gpu=on_gpu)
    if inf.gpu_memory_utilization is not None and on_gpu:
        args += ["--gpu-memory-utilization", str(inf.gpu_memory_utilization)]
    given = os.environ.get(protocol.KEY_ENV, "")
    server = InferenceServer(
        policy,
        host=host,
        port=port,
        served_model_name=SERVED_NAME,
        max_model_len=max_model_len(policy),
        startup_timeout_s=inf.startup_timeout_s,
        extra_args=[*args, *cfg.vllm_args()],
        log_path=Path(f"vllm-serve-{port or 'port'}.log").resolve(),
        api_key=given or None,
    )
    hand_over = [
        f"  export {URLS_ENV}={server.url}",
        f"  export {protocol.KEY_ENV}="
        + (f"<the {protocol.KEY_ENV} of this shell>" if given else server.api_key),
    ]
    if dry_run:
        out(f"{protocol.KEY_ENV}=... {shlex.join(server.command())}")
        out(f"a run uses it with {URLS_ENV}={server.url} and its {protocol.KEY_ENV}")
        return 0
    out(f"starting vLLM for {policy} at {server.url} (log: {server.log_path})")
    server.start()
    out(f"vLLM serves {policy} at {server.url}; a run uses it with:\n" + "\n".join(hand_over))
    out("Ctrl-C stops it")
    try:
        while server.is_alive():
            time.sleep(1.0)
    except KeyboardInterrupt:
        out("stopping vLLM")
        return 0
    finally:
        server.stop(timeout_s=30)
    out(f"error: vLLM exited ({server.ended()}); see {server.log_path}")
    return 1
