"""The two data-parallel backends behind one interface: FSDP2 and DeepSpeed ZeRO 1/2/3.

A backend owns the sharded policy, its optimizer and its learning-rate schedule. The trainer
drives it the same way whatever it is: ``module(...)`` forward, ``backward(loss)`` per micro-batch
(gradients accumulate until ``step()``), ``step()`` clips, steps and zeroes.

Gradient reduction: both backends AVERAGE gradients over the data-parallel ranks (FSDP2's
reduce-scatter, DeepSpeed's averaged reductions); the trainer scales each rank's loss by
``world_size / global_loss_tokens`` so that the average becomes the exact global token mean.

Invariant: after the same ``backward`` calls on the same micro-batches, every backend holds the
same gradient (to fp32 rounding) as one process running all of them; ``full_state_dict`` and
``full_gradients`` are collectives that return HF-named full tensors on rank 0 and ``{}`` elsewhere.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from rollflow.infra.errors import ConfigError
from rollflow.trainer.deepspeed_op import load_built_op
from rollflow.trainer.policy import PackedPolicy, hf_name


class Backend(Protocol):
    """What the trainer needs from a data-parallel backend."""

    name: str
    module: nn.Module  # call it for the forward pass

    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> dict[str, float]: ...
    def current_lr(self) -> float: ...
    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]: ...
    def full_gradients(self) -> dict[str, torch.Tensor]: ...
    def save(self, folder: Path) -> None: ...
    def load(self, folder: Path) -> None: ...
    def close(self) -> None: ...


def lr_factor(
    step: int,
    *,
    warmup_steps: int = 0,
    schedule: str = "constant",
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of the base rate:
    linear warm-up over ``warmup_steps``, then constant, or a linear or cosine decay that reaches
    ``min_lr_ratio`` at ``total_steps`` and stays there (no ``total_steps``: constant)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or not total_steps or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


@dataclass(frozen=True)
class OptimSpec:
    """The optimizer step every backend takes: AdamW with a learning-rate schedule (warm-up, then
    constant or decayed: ``lr_factor``), gradient clipping, and the compute precision (bf16 with
    fp32 master weights, or fp32 throughout). The schedule's one state is the optimizer step
    count, which each backend's checkpoint keeps (LambdaLR's ``last_epoch``)."""

    lr: float
    weight_decay: float
    max_grad_norm: float
    warmup_steps: int
    mixed_precision: bool
    schedule: str = "constant"
    total_steps: int | None = None  # the run's optimizer steps: where a decay ends
    min_lr_ratio: float = 0.0

    def adamw(self, params: list[nn.Parameter]):
        """The optimizer and its learning-rate schedule over ``params``."""
        optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, **self._shape()))
        return optimizer, schedule

    def _shape(self) -> dict:
        return {
            "warmup_steps": self.warmup_steps,
            "schedule": self.schedule,
            "total_steps": self.total_steps,
            "min_lr_ratio": self.min_lr_ratio,
        }


def _norm(value) -> float:
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


# ----------------------------------------------------------------------------------- FSDP2


class FSDP2Backend:
    """``torch.distributed.fsdp.fully_shard`` on every decoder layer and on the root wrapper.

    Trainer state is saved with ``torch.distributed.checkpoint`` (each rank writes its shards).
    """

    name = "fsdp2"

    def __init__(self, policy: PackedPolicy, device: torch.device, optim: OptimSpec):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        world = dist.get_world_size()
        mesh = init_device_mesh(device.type, (world,))
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if optim.mixed_precision
            else MixedPrecisionPolicy()
        )
        policy.to(device)
        # One rank holds everything anyway: keep parameters gathered between forward and backward.
        reshard = world > 1
        for layer in policy.decoder_layers():
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(policy, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
        self.module = policy
        self.max_grad_norm = optim.max_grad_norm
        self.optimizer, self.scheduler = optim.adamw(trainable(policy))

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> dict[str, float]:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        lr = self.current_lr()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": _norm(grad_norm), "lr": lr}

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step_changing_nothing(self) -> None:
        """``step`` run once with nothing changed: AdamW at a learning rate of 0 (its update and
        weight decay are then exactly 0), its new state dropped, the schedule and the rates put
        back. DTensor fills its sharding caches on a first call: 0.12 s of the first
        ``optim_step`` on CPU against 0.012 s after."""
        rates = [group["lr"] for group in self.optimizer.param_groups]
        schedule = self.scheduler.state_dict()
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        try:
            self.step()
        finally:
            self.scheduler.load_state_dict(schedule)
            for group, rate in zip(self.optimizer.param_groups, rates, strict=True):
                group["lr"] = rate
            self.optimizer.state.clear()  # the next step starts it afresh, as it would have
            self.optimizer.zero_grad(set_to_none=True)

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
        )
        state = get_model_state_dict(self.module, options=options)
        return {hf_name(k): v for k, v in state.items()} if dist.get_rank() == 0 else {}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        grads = {}
        for name, p in self.module.named_parameters():
            if p.grad is None:
                continue
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            if dist.get_rank() == 0:
                grads[hf_name(name)] = full.detach().float().cpu()
        return grads

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optim": optim}

    def save(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(), checkpoint_id=str(folder / "dcp"))
        if dist.get_rank() == 0:
            # LambdaLR's state is plain numbers (its lambdas are saved as None).
            (folder / "scheduler.json").write_text(json.dumps(self.scheduler.state_dict()))

    def load(self, folder: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=str(folder / "dcp"))
        set_state_dict(
            self.module,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.scheduler.load_state_dict(json.loads((folder / "scheduler.json").read_text()))

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------- DeepSpeed


def _release_shared_workspace() -> None:
    """Remove this rank's name of DeepSpeed's CPU all-reduce workspace, once every rank holds it.

    On CPU, with every rank on one host, DeepSpeed's communication init creates a 66 MB shared
    memory workspace per rank, ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``,
    maps every rank's, and never removes them: each 2-rank launch left 132 MB of RAM taken for good
    (13 GB after a day of this project's tests). After the barrier every rank has mapped every
    workspace, so the names can go; the memory stays mapped until the last rank exits, killed or
    not."""
    dist.barrier()
    name = "_".join(
        [
            "deepspeed_allreduce_buffer",
            str(os.getuid()),
            os.environ.get("MASTER_ADDR", ""),
            os.environ.get("MASTER_PORT", ""),
            str(dist.get_rank()),
        ]
    )
    Path("/dev/shm", name).unlink(missing_ok=True)


class DeepSpeedBackend:
    """A DeepSpeed engine with ZeRO stage 1, 2 or 3; trainer state through DeepSpeed's own save.

    The caller owns the accumulation boundary (``managed_gradient_accumulation: false``): any
    number of ``backward`` calls accumulate, and ``step()`` is the boundary that finishes the
    reduction and updates. (With DeepSpeed's default, managed accumulation, each backward of a
    ``gradient_accumulation_steps = 1`` engine is a boundary, and a second backward before
    ``step()`` lost gradients: measured.)
    """

    name = "deepspeed"

    def __init__(
        self, policy: PackedPolicy, device: torch.device, optim: OptimSpec, *, zero_stage: int
    ):
        import deepspeed

        if device.type == "cpu":
            load_built_op()  # (DeepSpeed's all-reduce op, built before on this machine)
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        if device.type == "cpu":
            _release_shared_workspace()
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            # Unset, DeepSpeed clips to 1.0 whatever the run asked for.
            "gradient_clipping": optim.max_grad_norm,
            "zero_optimization": {"stage": zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": optim.mixed_precision},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        policy.to(device)
        optimizer, scheduler = optim.adamw(trainable(policy))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=policy,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=config,
            dist_init_required=False,
        )
        self.zero_stage = zero_stage
        self.module = self.engine
        self.policy = policy
        if zero_stage == 3:
            deepspeed.zero.register_external_parameter(policy, policy.lm_head_weight)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> dict[str, float]:
        lr = self.current_lr()
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float(norm) if norm is not None else float("nan"), "lr": lr}

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict(
                exclude_frozen_parameters=trainable_only
            )
        else:
            state = self.policy.state_dict() if dist.get_rank() == 0 else None
            if state is not None and trainable_only:
                trainable = {n for n, p in self.policy.named_parameters() if p.requires_grad}
                state = {k: v for k, v in state.items() if k in trainable}
        if dist.get_rank() != 0 or state is None:
            return {}
        return {hf_name(k): v.detach().cpu() for k, v in state.items()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        grads = {}
        optimizer = self.engine.optimizer
        boundary = optimizer.is_gradient_accumulation_boundary()
        if self.zero_stage == 2:
            # Stage 2 reduces per backward into `all_grad_tensors`, readable only once the boundary
            # is finalized, which consumes them: keep them for step() to finalize again.
            saved = (dict(optimizer.all_grad_tensors), dict(optimizer.averaged_gradients))
            optimizer.finalize_gradient_accumulation_boundary()
        for name, p in self.policy.named_parameters():
            if self.zero_stage <= 1:
                # Stage 1 reduces in step(); until then each rank holds its own sum: average it as
                # step() will.
                full = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(full)
                full /= dist.get_world_size()
            else:
                full = safe_get_full_grad(p)  # a collective for ZeRO; every rank calls it in order
            if full is not None and dist.get_rank() == 0:
                grads[hf_name(name)] = full.detach().float().cpu()
        if self.zero_stage == 2:
            # In place: DeepSpeed's per-parameter views hold these very dicts.
            for live, kept in zip(
                (optimizer.all_grad_tensors, optimizer.averaged_gradients), saved, strict=True
            ):
                live.clear()
                live.update(kept)
            optimizer.set_gradient_accumulation_boundary(boundary)
        return grads

    def save(self, folder: Path) -> None:
        self.engine.save_checkpoint(str(folder / "deepspeed"), tag="state", save_latest=False)

    def load(self, folder: Path) -> None:
        self.engine.load_checkpoint(
            str(folder / "deepspeed"),
            tag="state",
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )

    def close(self) -> None:
        # ZeRO-3 ranks sometimes abort at exit unless the engine is destroyed first.
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of them, or the adapters alone under LoRA."""
    return [p for p in module.parameters() if p.requires_grad]


def make_backend(
    name: str, policy: PackedPolicy, device: torch.device, optim: OptimSpec, *, zero_stage: int
) -> Backend:
    """The configured backend (``zero_stage``: DeepSpeed's ZeRO stage)."""
    if name == "fsdp2":
        return FSDP2Backend(policy, device, optim)
    if name == "deepspeed":
        return DeepSpeedBackend(policy, device, optim, zero_stage=zero_stage)
    raise ConfigError(f"trainer.backend = {name!r} is unknown: set 'fsdp2' or 'deepspeed'")
