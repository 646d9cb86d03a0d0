"""``[trainer]``: the trainer service, the processes that train (ranks, backend, placement,
weight broadcast). How to train (the algorithm) is ``[train]`` (``train_section.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rollflow.infra.config.base import CpuIndex, GpuIndex, Section


class TrainerServiceSection(Section):
    """The trainer service: its processes, not the algorithm they run (``TrainSection``)."""

    startup_timeout_s: float = Field(
        120, gt=0, description="Deadline for the trainer to become healthy."
    )
    request_timeout_s: float = Field(600, gt=0, description="Deadline of one trainer call.")
    weight_sync_timeout_s: float = Field(120, gt=0, description="Deadline of one weight broadcast.")
    max_restarts: int = Field(
        2,
        ge=0,
        description="Restarts of a lost trainer per run, each from the last committed checkpoint "
        "while vLLM keeps serving (0: a lost trainer fails the run; a trainer on several nodes "
        "is not restarted).",
    )
    micro_batch_tokens: int = Field(8192, ge=1, description="Token budget of one micro-batch.")
    backend: Literal["fsdp2", "deepspeed"] = Field(
        "fsdp2",
        description="Data-parallel backend: FSDP2 (torchrun) or DeepSpeed ZeRO (deepspeed launcher).",
    )
    num_ranks: int = Field(1, ge=1, description="Data-parallel ranks (processes) on this node.")
    zero_stage: Literal[1, 2, 3] | None = Field(
        None, description="DeepSpeed ZeRO stage (backend = deepspeed only; unset: 1)."
    )
    num_nodes: int = Field(
        1,
        ge=1,
        description="Trainer nodes; with trainer.node_deployment set every node (node 0 too) is "
        "a flow run of it; otherwise rollflow starts node 0 beside the run and the rest are "
        "started by hand (`rollflow plan` prints their commands).",
    )
    node_deployment: str = Field(
        "",
        description="The Prefect deployment whose flow runs are the trainer's nodes, node 0 "
        "included (e.g. `rollflow-trainer-node/default` of prefect.yaml): the run submits one per "
        "node to its work pool, a worker on the node's host runs it, and the run keeps no trainer "
        "process of its own; empty: node 0 runs beside the run and nodes 1.. are started by hand "
        "with the command the run prints (`rollflow plan`).",
    )
    node_queues: list[str] = Field(
        [],
        description="The work queue of each node, node 0 first, one per node (a queue per host "
        "on a process pool, its worker started with --work-queue); empty: the deployment's queue "
        "(a Kubernetes or Docker pool places each job).",
    )
    master_addr: str = Field(
        "127.0.0.1",
        description="Address of trainer node 0 as the other nodes and placed vLLM servers reach "
        "it (rendezvous, weights); auto: node 0's host's own (its default route's source, else "
        "its first non-loopback IPv4), found by node 0 itself (its flow run's, with "
        "trainer.node_deployment; the run's otherwise), for a pool that places each job "
        "(Kubernetes, Docker).",
    )
    master_port: int = Field(
        29400, ge=1, le=65535, description="Rendezvous port on node 0 when num_nodes > 1."
    )
    devices: list[GpuIndex] | None = Field(
        None,
        description="GPU indices of the trainer's ranks on each node (None: the GPUs vLLM leaves).",
    )
    cpus: list[CpuIndex] | None = Field(
        None,
        description="On a host without GPUs, the CPU cores the trainer's ranks on node 0 are "
        "pinned to (their threads share them), e.g. [2, 3]; None: not pinned, the threads sized "
        "to the cores vLLM leaves.",
    )
    weight_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="Weight group transport: auto picks NCCL when trainer and vLLM are both on "
        "GPUs, else gloo through host memory.",
    )
    background_sync: bool = Field(
        True,
        description="Capture the weights when a step's training ends and release the trainer; "
        "the broadcast then runs while the next step trains (steps that checkpoint or evaluate "
        "still hold the trainer until their sync).",
    )
    weight_bucket_mb: float = Field(
        256,
        gt=0,
        description="Largest piece of one weight broadcast, in MiB (bounds extra memory).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the ranks compute: CUDA when available (auto), or forced."
    )
    mixed_precision: Literal["auto", "bf16", "off"] = Field(
        "auto",
        description="bf16 compute with fp32 master weights (FSDP2 mixed precision, DeepSpeed "
        "bf16), or fp32 throughout (off); auto: bf16 on GPUs, off on CPU.",
    )

    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass instead of "
        "keeping them (torch's non-reentrant checkpoint around each layer, set before FSDP2 or "
        "DeepSpeed wraps the model): far less memory for long micro-batches, about a third more "
        "compute; off by default (tiny CPU models do not need it), on in the GPU recipes.",
    )

    @model_validator(mode="after")
    def _a_queue_per_node(self) -> TrainerServiceSection:
        if self.node_queues and len(self.node_queues) != self.num_nodes:
            raise ValueError(
                f"trainer.node_queues names {len(self.node_queues)} queue(s) for "
                f"trainer.num_nodes = {self.num_nodes} node(s): name one per node, node 0's "
                "first (node 0 is a flow run of trainer.node_deployment too), or none (the "
                "deployment's queue)"
            )
        if self.node_queues and not self.node_deployment:
            raise ValueError(
                "trainer.node_queues is set but trainer.node_deployment is empty: the queues are "
                "those of the deployment that runs the nodes (e.g. rollflow-trainer-node/default)"
            )
        return self

    def bf16(self, on_gpu: bool) -> bool:
        """Whether the ranks compute in bf16: the one owner of that choice."""
        return self.mixed_precision == "bf16" or (self.mixed_precision == "auto" and on_gpu)

    def deepspeed_stage(self) -> int:
        """The ZeRO stage DeepSpeed runs: ``zero_stage``, 1 where unset (the one owner of that)."""
        return self.zero_stage or 1
