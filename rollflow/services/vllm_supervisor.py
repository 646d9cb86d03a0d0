"""The inference supervisor: the run's vLLM server and its link to the trainer, kept serving.

It starts the server, joins it to the weight group (trainer rank 0, each vLLM worker one rank)
and, when ``check()`` finds the server dead or failing its health probe twice in a row,
restarts it:

    close the serving gate → stop what is left of the old server (EngineCore, workers)
    → start it again on the same port → ``link.rejoin()``: the trainer and the new workers form
    the weight group anew, and the server gets the weights of the trainer's last finished step
    → open the gate

It knows nothing of the trainer: the run flow passes a ``WeightLink`` whose callbacks do the
weight plane's part (``tasks/sync/weights.py``).

Sampling requests that were in flight on the dead server fail and are retried by the Sampler;
new and retried requests wait at the gate (``gate.py``), so none is served by the weights the
new server loaded from disk. A step's weight sync that was cut by the death is synced again
once the gate opens (``tasks/sync``). The URL stays the same, so every client follows; a
server placed by Prefect that a pool restarted on another host is followed to its new URL
(``_follow_move``: its gate and fleet entry move, under the weight group's lock).

``check()`` runs on the thread that started the server (the run's main thread): services die
with the thread that spawned them (``infra/processes.py``), so a restart must happen there too.

Invariants: sampling resumes only on a server holding a policy version the trainer made, at
least the one it held before; at most ``inference.max_restarts`` restarts, each reported once
through ``on_restart``; a restart that fails fails the gate (every waiter ends at once) and
raises ``ServiceError`` naming the server.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollflow.infra.config import RunConfig
from rollflow.infra.errors import ServiceError
from rollflow.infra.vllm_fleet.gate import ServingGate, register_gate, unregister_gate
from rollflow.services.vllm_server import InferenceServer, answers_health

HEALTH_PROBE_TIMEOUT_S = 5.0
UNHEALTHY_PROBES_BEFORE_RESTART = 2  # one slow answer is not a death


@dataclass(frozen=True)
class WeightLink:
    """The weight plane's part of a server's life, given by the run flow.

    ``rejoin()`` forms the weight group anew after a restart (every server of the deployment
    joins: a group's membership is fixed) and loads the trainer's published weights, returning
    their version. ``lock`` is the group's: one sync or re-join at a time uses it.
    """

    rejoin: Callable[[], int]
    lock: threading.Lock
    # A restarted server came back at another URL (slot, URL), called under ``lock``: the fleet
    # follows it (a pool that places each flow run anew; flows/inference_server.py).
    moved: Callable[[int, str], None] = lambda slot, url: None


class InferenceSupervisor:
    """One vLLM server (``index`` of the deployment), restarted when it dies; see the module
    docstring. ``env`` and ``server_args`` are the placement plan's for it (its devices, tensor
    parallelism, memory share); ``lora_adapter``, under ``train.lora.sync = "adapter"``, the
    adapter it serves as the policy at each start (a restart then gets the trainer's last
    version through ``link.rejoin()``, like a merged policy)."""

    def __init__(
        self,
        cfg: RunConfig,
        policy_dir: str | Path,
        log_dir: Path,
        *,
        index: int = 0,
        env: dict[str, str] | None = None,
        server_args: list[str] = (),
        on_restart: Callable[[dict], None] = lambda info: None,
        progress=print,
        api_key: str | None = None,
        lora_adapter: str | Path | None = None,
        cpus: tuple[int, ...] = (),
        server: InferenceServer | None = None,
    ):
        """``server``: the server to keep serving when it is not a process of this one (a flow
        run of ``inference.server_deployment``: ``flows/inference_server.py``), else one is made here."""
        self.cfg, self.index = cfg, index
        self.link: WeightLink | None = None
        self.on_restart, self.progress = on_restart, progress
        port = cfg.inference.port + index if cfg.inference.port else 0
        self.server = server or InferenceServer(
            policy_dir,
            host=cfg.inference.host,
            port=port,
            max_model_len=max_model_len(policy_dir),
            startup_timeout_s=cfg.inference.startup_timeout_s,
            extra_args=[*server_args, *cfg.vllm_args()],
            extra_env=env,
            log_path=log_dir / ("vllm.log" if index == 0 else f"vllm-{index}.log"),
            api_key=api_key,
            lora_adapter=lora_adapter,
            cpus=cpus,
        )
        self.name = (
            "the vLLM server" if cfg.inference.fleet_slots() == 1 else f"vLLM server {index}"
        )
        self.gate: ServingGate | None = None
        self.restarts = 0
        self._unhealthy_probes = 0
        self._owner: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.server.url

    # ------------------------------------------------------------------- start

    def spawn(self) -> None:
        """Start the server's process (``wait_ready`` waits for it to be healthy)."""
        self._owner = threading.current_thread()
        self.server.spawn()

    def wait_ready(self) -> None:
        self.server.wait_ready()

    def start(self) -> None:
        """Start the server; returns once it is healthy (the weight group is joined separately)."""
        self.spawn()
        self.wait_ready()

    def open_gate(self, link: WeightLink) -> None:
        """The server is in the weight group: let sampling in; restarts re-join through ``link``."""
        self.link = link
        self.gate = register_gate(self.server.url, link.lock)

    # ------------------------------------------------------------------- check

    def check(self) -> None:
        """Restart the server if it died or stopped answering; raise if that is impossible."""
        reason = self._failure()
        if reason is not None:
            self._restart(reason)

    def _failure(self) -> str | None:
        if not self.server.is_alive():
            return f"{self.name} died ({self.server.ended()})"
        healthy = answers_health(self.url, HEALTH_PROBE_TIMEOUT_S)
        self._unhealthy_probes = 0 if healthy else self._unhealthy_probes + 1
        if self._unhealthy_probes >= UNHEALTHY_PROBES_BEFORE_RESTART:
            return (
                f"{self.name} failed {self._unhealthy_probes} health probes in a row ({self.url})"
            )
        return None

    def serving(self, timeout_s: float = 2.0) -> bool:
        """Whether the server runs and answers ``/health`` (a preempted one does neither; its
        process may take a moment to be seen dead)."""
        return self.server.is_alive() and answers_health(self.url, timeout_s)

    def restart_deadline_s(self) -> float:
        """The longest a restart may take: start, weight group, the trainer's step, one sync."""
        c = self.cfg
        return (
            c.inference.startup_timeout_s
            + 2 * c.trainer.weight_sync_timeout_s
            + c.trainer.request_timeout_s
            + 30.0
        )

    def _restart(self, reason: str) -> None:
        detected_at = time.time()
        logs = f"see {self.server.log_path}"
        if self.restarts >= self.cfg.inference.max_restarts:
            message = (
                f"{reason}; not restarted: {self.restarts} of "
                f"inference.max_restarts = {self.cfg.inference.max_restarts} used; {logs}"
            )
            self.gate.fail(message)
            raise ServiceError(message)
        if threading.current_thread() is not self._owner:
            raise RuntimeError(
                "the inference supervisor must restart the server from the thread "
                "that started it (the run's main thread)"
            )
        self.gate.close(self.restart_deadline_s())
        self.progress(
            f"inference: {reason}; restarting it ({self.restarts + 1}/"
            f"{self.cfg.inference.max_restarts}); {logs}"
        )
        start, served_at = time.monotonic(), self.url
        try:
            self.server.stop(timeout_s=10)
            self.server.start()
            gate = self.gate
            with gate.weights_turn(self.cfg.trainer.weight_sync_timeout_s, when_open=False):
                version = self.link.rejoin()
                if self.url != served_at:
                    self._follow_move(gate)
        except Exception as exc:
            message = f"{reason} and could not be restarted: {exc}; {logs}"
            self.gate.fail(message)
            raise ServiceError(message) from exc
        self.restarts += 1
        self._unhealthy_probes = 0
        self.gate.open()
        info = {
            "restart": self.restarts,
            "reason": reason,
            "detected_at": detected_at,
            "restart_s": time.monotonic() - start,
            "version": version,
            "url": self.url,
        }
        self.on_restart(info)
        self.progress(
            f"inference: restarted in {info['restart_s']:.0f}s, serving policy version "
            f"{version} again"
        )

    def _follow_move(self, old: ServingGate) -> None:
        """The restarted server serves at another URL (its flow run placed on another host):
        under the group's lock, a gate for the new URL (its restarts carried over) and the
        fleet's entry move to it; the old gate's waiters are sent on to a member (retried)."""
        self.gate = register_gate(self.url, self.link.lock)
        self.gate.restarts = old.restarts
        self.link.moved(self.index, self.url)
        old.retire(f"{self.name} moved to {self.url}")
        unregister_gate(old)
        self.progress(f"inference: {self.name} came back at {self.url} (it served at {old.url})")

    # -------------------------------------------------------------------- stop

    def close_gate(self) -> None:
        """End the gate's waiters: the run is stopping (the weight group is left by the run)."""
        if self.gate is not None:
            self.gate.fail("the run is stopping its inference server")
            unregister_gate(self.gate)

    def retire(self, timeout_s: float) -> None:
        """The server leaves the fleet, the run goes on: requests waiting at its gate go to
        another server; then it is stopped."""
        if self.gate is not None:
            self.gate.retire(f"{self.name} left the inference fleet")
            unregister_gate(self.gate)
        self.server.stop(timeout_s=timeout_s)

    def stop(self, timeout_s: float) -> None:
        """End the gate's waiters and stop the server."""
        self.close_gate()
        self.server.stop(timeout_s=timeout_s)


def max_model_len(policy_dir: str | Path) -> int | None:
    try:
        return json.loads((Path(policy_dir) / "config.json").read_text())["max_position_embeddings"]
    except (OSError, KeyError, ValueError):
        return None
