"""vLLM worker extension: receive new policy weights over rollflow's weight group.

vLLM mixes this class into its worker class (``--worker-extension-cls``), so ``self`` is the
vLLM worker. Its methods are called through the server's ``/collective_rpc`` endpoint, whose
arguments arrive as strings. The logic lives in ``rollflow.infra.weights``; this is glue.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from rollflow.infra.weights.group import DEFAULT_BUCKET_BYTES, WeightReceiverGroup

logger = logging.getLogger(__name__)


class WeightReceiver:
    """Joins the trainer's weight group and loads each broadcast into the running model.

    Invariant: after ``receive_weights`` returns version V, the model serves exactly the weights
    the trainer broadcast as V (loaded via ``reload_weights``, so vLLM's CPU repacking of linear
    layers is redone; editing parameters in place would not take effect there).
    """

    def init_weight_group(
        self,
        host: str,
        port: str,
        rank: str,
        world_size: str,
        timeout_s: str,
        metadata_json: str,
        wire_device: str = "cpu",
        bucket_bytes: str = str(DEFAULT_BUCKET_BYTES),
    ) -> int:
        """Join the group as ``rank`` + this worker's rank in its engine; returns the rank used.

        ``wire_device`` is the plan's (``placement.choose_backend``): ``"cuda"`` puts the bucket
        on this worker's GPU (NCCL), ``"cpu"`` in host memory (gloo) whatever the worker's device.
        """
        self.close_weight_group()
        # With tensor parallelism every worker of the engine is one rank of the weight group.
        my_rank = int(rank) + int(getattr(self, "rank", 0))
        device = self.device if wire_device == "cuda" else "cpu"
        group = WeightReceiverGroup(
            host,
            int(port),
            my_rank,
            int(world_size),
            float(timeout_s),
            device=device,
            bucket_bytes=int(bucket_bytes),
        )
        group.connect()
        self._rollflow_weight_group = group
        self._rollflow_weight_metadata: list[dict[str, Any]] = json.loads(metadata_json)
        logger.info("joined weight group %s:%s as rank %d/%s", host, port, my_rank, world_size)
        return my_rank

    def receive_weights(self) -> int:
        """Receive one broadcast and load it into the model; returns its policy version."""
        group = getattr(self, "_rollflow_weight_group", None)
        if group is None:
            raise RuntimeError("receive_weights called before init_weight_group")
        version, named_tensors = group.receive(self._rollflow_weight_metadata)
        self.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
        for _ in named_tensors:  # a loader that skipped tensors must not leave buckets unread
            pass
        return version

    def close_weight_group(self) -> None:
        """Leave the weight group (a no-op if not joined)."""
        group = getattr(self, "_rollflow_weight_group", None)
        if group is not None:
            group.close()
            self._rollflow_weight_group = None
