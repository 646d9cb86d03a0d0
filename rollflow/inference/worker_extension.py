"""vLLM worker extension: receive new policy weights over rollflow's weight group.

vLLM mixes this class into its worker class (``--worker-extension-cls``), so ``self`` is the
vLLM worker. Its methods are called through the server's ``/collective_rpc`` endpoint: each is
one of ``protocol.WORKER_METHODS``, takes one string (its argument model's JSON) and answers its
reply model as a dict. The logic lives in ``rollflow.infra.weights``; this is glue.

A server that serves the policy as a LoRA adapter (``protocol.LORA_ROOT_ENV`` set, see
``services/vllm_server.py``) receives the adapter's tensors instead of the model's and loads them
as its adapter.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rollflow.inference.protocol import (
    CLOSE_WEIGHT_GROUP,
    INIT_WEIGHT_GROUP,
    KEY_ENV,
    LORA_ROOT_ENV,
    RECEIVE_WEIGHTS,
    Joined,
    Loaded,
    WorkerMethod,
)
from rollflow.infra.weights import adapter
from rollflow.infra.weights.group import WeightReceiverGroup

logger = logging.getLogger(__name__)


def _answers_its_failure(method: WorkerMethod) -> Callable:
    """Make a worker method answer its exception instead of raising it (``method.failed``):
    every worker then answers each call, so vLLM reads every answer of it, and no answer of a
    failed call is left queued for the next one (``WorkerMethod.failed`` says why)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(self, request: str) -> dict[str, Any] | None:
            try:
                return fn(self, request)
            except Exception as exc:  # noqa: BLE001 - answered, with its name and message
                logger.exception("worker method %s failed", method.name)
                return method.failed(exc)

        return call

    return wrap


class WeightReceiver:
    """Joins the trainer's weight group and loads each broadcast into the running model.

    Invariant: after ``receive_weights`` returns version V, the model serves exactly the weights
    the trainer broadcast as V (loaded via ``reload_weights``, so vLLM's CPU repacking of linear
    layers is redone; editing parameters in place would not take effect there), or, in adapter
    mode, exactly the adapter it broadcast as V, under the LoRA id the server's requests name.
    """

    @_answers_its_failure(INIT_WEIGHT_GROUP)
    def init_weight_group(self, request: str) -> dict[str, Any]:
        """Join the group as ``first_rank`` + this worker's rank in its engine; answers the rank.

        ``wire_device`` is the plan's (``placement.choose_backend``): ``"cuda"`` puts the bucket
        on this worker's GPU (NCCL), ``"cpu"`` in host memory (gloo) whatever the worker's device.
        """
        args = INIT_WEIGHT_GROUP.decode(request)
        self._leave_weight_group()
        # With tensor parallelism every worker of the engine is one rank of the weight group.
        my_rank = args.first_rank + int(getattr(self, "rank", 0))
        device = self.device if args.wire_device == "cuda" else "cpu"
        # The run's secret proves membership (weights/group.py); this server holds it as its key.
        group = WeightReceiverGroup(
            args.host,
            args.port,
            my_rank,
            args.world_size,
            args.timeout_s,
            device=device,
            bucket_bytes=args.bucket_bytes,
            secret=os.environ.get(KEY_ENV, ""),
        )
        group.connect()
        self._rollflow_weight_group = group
        self._rollflow_weight_metadata: list[dict[str, Any]] = args.metadata
        logger.info(
            "joined weight group %s:%s as rank %d/%d",
            args.host,
            args.port,
            my_rank,
            args.world_size,
        )
        return INIT_WEIGHT_GROUP.answer(Joined(rank=my_rank))

    @_answers_its_failure(RECEIVE_WEIGHTS)
    def receive_weights(self, request: str) -> dict[str, Any]:
        """Receive one broadcast and load it into the model; answers its policy version.

        Every tensor goes through vLLM's loader whole, none in place (``receive(into=...)``):
        its loaders narrow a tensor to this worker's TP shard, stack q/k/v and gate/up into one
        parameter, zero a vocabulary's padding, and its layer-wise reload buffers a layer's
        tensors, loads them into a fresh copy of the layer and repacks it (on CPU, the linear
        and LM-head weights). A tensor larger than a bucket reaches it assembled in host memory,
        as a checkpoint's tensors do, never as a second copy on the GPU (docs/architecture.md).
        """
        RECEIVE_WEIGHTS.decode(request)
        group = getattr(self, "_rollflow_weight_group", None)
        if group is None:
            raise RuntimeError("receive_weights called before init_weight_group")
        version, named_tensors = group.receive(self._rollflow_weight_metadata)
        root = os.environ.get(LORA_ROOT_ENV)
        if root:
            self._load_adapter(root, version, named_tensors)
        else:
            self.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
        for _ in named_tensors:  # a loader that skipped tensors must not leave buckets unread
            pass
        return RECEIVE_WEIGHTS.answer(Loaded(version=version))

    def _load_adapter(
        self, root: str, version: int, named_tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> None:
        """Write the adapter as a peft folder and load it in place of the one served.

        Into this worker's LoRA manager, under the id the server gave the adapter at start: the
        requests keep naming that id, and their LoRA request (not marked ``load_inplace``) never
        makes vLLM read a file again. ``/v1/load_lora_adapter`` with ``load_inplace`` would mark
        every later request so, and vLLM then re-reads the adapter's files at every engine step
        (docs/lora.md). The caller resets the prefix cache: its blocks were computed with the
        old adapter, and the LoRA name and path the cache keys on stay the same.
        """
        from vllm.lora.request import LoRARequest

        folder = adapter.write_version(root, version, int(getattr(self, "rank", 0)), named_tensors)
        loaded = self.list_loras()
        if len(loaded) != 1:
            raise RuntimeError(f"adapter sync: the server holds LoRA ids {loaded}, expected one")
        (lora_id,) = loaded
        request = LoRARequest(f"v{version}", lora_id, str(folder), load_inplace=True)
        if not self.add_lora(request):
            raise RuntimeError(f"adapter sync: vLLM did not load the adapter of v{version}")

    @_answers_its_failure(CLOSE_WEIGHT_GROUP)
    def close_weight_group(self, request: str) -> None:
        """Leave the weight group (a no-op if not joined)."""
        CLOSE_WEIGHT_GROUP.decode(request)
        self._leave_weight_group()

    def _leave_weight_group(self) -> None:
        group = getattr(self, "_rollflow_weight_group", None)
        if group is not None:
            group.close()
            self._rollflow_weight_group = None
