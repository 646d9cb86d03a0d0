"""The trainer's commands as every rank runs them: one table from command to the code that runs it.

Rank 0 broadcasts a command (small JSON, see ``service``): a route's ``op`` and its body; every
rank then calls ``RankOps.run`` with it, which parses the body into the route's request model
(``protocol.py``, the same the HTTP route parsed) and runs it on the part that owns it:

- ``compute.StepOps``: forward, forward/backward, optimizer step (batches via ``batches``);
- ``checkpoints.CheckpointOps``: save, load, HF export, gradient dump;
- ``weight_plane.WeightPlane``: connect, capture, broadcast, close the weight group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollflow.infra.storage import RunStorage
from rollflow.trainer import protocol as p
from rollflow.trainer.batches import BatchReader
from rollflow.trainer.checkpoints import CheckpointOps
from rollflow.trainer.compute import StepOps
from rollflow.trainer.control import ControlGroup
from rollflow.trainer.rank_trainer import Trainer
from rollflow.trainer.weight_plane import WeightPlane

# Rank 0's command while idle: every rank answers, so a dead one is found between calls.
HEARTBEAT = "ping"


class RankOps:
    """One rank's side of every command. Invariant: every command route of ``protocol.ROUTES``
    but ``/shutdown`` (the command loop's own) has exactly one handler here."""

    def __init__(
        self,
        trainer: Trainer,
        control: ControlGroup,
        storage: RunStorage,
        *,
        micro_batch_tokens: int,
        row_tokens: int | None,
    ):
        self.trainer, self.control = trainer, control
        self.rank, self.world_size = control.rank, control.world_size
        self.batches = BatchReader(
            storage,
            self.rank,
            self.world_size,
            micro_batch_tokens=micro_batch_tokens,
            row_tokens=row_tokens,
        )
        self.steps = StepOps(trainer, control, self.batches)
        self.checkpoints = CheckpointOps(trainer, control, storage)
        self.weights = WeightPlane(trainer, control)
        handlers: dict[p.Route, Callable[[Any], dict]] = {
            p.FORWARD: self.steps.forward,
            p.FORWARD_BACKWARD: self.steps.forward_backward,
            p.OPTIM_STEP: self.steps.optim_step,
            p.SAVE_CHECKPOINT: self.checkpoints.save_checkpoint,
            p.LOAD_CHECKPOINT: self.checkpoints.load_checkpoint,
            p.EXPORT_HF: self.checkpoints.export_hf,
            p.GRADIENTS: self.checkpoints.gradients,
            p.WEIGHTS_CONNECT: self.weights.connect,
            p.WEIGHTS_CAPTURE: self.weights.capture,
            p.WEIGHTS_BROADCAST: self.weights.broadcast,
            p.WEIGHTS_CLOSE: self.weights.close,
        }
        unhandled = {r for r in p.ROUTES if r.command} - {p.SHUTDOWN} - set(handlers)
        assert not unhandled, f"command routes without a handler: {unhandled}"
        self._commands = {r.op: (h, r.body) for r, h in handlers.items()}
        self._commands[HEARTBEAT] = (lambda _: {}, None)

    def run(self, op: str, args: dict[str, Any]) -> Any:
        handler, body = self._commands[op]
        return handler(body.model_validate(args) if body is not None else None)
