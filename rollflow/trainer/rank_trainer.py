"""One rank's part of the trainer: the policy on a backend, forward, forward_backward, optim_step.

Every rank of the service holds one ``Trainer``; the service hands each rank its packed
micro-batches (see ``packing``) and every call below is a collective: all ranks call it together.
It knows nothing of mini-batches or epochs (the train task owns the algorithm); it accumulates
gradients over ``forward_backward`` calls until ``optim_step``.

Invariant (exact loss math on any number of ranks): each micro-batch's summed token loss is
multiplied by ``world_size / denominator``, where the denominator is the number of loss tokens
of the whole optimizer step over ALL ranks; the backends average gradients over ranks, so the
update equals one step on the global token mean, however the rows were split over ranks and
micro-batches. (Dividing by each rank's own count would overweight the rank with fewer tokens.)
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from rollflow.infra.config import LossConfig, SamplingSection, TrainerServiceSection, TrainSection
from rollflow.infra.errors import ConfigError
from rollflow.infra.moments import PerEnvMoments
from rollflow.infra.weights.group import weight_metadata
from rollflow.trainer import lora
from rollflow.trainer.backends import Backend, OptimSpec, make_backend
from rollflow.trainer.losses import LossInputs, compute_loss
from rollflow.trainer.metrics import effective_sample_size
from rollflow.trainer.packing import PackedBatch, Sequence, pack
from rollflow.trainer.policy import PackedPolicy, load_hf_model

# Step sums a forward_backward returns per rank; the service adds them over ranks.
SUM_KEYS = (
    "loss_sum",
    "pg_loss_sum",
    "num_loss_tokens",
    "num_tokens",
    "clipped_tokens",
    "entropy_sum",
    "mismatch_kl_sum",
    "kl_sum",
    "tis_weight_sum",
    "is_masked_tokens",
    "is_weight_sum",
    "is_weight_sq_sum",
)


@dataclass(frozen=True)
class TrainerSpec:
    """How one rank builds its part of the trainer: the run config's train and trainer sections
    (optimizer, schedule, backend), its sampling section (the temperature and top-p the log-probs
    are taken at), the seed, and a frozen copy of the policy for the KL term."""

    model_path: str
    train: TrainSection = field(default_factory=TrainSection)
    trainer: TrainerServiceSection = field(default_factory=TrainerServiceSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    seed: int = 0
    reference_model_path: str | None = None
    # The dtype vLLM serves (InferenceSection.serving_dtype): weight syncs travel in it.
    weight_dtype: str = "float32"
    # The run's outer steps (run.num_steps): a decaying learning rate ends at their last
    # optimizer step; None: no decay.
    num_steps: int | None = None
    revision: str | None = None  # model.revision
    trust_remote_code: bool = False  # model.trust_remote_code

    def load(self, path: str, device: torch.device):
        """The HF model at ``path`` as model.revision and model.trust_remote_code say."""
        return load_hf_model(
            path, device, revision=self.revision, trust_remote_code=self.trust_remote_code
        )

    def optim(self, on_gpu: bool) -> OptimSpec:
        """The optimizer step: [train]'s rate and schedule over the run's optimizer steps."""
        t = self.train
        return OptimSpec(
            lr=t.lr,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
            warmup_steps=t.lr_warmup_steps,
            mixed_precision=self.trainer.bf16(on_gpu=on_gpu),
            schedule=t.lr_schedule,
            total_steps=self.num_steps * t.optim_steps_per_step() if self.num_steps else None,
            min_lr_ratio=t.min_lr_ratio,
        )


class Trainer:
    """One rank's sharded policy, optimizer, schedule and (optionally) reference model."""

    def __init__(self, spec: TrainerSpec, device: torch.device):
        torch.manual_seed(spec.seed)
        self.spec, self.device = spec, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        hf = spec.load(spec.model_path, device)
        self.config = hf.config
        # What a sync announces: HF names, full shapes, in order, floats in the serving dtype
        # (whatever the backend holds: fp32 masters, or DeepSpeed's bf16 copies).
        self.weight_dtype = getattr(torch, spec.weight_dtype)
        plain = weight_metadata(self._on_wire(hf.state_dict().items(), device="meta"))
        self.hf_names = [m["name"] for m in plain]
        t = spec.train
        # LoRA: adapters injected before sharding; the HF names above stay what leaves the trainer.
        self._lora_dropouts = lora.apply_lora(hf, t.lora, spec.seed) if t.lora else []
        # What a weight sync sends: the plain model, or under train.lora.sync = "adapter" the
        # adapter alone, named as peft saves it (vLLM's worker writes it as a peft folder).
        self.sync_adapter = t.lora is not None and t.lora.sync == "adapter"
        self.metadata = (
            weight_metadata(
                self._on_wire(lora.adapter_state(hf.state_dict()).items(), device="meta")
            )
            if self.sync_adapter
            else plain
        )
        temperature, top_p = spec.sampling.behaviour()
        policy = PackedPolicy(hf, temperature, top_p)
        if spec.trainer.activation_checkpointing:
            policy.checkpoint_activations()  # before the backend shards or wraps it
        self.backend: Backend = make_backend(
            spec.trainer.backend,
            policy,
            device,
            spec.optim(on_gpu=device.type == "cuda"),
            zero_stage=spec.trainer.deepspeed_stage(),
        )
        self.reference = None
        if spec.reference_model_path is not None:
            self.reference = (
                PackedPolicy(spec.load(spec.reference_model_path, device), temperature, top_p)
                .to(device)
                .eval()
            )
            self.reference.requires_grad_(False)
        self.step = 0  # optimizer steps taken
        # The model LoRA adapters apply to: a resumed trainer starts from a checkpoint's merged
        # export, so load_checkpoint restores the original from the trainer state.
        self.base_model_path = spec.model_path
        self._pending_micro_batches = 0

    # ------------------------------------------------------------------------------ compute

    def warm_up(self) -> float | None:
        """Pay the first step's one-time costs before the first batch, changing nothing: on a
        backend with a step that changes nothing (FSDP2's ``step_changing_nothing``; DeepSpeed's
        engine counts every step it takes, so it has none and is left cold), one
        ``forward_backward`` of a made-up sequence with advantage 0 (FSDP2's lazy set-up, the
        loss's first calls), then that step. The weights, the optimizer's state (none yet), the
        schedule and the random state are as they were. A collective: every rank calls it.
        Returns its seconds, or None where the backend has no such step. On CPU (one 64-sequence
        mini-batch, 2 threads), the first ``forward_backward`` and ``optim_step`` took 0.21 s
        against 0.06 s after; warmed, 0.12 s."""
        start = time.perf_counter()
        step_changing_nothing = getattr(self.backend, "step_changing_nothing", None)
        if step_changing_nothing is None:
            return None
        rng = torch.get_rng_state()
        made_up = Sequence(
            prompt_ids=[0, 1], completion_ids=[1], inference_logprobs=[0.0], advantage=0.0
        )
        self.forward_backward([pack([made_up], None)], LossConfig(), denominator=1.0)
        self._pending_micro_batches = 0
        step_changing_nothing()
        torch.set_rng_state(rng)
        return time.perf_counter() - start

    def _run(self, mb: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.module(
            mb.input_ids_R_P, mb.position_ids_R_P, mb.hidden_index_N, mb.targets_N
        )

    @torch.no_grad()
    def forward(
        self, micro_batches: list[PackedBatch]
    ) -> list[tuple[tuple[int, int], list[float]]]:
        """Log-probs of every completion token with the current weights, per sequence key."""
        out = []
        for mb in micro_batches:
            mb = mb.to(self.device)
            logp_N, _ = self._run(mb)
            if mb.is_empty:
                continue
            logp_B_T = mb.to_B_T(logp_N.float()).cpu()
            for b, seq in enumerate(mb.sequences):
                out.append((seq.key, logp_B_T[b, : len(seq.completion_ids)].tolist()))
        return out

    def forward_backward(
        self, micro_batches: list[PackedBatch], cfg: LossConfig, denominator: float
    ) -> dict[str, Any]:
        """Accumulate gradients of the loss over this rank's micro-batches; return step sums.

        ``denominator``: the loss tokens of the whole optimizer step on all ranks.
        """
        scale = self.world_size / denominator
        sums = dict.fromkeys(SUM_KEYS, 0.0)
        hist: list[float] = []
        per_env = PerEnvMoments()
        with lora.dropout_active(self._lora_dropouts):  # LoRA dropout acts here only
            for mb in micro_batches:
                mb = mb.to(self.device)
                logp_N, entropy_N = self._run(mb)
                self._pending_micro_batches += 1
                if mb.is_empty:  # nothing to train here, but collectives must stay in step
                    self.backend.backward((logp_N.sum() + entropy_N.sum()) * 0.0)
                    continue
                inputs = self._loss_inputs(mb, logp_N, entropy_N, cfg)
                out = compute_loss(inputs, cfg)
                self.backend.backward(out.loss_sum * scale)
                _accumulate(sums, per_env, mb, out, logp_N.detach(), cfg)
                hist = add_counts(hist, out.is_hist)
        return {"sums": sums, "per_env": per_env.to_json(), "is_hist": hist}

    def _loss_inputs(
        self, mb: PackedBatch, logp_N: torch.Tensor, entropy_N: torch.Tensor, cfg: LossConfig
    ) -> LossInputs:
        logp_N = logp_N.float()
        old_N = mb.old_logprobs_N if mb.old_logprobs_N is not None else mb.inference_logprobs_N
        ref_B_T = None
        if self.reference is not None:
            with torch.no_grad():
                ref_N, _ = self.reference(
                    mb.input_ids_R_P, mb.position_ids_R_P, mb.hidden_index_N, mb.targets_N
                )
            ref_B_T = mb.to_B_T(ref_N.float())
        # Without an entropy bonus its value is a metric only: no gradient through it.
        entropy_N = entropy_N.float() if cfg.entropy_coef > 0 else entropy_N.detach().float()
        return LossInputs(
            logprobs_B_T=mb.to_B_T(logp_N),
            old_logprobs_B_T=mb.to_B_T(old_N),
            advantages_B=mb.advantages_B,
            mask_B_T=mb.mask_B_T(),
            inference_logprobs_B_T=mb.to_B_T(mb.inference_logprobs_N),
            ref_logprobs_B_T=ref_B_T,
            entropy_B_T=mb.to_B_T(entropy_N),
        )

    def optim_step(self) -> dict[str, float]:
        """Clip, step the optimizer and the schedule, zero the gradients."""
        if self._pending_micro_batches == 0:
            raise RuntimeError("optim_step without forward_backward: no gradients accumulated")
        start = time.perf_counter()
        out = self.backend.step()
        self.step += 1
        self._pending_micro_batches = 0
        return {**out, "optim_step": self.step, "optim_step_s": time.perf_counter() - start}

    # ------------------------------------------------------------------------------ weights

    def named_weights(
        self, full: dict[str, torch.Tensor] | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """Full HF-named weights in metadata order on rank 0 (a collective; [] on other ranks).

        Under LoRA the adapters are merged in: vLLM and HF loaders get a plain model.
        """
        full = self.backend.full_state_dict() if full is None else full
        if self.rank != 0:
            return []
        if self.spec.train.lora:
            full = lora.merged_state(full, self.spec.train.lora)
        return _in_order(full, self.hf_names)

    def sync_weights(self) -> list[tuple[str, torch.Tensor]]:
        """What a weight sync sends, in ``metadata`` order on rank 0 (a collective; [] on other
        ranks): ``named_weights``, or under ``train.lora.sync = "adapter"`` the adapter alone
        (only the trainable tensors are gathered); floats in the serving dtype, so the bytes
        equal what ``metadata`` announces on every backend."""
        if not self.sync_adapter:
            return self._on_wire(self.named_weights())
        adapter = lora.adapter_state(self.backend.full_state_dict(trainable_only=True))
        if self.rank != 0:
            return []
        return self._on_wire(_in_order(adapter, [m["name"] for m in self.metadata]))

    def _on_wire(self, named, device: str | None = None) -> list[tuple[str, torch.Tensor]]:
        """Floating tensors in the serving dtype (``device="meta"``: shapes only, no copy)."""
        return [
            (n, t.to(device=device or t.device, dtype=self.weight_dtype))
            if t.is_floating_point()
            else (n, t.to(device=device) if device else t)
            for n, t in named
        ]

    def detached(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``named`` made safe to keep while training goes on: tensors that share memory with
        this rank's live parameters (a backend's full state dict on CPU may return them as they
        are) are copied; the others are already fresh gathers."""
        live = {
            (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
            for p in self.backend.module.parameters()
        }
        live.discard(0)  # partitioned (ZeRO-3) placeholders hold no memory
        return [
            (n, t.detach().clone() if t.untyped_storage().data_ptr() in live else t.detach())
            for n, t in named
        ]

    # -------------------------------------------------------------------------- checkpoints

    def export_hf(self, folder: str | Path) -> Path | None:
        """Write an HF directory (config, safetensors, tokenizer) on rank 0; a collective.

        Under LoRA the model is merged, and ``adapter/`` holds the adapter alone (peft's format).
        """
        full = self.backend.full_state_dict()
        weights = dict(self.named_weights(full))
        if self.rank != 0:
            return None
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if self.spec.train.lora:
            lora.save_adapter(
                folder / lora.ADAPTER_DIR, full, self.spec.train.lora, self.base_model_path
            )
        if getattr(self.config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)  # safetensors refuses shared tensors; HF re-ties it
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            folder / "model.safetensors",
            metadata={"format": "pt"},
        )
        self.config.save_pretrained(folder)
        source = Path(self.spec.model_path)
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
            "tokenizer.model",
            "vocab.json",
            "merges.txt",
        ):
            if (source / name).exists() and not (folder / name).exists():
                shutil.copy(source / name, folder / name)
        return folder

    def save_checkpoint(self, folder: str | Path) -> None:
        """HF export at the top, trainer state in ``trainer/``: backend shards, RNG, step (collective).

        vLLM loads every ``*.safetensors`` at the top of a model directory: trainer state stays in
        the sub-folder. Each rank writes its own files into ``folder`` on its own host; the union
        of the hosts' folders is the checkpoint (``checkpoints.CheckpointOps`` uploads it).
        """
        folder = Path(folder)
        self.export_hf(folder)
        state_dir = folder / "trainer"
        state_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        self.backend.save(state_dir)
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        save_file(rng, state_dir / f"rng-rank{self.rank}.safetensors")
        if self.rank == 0:
            state = {
                "step": self.step,
                "backend": self.backend.name,
                "world_size": self.world_size,
                "reference_model": self.spec.reference_model_path,
                "base_model": self.base_model_path,
            }
            (state_dir / "state.json").write_text(json.dumps(state, indent=2))
        dist.barrier()

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore what ``save_checkpoint`` wrote, with the same backend (a collective)."""
        state_dir = Path(folder) / "trainer"
        state = json.loads((state_dir / "state.json").read_text())
        if state["backend"] != self.backend.name:
            raise ConfigError(
                f"{folder} holds {state['backend']} trainer state; this trainer runs "
                f"{self.backend.name}: set trainer.backend = {state['backend']!r} to resume it"
            )
        self.backend.load(state_dir)
        rng_file = state_dir / f"rng-rank{self.rank}.safetensors"
        if rng_file.exists():  # absent when resuming on more ranks than saved
            rng = load_file(rng_file)
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.step = state["step"]
        self.base_model_path = state.get("base_model", self.base_model_path)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The accumulated gradient, full and HF-named, on rank 0 (a collective; debugging and tests)."""
        return self.backend.full_gradients()

    def close(self) -> None:
        self.backend.close()


def _in_order(state: dict[str, torch.Tensor], names: list[str]) -> list[tuple[str, torch.Tensor]]:
    missing = [name for name in names if name not in state]
    if missing:
        raise RuntimeError(f"the backend's full state dict lacks {missing[:5]}")
    return [(name, state[name]) for name in names]


def add_counts(a: list[float], b: list[float]) -> list[float]:
    """Element-wise sum of two histograms (either may be empty)."""
    if not a or not b:
        return list(a or b)
    return [x + y for x, y in zip(a, b, strict=True)]


def _accumulate(
    sums: dict[str, float],
    per_env: PerEnvMoments,
    mb: PackedBatch,
    out,
    logp_N: torch.Tensor,
    cfg: LossConfig,
) -> None:
    """Add one micro-batch's sums and per-sequence statistics (by environment)."""
    sums["loss_sum"] += float(out.loss_sum.detach())
    sums["pg_loss_sum"] += out.pg_loss_sum
    sums["num_loss_tokens"] += out.num_tokens
    sums["num_tokens"] += mb.num_tokens
    sums["clipped_tokens"] += out.clipped_tokens
    sums["entropy_sum"] += out.entropy_sum
    sums["mismatch_kl_sum"] += out.mismatch_kl_sum
    sums["kl_sum"] += out.kl_sum
    sums["tis_weight_sum"] += out.tis_weight_sum
    sums["is_masked_tokens"] += out.is_masked_tokens
    # Importance weights of trainer vs sampler per token, for the effective sample size.
    # Environment tokens (mask 0) weigh nothing.
    w_N = torch.exp(logp_N.double() - mb.inference_logprobs_N.double()) * mb.loss_mask_N.double()
    seq_N = torch.div(mb.slot_N, mb.max_completion, rounding_mode="floor")
    w_B = torch.zeros(mb.num_seqs, dtype=torch.float64, device=w_N.device).index_add_(0, seq_N, w_N)
    w2_B = torch.zeros_like(w_B).index_add_(0, seq_N, w_N * w_N)
    sums["is_weight_sum"] += float(w_B.sum())
    sums["is_weight_sq_sum"] += float(w2_B.sum())
    s = {k: v.cpu().tolist() for k, v in out.sums_B.items()}
    w_B, w2_B = w_B.cpu().tolist(), w2_B.cpu().tolist()
    for b, seq in enumerate(mb.sequences):
        n = s["num_tokens"][b]
        if n == 0:  # an episode with no model token (all masked): nothing to report
            continue
        kl = s["kl"][b] if "kl" in s else 0.0
        per_env.add(
            "loss",
            seq.env,
            (s["pg_loss"][b] + cfg.kl_coef * kl - cfg.entropy_coef * s["entropy"][b]) / n,
        )
        per_env.add("clip_fraction", seq.env, s["clipped_tokens"][b] / n)
        per_env.add("entropy", seq.env, s["entropy"][b] / n)
        per_env.add("mismatch_kl", seq.env, s["mismatch_kl"][b] / n)
        per_env.add("ess", seq.env, effective_sample_size(w_B[b], w2_B[b], n))
        if "kl" in s:
            per_env.add("kl", seq.env, kl / n)
