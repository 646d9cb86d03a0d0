"""The run's long-lived services: the trainer, the inference deployment, the weight group.

``RunServices`` starts both processes, joins the weight group (trainer rank 0, each inference
worker one rank) and tears everything down within a deadline. ``check_alive()``, called by the
step loop every ``HEALTH_CHECK_INTERVAL_S`` from the main thread, fails the run when the trainer
died and has the inference supervisor restart a dead vLLM server (``inference/supervisor.py``).

Invariant: when ``stop()`` returns (or the ``with`` block exits, on success or error), the
weight group is closed on both sides and no service process is left. Processes are spawned from
the calling thread because the kernel kills them when the thread that spawned them exits.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from rollflow.infra.config import RunConfig
from rollflow.infra.errors import ServiceError
from rollflow.infra.events import publish
from rollflow.infra.http import Endpoint
from rollflow.infra.inference.server import InferenceServer
from rollflow.infra.inference.supervisor import (
    HEALTH_PROBE_TIMEOUT_S,
    InferenceSupervisor,
    WeightLink,
)
from rollflow.infra.storage import RunStorage
from rollflow.tasks.sync import weights
from rollflow.tasks.train.client import TrainerClient
from rollflow.tasks.train.launch import TrainerProcess
from rollflow.tasks.train.protocol import ServiceArgs

TEARDOWN_DEADLINE_S = 30.0
HEALTH_CHECK_INTERVAL_S = 5.0
# The longest a dead server goes unnoticed: one interval, then the trainer's probe before vLLM's.
# The Sampler's unhealthy grace (tasks/generate/rollouts.py, RetryPolicy) must exceed it.
DETECTION_BOUND_S = HEALTH_CHECK_INTERVAL_S + HEALTH_PROBE_TIMEOUT_S


class RunServices:
    """Trainer service + vLLM server (under its supervisor) + the weight group between them."""

    def __init__(
        self,
        cfg: RunConfig,
        policy_dir: str | Path,
        checkpoint_step: int | None,
        log_dir: str | Path,
        progress=print,
    ):
        self.cfg, self.policy_dir, self.checkpoint_step = cfg, str(policy_dir), checkpoint_step
        self.log_dir = Path(log_dir)
        self.progress = progress
        self.token = secrets.token_urlsafe(24)
        self.trainer_proc: TrainerProcess | None = None
        self.supervisor: InferenceSupervisor | None = None
        self.trainer: TrainerClient | None = None
        self.inference_ep: Endpoint | None = None

    @property
    def inference(self) -> InferenceServer | None:
        return self.supervisor.server if self.supervisor else None

    # ------------------------------------------------------------------- start

    def start(self) -> RunServices:
        cfg = self.cfg
        start = time.perf_counter()
        self.trainer_proc = TrainerProcess(
            trainer_args(cfg, self.policy_dir, self.checkpoint_step),
            token=self.token,
            log_dir=self.log_dir,
            beside_inference=True,
        )
        self.trainer = self.trainer_proc.client
        self.trainer_proc.start()  # loads while vLLM starts
        storage = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options)
        self.supervisor = InferenceSupervisor(
            cfg,
            self.policy_dir,
            self.log_dir,
            progress=self.progress,
            on_restart=lambda info: publish(storage, "inference_restarted", **info),
        )
        try:
            self.supervisor.start()
            self.inference_ep = Endpoint("inference", self.supervisor.url, self.token)
            self.trainer_proc.wait_healthy()
            self.progress(
                f"services: vLLM at {self.supervisor.url}, trainer at {self.trainer.url} "
                f"({cfg.trainer.backend}, {cfg.trainer.num_ranks} rank(s); "
                f"{time.perf_counter() - start:.0f}s); logs in {self.log_dir}"
            )
            self.supervisor.join_weight_group(self._weight_link())
        except BaseException:
            self.stop()
            raise
        return self

    def _weight_link(self) -> WeightLink:
        """The weight plane between this trainer and the server, for the supervisor's restarts."""
        url, t = self.supervisor.url, self.cfg.trainer
        return WeightLink(
            join=lambda: weights.join(self.trainer, url, t.weight_sync_timeout_s),
            rejoin=lambda: weights.rejoin(
                self.trainer, url, t.weight_sync_timeout_s, t.request_timeout_s
            ),
            leave=lambda timeout_s: weights.leave(self.trainer, url, timeout_s),
        )

    # ------------------------------------------------------------------- check

    def check_alive(self) -> None:
        """Raise if the trainer died or stopped answering (a dead trainer fails the run at once);
        restart the vLLM server if it did (raise if it cannot be restarted)."""
        self._check_trainer()
        self.supervisor.check()

    def _check_trainer(self) -> None:
        """Raise ``ServiceError`` naming the trainer (and its dead rank) if it died or does not answer."""
        self.trainer_proc.check_alive(timeout_s=HEALTH_PROBE_TIMEOUT_S)

    def dead_service(self, grace_s: float = 0.0) -> str | None:
        """After a failure: which service died, as a message naming it (None: both live).
        ``grace_s`` lets a process that is dying now (a call to it just failed) finish exiting: a
        trainer that no longer answers but whose launcher still runs is waited for, so that the
        message can name the rank that died."""
        deadline = time.monotonic() + grace_s
        while True:
            trainer_error = None
            try:
                if self.trainer_proc is not None:
                    self._check_trainer()
            except ServiceError as exc:
                trainer_error = str(exc)
                if not self.trainer_proc.process.is_alive():
                    return trainer_error
            if self.inference is not None and not self.inference.is_alive():
                return f"the vLLM server died (exit code {self.inference.returncode}); see {self.inference.log_path}"
            if time.monotonic() >= deadline:
                return trainer_error
            time.sleep(0.2)

    # -------------------------------------------------------------------- stop

    def stop(self) -> None:
        """Close the weight group on both sides, then stop both processes, within the deadline."""
        deadline = time.monotonic() + TEARDOWN_DEADLINE_S
        if self.supervisor is not None:
            self.supervisor.stop(timeout_s=TEARDOWN_DEADLINE_S / 2)
        if self.trainer_proc is not None:
            self.trainer_proc.stop(timeout_s=max(1.0, deadline - time.monotonic()))

    def __enter__(self) -> RunServices:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def trainer_args(cfg: RunConfig, policy_dir: str, checkpoint_step: int | None) -> ServiceArgs:
    """The trainer service's start arguments: the run's train, trainer and sampling sections."""
    return ServiceArgs(
        model_path=str(policy_dir),
        checkpoint_step=checkpoint_step,
        storage_root=cfg.run.storage,
        storage_options=cfg.run.storage_options,
        run=cfg.run.name,
        seed=cfg.run.seed,
        num_steps=cfg.run.num_steps,
        train=cfg.train,
        trainer=cfg.trainer,
        sampling=cfg.sampling,
    )
