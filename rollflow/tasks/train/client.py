"""The trainer service's one client: the orchestrator's only way into the trainer process.

Calls the routes that ``rollflow/trainer/protocol.py`` declares (path, method, body and reply,
each once); no route string is written here. Each call is one blocking JSON request with the
run's token and a deadline (``infra/http.py``) and returns the route's reply model (one that does
not fit raises ``pydantic.ValidationError`` naming the field: a contract bug, not a service's
failure). It raises ``ServiceError`` (with the HTTP status, None when nothing answered) on
failure: 400 bad input (the service stays usable), 409 a call out of turn, 502 the weight plane
failed, 503 a rank died or the service failed, 504 past the call's deadline.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from rollflow.infra.config import LossConfig
from rollflow.infra.http import Endpoint, call
from rollflow.trainer import protocol as p
from rollflow.trainer.protocol import (
    BatchRef,
    Broadcast,
    ExportHF,
    ForwardBackward,
    Gradients,
    StepRef,
    WeightConnect,
)

HEALTH_TIMEOUT_S = 5.0
# A call whose service side has its own deadline waits this much longer for the answer that says
# why the deadline passed (a 502 naming the weight group, not a bare client timeout).
ANSWER_MARGIN_S = 10.0


class TrainerClient:
    """Calls the trainer service at ``endpoint``; ``timeout_s`` is the deadline of a compute call."""

    def __init__(self, endpoint: Endpoint, timeout_s: float = 600.0):
        self.endpoint, self.timeout_s = endpoint, timeout_s

    @property
    def url(self) -> str:
        return self.endpoint.url

    def _call(
        self,
        route: p.Route,
        body: BaseModel | None = None,
        timeout_s: float | None = None,
        query: str = "",
    ) -> Any:
        payload = body.model_dump(mode="json") if body is not None else None
        reply = call(
            self.endpoint,
            route.path + query,
            payload,
            timeout_s=timeout_s or self.timeout_s,
            method=route.method,
        )
        return route.parse(reply)

    # ------------------------------------------------------------------- state

    def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> p.HealthReply:
        """``ok``, ``optim_step``, ``weights_version`` (None mid-step), backend, ranks."""
        return self._call(p.HEALTH, timeout_s=timeout_s)

    def training_finished(self, wait_s: float = 0.0) -> p.FinishedReply:
        """The explicit end of training (``finished``, step, optimizer step); a long poll of
        at most ``wait_s`` (the service caps it at 30 s)."""
        return self._call(p.TRAINING_FINISHED, timeout_s=wait_s + 10.0, query=f"?wait_s={wait_s:g}")

    # ----------------------------------------------------------------- compute

    def forward(self, step: int, group_indices: list[int] | None = None) -> p.ForwardReply:
        """The trainer's own log-probs of batch ``step``, written to ``logprobs/step=N``."""
        return self._call(p.FORWARD, BatchRef(step=step, group_indices=group_indices))

    def forward_backward(
        self,
        step: int,
        group_indices: list[int] | None = None,
        *,
        samples: list[tuple[int, int]] | None = None,
        loss: LossConfig,
        old_logprobs: str = "inference",
        num_loss_tokens: float | None = None,
    ) -> p.ForwardBackwardReply:
        """Accumulate the gradients of ``loss`` over batch ``step`` (restricted to the groups,
        and to the ``samples`` keys when given)."""
        return self._call(
            p.FORWARD_BACKWARD,
            ForwardBackward(
                step=step,
                group_indices=group_indices,
                samples=samples,
                loss=loss,
                old_logprobs=old_logprobs,
                num_loss_tokens=num_loss_tokens,
            ),
        )

    def optim_step(self) -> p.OptimStepReply:
        return self._call(p.OPTIM_STEP)

    def end_step(self, step: int) -> p.EndStepReply:
        """Outer step ``step`` made all its optimizer steps: its weights become that version;
        after the run's last step the service publishes ``training_finished``."""
        return self._call(p.END_STEP, StepRef(step=step))

    # ------------------------------------------------------------- checkpoints

    def save_checkpoint(self, step: int) -> p.SavedReply:
        """Model, optimizer, schedule, RNG and step to ``checkpoints/step=N`` (its commit point)."""
        return self._call(p.SAVE_CHECKPOINT, StepRef(step=step))

    def load_checkpoint(self, step: int) -> p.LoadedReply:
        """Every rank restores committed checkpoint ``step`` (same backend)."""
        return self._call(p.LOAD_CHECKPOINT, StepRef(step=step))

    def export_hf(self, uri: str) -> p.ExportedReply:
        """The current weights as a Hugging Face folder at ``uri`` (inspection, tests)."""
        return self._call(p.EXPORT_HF, ExportHF(uri=uri))

    def gradients(self, path: str) -> p.GradientsReply:
        """The accumulated full gradient as safetensors at ``path`` (inspection, tests)."""
        return self._call(p.GRADIENTS, Gradients(path=path))

    # ----------------------------------------------------------- weight plane

    def metadata(self, timeout_s: float = 60.0) -> list[p.TensorMeta]:
        """Name, shape and dtype of every tensor a weight sync carries, in wire order."""
        return self._call(p.WEIGHTS_METADATA, timeout_s=timeout_s)

    def weights_port(self) -> int:
        """A port free right now on the trainer's host, for the weight group's store that its
        rank 0 hosts there (the run's process may be on another host)."""
        return self._call(p.WEIGHTS_PORT).port

    def weights_connect(
        self,
        host: str,
        port: int,
        world_size: int,
        timeout_s: float,
        wire_device: str,
        bucket_bytes: int,
    ) -> p.OkReply:
        """Rank 0 joins the weight group as its rank 0 (hosting its store), or answers 502 after
        the group's own ``timeout_s``; the call's deadline leaves it time to say so."""
        return self._call(
            p.WEIGHTS_CONNECT,
            WeightConnect(
                host=host,
                port=port,
                world_size=world_size,
                timeout_s=timeout_s,
                wire_device=wire_device,
                bucket_bytes=bucket_bytes,
            ),
            timeout_s + ANSWER_MARGIN_S,
        )

    def weights_capture(self, version: int | None = None) -> p.CapturedReply:
        """Keep the weights as ``version`` on the trainer; its broadcast then runs off the ranks'
        command loop, so the next step can train meanwhile (``capture_s``, ``bytes``)."""
        return self._call(p.WEIGHTS_CAPTURE, Broadcast(version=version))

    def weights_broadcast(
        self, version: int | None = None, timeout_s: float | None = None
    ) -> p.SentReply:
        """Send the weights as ``version`` (None: the last finished step's, waiting up to half of
        ``timeout_s`` for a step in training to end, which leaves the receivers, who wait
        ``timeout_s`` in all, the other half for the bytes); ``bytes``, ``version``."""
        wait_s = (timeout_s or self.timeout_s) / 2 if version is None else 0.0
        return self._call(p.WEIGHTS_BROADCAST, Broadcast(version=version, wait_s=wait_s), timeout_s)

    def weights_close(self, timeout_s: float | None = None) -> p.OkReply:
        return self._call(p.WEIGHTS_CLOSE, None, timeout_s)

    def shutdown(self, timeout_s: float = 10.0) -> p.OkReply:
        """Every rank tears down its engine and process group; then the service exits."""
        return self._call(p.SHUTDOWN, None, timeout_s)
