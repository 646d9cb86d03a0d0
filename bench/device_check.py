"""The check a lent GPU machine runs first: one call, one table for docs/performance.md.

    bash scripts/device_check.sh                       # on the GPU machine (<= 8 minutes)
    .venv/bin/python bench/device_check.py --smoke     # here: every section on CPU at toy sizes

The lent machine (one H100 or H200, 15 minutes of device time a session, no network) has torch,
Triton, transformers and peft but no vLLM, Prefect or DeepSpeed; DeepSpeed and pydantic travel as
wheels in ``.whl/`` (scripts/device_check.sh installs them). So only the trainer's side runs
there, through rollflow's own code: the ``Trainer`` (FSDP2 / DeepSpeed, bf16), the packed
attention, the weight capture a sync sends, the Triton log-prob kernel.

Each section runs in a child process with its own deadline, so a crash, an out-of-memory or a
hang costs its row only. Rows:

- ``gpu``: the card, torch/CUDA/Triton/transformers versions, missing packages, and a measured
  bf16 matmul rate (8192^3) next to the datasheet's dense bf16 peak that MFU is taken against;
- ``fsdp2 step``: one trainer optimizer step of a random-init ~1.1B Llama (TinyLlama's shape) on
  64 sequences of 1024 tokens packed into 16k-token rows, FSDP2 bf16: tokens/s, MFU
  (6 * non-embedding params * tokens, attention excluded), peak memory; once with the packed
  attention the trainer picks and once with transformers' sdpa (a dense block-diagonal mask);
- ``attention``: one layer's attention alone on packed rows of 8k/16k/32k tokens: varlen flash
  vs sdpa with the dense mask vs a padded batch (forward + backward time, peak memory, max diff);
- ``weights``: what a weight sync captures (``Trainer.sync_weights``): the bytes announced in the
  metadata, the bytes captured, in which dtype, and the time;
- ``log-probs``: the Triton kernel of ``gpu_kernels.logprobs`` against the torch reference at
  16k tokens (max error of log-probs, entropy and gradients; time of each);
- ``deepspeed z2/z3``: the same trainer step on DeepSpeed ZeRO-2 and ZeRO-3 bf16, and whether
  its sync's announced bytes match what it captures;
- ``weight plane``: the receiving side of a sync on the GPU (the model's bf16 tensors from a
  sender process over gloo in 256 MB buckets, loaded into a served copy: time, rate, peak memory
  beyond the copy), the abort path (the sender lost mid-sync: the receiver's time to fail), and a
  tensor 4 x the bucket with the bucket on the GPU, received in place and yielded whole: peak
  GPU memory beyond the served copy (``larger_than_bucket``, issue 42 item 10).
  It names what one GPU cannot run (the NCCL wire, vLLM's loader);
- ``fsdp2 step, activation checkpointing``: the ``fsdp2 step`` row with
  ``trainer.activation_checkpointing`` on: its peak memory and step time against that row's.

Without CUDA (and without ``--smoke``) it fails at once with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(
    os.environ.get(
        "ROLLFLOW_DEVICE_CHECK_DIR", Path(tempfile.gettempdir()) / "rollflow-device-check"
    )
)

# Dense bf16 peak by the vendors' datasheets (TFLOP/s, no sparsity): MFU's denominator.
PEAK_BF16_TFLOPS = {
    "H200": 989.4,
    "H100 80GB HBM3": 989.4,
    "H100 PCIe": 756.0,
    "H100": 989.4,
    "A100": 312.0,
    "L40S": 362.1,
    "B200": 2250.0,
}
# Packages the rollflow image has that the lent machine's may lack (named in the gpu row).
PACKAGES = ("vllm", "prefect", "deepspeed", "flash_attn", "pydantic", "fastapi", "peft", "triton")

SHAPES = {
    # TinyLlama-1.1B's shape, random weights.
    "full": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
    ),
    "smoke": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}
BATCH = {
    "full": dict(seqs=64, prompt=256, completion=768, micro_tokens=16384),
    "smoke": dict(seqs=8, prompt=8, completion=24, micro_tokens=128),
}


def peak_tflops(name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device) -> float:
    import torch

    return (
        torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    )


def _device(smoke: bool):
    import torch

    return torch.device("cuda", 0) if not smoke else torch.device("cpu")


# ----------------------------------------------------------------------------------- sections


def section_gpu(smoke: bool) -> dict:
    import importlib.util

    import torch
    import transformers

    row = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }
    row["missing"] = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        row.update(
            card=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            sms=props.multi_processor_count,
        )
        row["peak_bf16_tflops"] = peak_tflops(props.name)
    try:
        import triton

        row["triton"] = triton.__version__
    except ImportError:
        pass
    device = _device(smoke)
    n = 8192 if not smoke else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    row["matmul_bf16_tflops"] = round(2 * n**3 * 10 / (time.perf_counter() - start) / 1e12, 1)
    return row


def section_model(smoke: bool) -> dict:
    """A random-init Llama saved as an HF folder (bf16 safetensors) for the trainer sections."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = WORK / ("model-smoke" if smoke else "model")
    if (folder / "config.json").exists():
        return {"model": str(folder), "cached": True}
    torch.manual_seed(0)
    shape = SHAPES["smoke" if smoke else "full"]
    config = LlamaConfig(
        **shape, max_position_embeddings=4096, tie_word_embeddings=False, torch_dtype="bfloat16"
    )
    start = time.perf_counter()
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    return {
        "model": str(folder),
        "params": params,
        "build_s": round(time.perf_counter() - start, 1),
    }


def _init_dist(device) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # DeepSpeed compiles a small op on its first CPU init (~40 s): reuse the trainer's cache.
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path("~/.cache/rollflow/torch_extensions").expanduser())
    )
    os.environ.setdefault("LOCAL_SIZE", "1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")


def _batch(smoke: bool, vocab: int, shape: dict | None = None):
    """Sequences of one optimizer step (``shape``, default ``BATCH``'s), packed into
    micro-batches as the service does."""
    import random

    from rollflow.trainer.packing import Sequence, pack, plan_micro_batches

    shape = shape or BATCH["smoke" if smoke else "full"]
    rng = random.Random(0)
    seqs = [
        Sequence(
            prompt_ids=[rng.randrange(vocab) for _ in range(shape["prompt"])],
            completion_ids=[rng.randrange(vocab) for _ in range(shape["completion"])],
            inference_logprobs=[-rng.uniform(0.5, 4) for _ in range(shape["completion"])],
            advantage=rng.uniform(-1, 1),
            key=(i // 8, i % 8),
        )
        for i in range(shape["seqs"])
    ]
    plan = plan_micro_batches([s.num_tokens for s in seqs], 1, shape["micro_tokens"])[0]
    # One row per micro-batch (row_tokens=None): the GPU packing, where attention must be varlen.
    return [pack([seqs[i] for i in mb], None) for mb in plan], sum(s.num_tokens for s in seqs)


def _trainer(
    smoke: bool,
    backend: str,
    zero_stage: int | None,
    attention: str | None,
    activation_checkpointing: bool = False,
):
    import torch

    from rollflow.infra.config import InferenceSection, TrainerServiceSection, TrainSection
    from rollflow.trainer import policy
    from rollflow.trainer.rank_trainer import Trainer, TrainerSpec

    device = _device(smoke)
    _init_dist(device)
    if (
        attention is not None
    ):  # force one attention (the comparison row); default: the trainer's pick
        if attention != "sdpa":
            from rollflow.gpu_kernels import varlen_attention

            varlen_attention.register()
        policy.attention_implementation = lambda _device: attention
    model = WORK / ("model-smoke" if smoke else "model")
    spec = TrainerSpec(
        model_path=str(model),
        train=TrainSection(lr=1e-6),
        trainer=TrainerServiceSection(
            backend=backend,
            zero_stage=zero_stage,
            activation_checkpointing=activation_checkpointing,
        ),
        # What a run's sync sends: the dtype vLLM serves on this device.
        weight_dtype=InferenceSection().serving_dtype(on_gpu=device.type == "cuda"),
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(spec, device)
    return trainer, device


def _step(trainer, micro_batches, cfg) -> float:
    start = time.perf_counter()
    total = sum(len(mb.targets_N) for mb in micro_batches if not mb.is_empty)
    trainer.forward_backward(micro_batches, cfg, float(total))
    trainer.optim_step()
    _sync(trainer.device)
    return time.perf_counter() - start


def section_trainer(
    smoke: bool,
    backend: str = "fsdp2",
    zero_stage: int | None = None,
    attention: str | None = None,
    weights: bool = False,
    activation_checkpointing: bool = False,
) -> dict:
    import torch

    from rollflow.infra.config import LossConfig

    trainer, device = _trainer(smoke, backend, zero_stage, attention, activation_checkpointing)
    hf = trainer.backend.module
    row = {"attention": getattr(trainer.config, "_attn_implementation", "?")}
    micro_batches, tokens = _batch(smoke, trainer.config.vocab_size)
    cfg = LossConfig()
    row["first_step_s"] = round(_step(trainer, micro_batches, cfg), 2)
    times = [_step(trainer, micro_batches, cfg) for _ in range(2 if not smoke else 1)]
    step_s = sum(times) / len(times)
    params = sum(
        p.numel() for n, p in trainer.backend.module.named_parameters() if "embed_tokens" not in n
    )
    if backend == "deepspeed" and zero_stage == 3:
        params = sum(
            m["numel"] for m in _metadata_sizes(trainer) if "embed_tokens" not in m["name"]
        )
    tokens_s = tokens / step_s
    row.update(
        tokens_per_step=tokens,
        step_s=round(step_s, 3),
        tokens_per_s=round(tokens_s),
        micro_batches=len(micro_batches),
    )
    peak = peak_tflops(torch.cuda.get_device_name(0)) if device.type == "cuda" else None
    if peak:
        row["mfu"] = round(6 * params * tokens_s / (peak * 1e12), 3)
    row["peak_mem_gib"] = round(_peak_gib(device), 1)
    if weights or backend == "deepspeed":
        row.update(_weights(trainer))
    del hf
    trainer.close()
    return row


def _metadata_sizes(trainer) -> list[dict]:
    import math

    return [
        {"name": m["name"], "numel": math.prod(m["shape"]), "dtype": m["dtype"]}
        for m in trainer.metadata
    ]


def _weights(trainer) -> dict:
    """What a sync announces (metadata) against what it captures (Trainer.sync_weights)."""
    import torch

    from rollflow.infra.weights.group import metadata_bytes

    _sync(trainer.device)
    start = time.perf_counter()
    named = trainer.detached(trainer.sync_weights())
    _sync(trainer.device)
    capture_s = time.perf_counter() - start
    sent = sum(t.numel() * t.element_size() for _, t in named)
    dtypes = sorted({str(t.dtype).replace("torch.", "") for _, t in named})
    announced = metadata_bytes(trainer.metadata)
    start = time.perf_counter()
    as_bf16 = [t.to(torch.bfloat16) for _, t in named]
    cast_s = time.perf_counter() - start
    return {
        "capture_s": round(capture_s, 2),
        "captured_gib": round(sent / 2**30, 3),
        "captured_dtypes": dtypes,
        "announced_gib": round(announced / 2**30, 3),
        "announced_matches_captured": announced == sent,
        "bf16_gib": round(sum(t.numel() * 2 for t in as_bf16) / 2**30, 3),
        "cast_to_bf16_s": round(cast_s, 2),
    }


def _weight_shapes(smoke: bool) -> list[tuple[str, list[int]]]:
    """The model's tensors (names, shapes), from its config on the meta device: what a sync of
    the check's model sends."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES["smoke" if smoke else "full"], tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return [(name, list(t.shape)) for name, t in model.state_dict().items()]


WEIGHT_BUCKET_BYTES = 256 * 2**20  # trainer.weight_bucket_mb's default
WEIGHT_SECRET = "device-check"


def _big_tensor(smoke: bool) -> tuple[list[int], int]:
    """A tensor larger than a bucket and its bucket: a 7B model's embedding (Qwen2.5-7B's
    152064 x 3584, bf16: 1.02 GiB, 4.06 x the default 256 MiB bucket); in smoke, 4 x 1 MiB."""
    return ([2048, 1024], 2**20) if smoke else ([152064, 3584], WEIGHT_BUCKET_BYTES)


def weight_sender(port: int, mode: str, smoke: bool) -> None:
    """The trainer's side of the weight plane, in a process of its own: random bf16 tensors of
    the model's shapes, one sync ("sync"), or the header and then this process's end, as a
    trainer lost mid-sync ("abort")."""
    import torch

    from rollflow.infra.weights.group import WeightSender

    if mode == "big":  # one tensor 4 x the bucket, twice (received in place, then yielded)
        shape, bucket = _big_tensor(smoke)
        sender = WeightSender("127.0.0.1", port, 2, 60, "cpu", bucket, secret=WEIGHT_SECRET)
        sender.connect()
        for version in (1, 2):
            sender.broadcast([("big", torch.full(shape, version, dtype=torch.bfloat16))], version)
        sender.close()
        return
    named = [(n, torch.randn(shape, dtype=torch.bfloat16)) for n, shape in _weight_shapes(smoke)]
    sender = WeightSender(
        "127.0.0.1", port, 2, 60, "cpu", WEIGHT_BUCKET_BYTES, secret=WEIGHT_SECRET
    )
    sender.connect()
    if mode == "abort":
        from rollflow.infra.weights.group import _bucket_size, bucket_layout, weight_metadata

        layout = bucket_layout(weight_metadata(named), WEIGHT_BUCKET_BYTES)
        total = sum(_bucket_size(b) for b in layout)  # as the sync's own header announces it
        header = torch.tensor([1, total], dtype=torch.int64)
        sender._broadcast(header)  # the sync begins ...
        time.sleep(1.0)
        os._exit(1)  # ... and its trainer is lost
    sender.broadcast(named, 1)
    sender.close()


def section_weight_plane(smoke: bool) -> dict:
    """The receiving side of a weight sync on this device, as one GPU can run it: the trainer's
    side (another process) sends the model's bf16 tensors over the gloo wire in 256 MB buckets,
    staged in host memory (the colocated plan's wire), and the receiver loads each into the
    served copy on the device: time, rate, and peak device memory beyond the served copy. Then
    the abort path: the trainer's side lost mid-sync, and how long the receiver takes to fail.
    Not run here: the NCCL wire (a GPU for each side: two GPUs), vLLM's loader (no vLLM)."""
    import torch

    from rollflow.infra.errors import WeightSyncError
    from rollflow.infra.processes import free_port
    from rollflow.infra.weights.group import WeightReceiverGroup, weight_metadata

    device = _device(smoke)
    shapes = _weight_shapes(smoke)
    served = {n: torch.empty(shape, dtype=torch.bfloat16, device=device) for n, shape in shapes}
    metadata = weight_metadata(served.items())
    model_bytes = sum(t.numel() * t.element_size() for t in served.values())

    def receiver(mode: str) -> tuple[WeightReceiverGroup, subprocess.Popen]:
        port = free_port()
        argv = [sys.executable, __file__, "--weight-sender", str(port), mode]
        sender = subprocess.Popen(argv + (["--smoke"] if smoke else []), cwd=ROOT)
        group = WeightReceiverGroup(
            "127.0.0.1", port, 1, 2, 60, "cpu", WEIGHT_BUCKET_BYTES, secret=WEIGHT_SECRET
        )
        group.connect()
        return group, sender

    group, sender = receiver("sync")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    version, tensors = group.receive(metadata)
    for name, tensor in tensors:
        served[name].copy_(tensor)
    _sync(device)
    receive_s = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
    group.close()
    sender.wait(timeout=60)
    row = {
        "wire": "gloo, host-staged buckets (one GPU)",
        "model_gib": round(model_bytes / 2**30, 3),
        "buckets": -(-model_bytes // WEIGHT_BUCKET_BYTES),
        "receive_s": round(receive_s, 2),
        "gib_s": round(model_bytes / 2**30 / receive_s, 2),
        "version": version,
        "peak_beyond_served_gib": round(peak / 2**30, 3) if device.type == "cuda" else None,
    }
    group, sender = receiver("abort")
    start = time.perf_counter()
    try:
        _, tensors = group.receive(metadata)
        for _ in tensors:
            pass
        row["abort"] = "the receiver did not fail"
    except WeightSyncError as exc:
        row["abort_s"] = round(time.perf_counter() - start, 2)
        row["abort"] = str(exc)[:120]
    finally:
        group.close()
        sender.wait(timeout=30)
    try:
        row["larger_than_bucket"] = _weight_plane_big(smoke)
    except Exception as exc:  # noqa: BLE001 - the rest of the row stands
        row["larger_than_bucket"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    row["not_run"] = "NCCL wire (needs 2 GPUs), vLLM's loader (no vLLM in the image)"
    return row


def _weight_plane_big(smoke: bool) -> dict:
    """Issue 42 item 10: a tensor 4 x the bucket received with the bucket on the GPU (as on
    the NCCL wire; over gloo, which stages CUDA tensors through host memory, since one GPU cannot
    hold both ends of an NCCL pair), into a served copy on the GPU, twice: received in place
    (``receive(into=...)``: a plain-copy load) and yielded whole, then copied (vLLM's loader's
    path: the split tensor assembled in host memory). Peak GPU memory beyond the served copy,
    the bucket included: about one bucket for both (before the fix the yielded one also held a
    full-size GPU copy: bucket + tensor)."""
    import torch

    from rollflow.infra.processes import free_port
    from rollflow.infra.weights.group import WeightReceiverGroup, weight_metadata

    class GlooReceiver(WeightReceiverGroup):
        def _make_group(self, store):
            return self._gloo_group(store)

    device = _device(smoke)
    shape, bucket = _big_tensor(smoke)
    served = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    metadata = weight_metadata([("big", served)])
    port = free_port()
    argv = [sys.executable, __file__, "--weight-sender", str(port), "big"]
    sender = subprocess.Popen(argv + (["--smoke"] if smoke else []), cwd=ROOT)
    group = GlooReceiver("127.0.0.1", port, 1, 2, 60, device, bucket, secret=WEIGHT_SECRET)
    cuda = device.type == "cuda"
    row = {
        "tensor_gib": round(served.numel() * 2 / 2**30, 3),
        "bucket_gib": round(bucket / 2**30, 3),
        "wire": "gloo, bucket on the device",
    }
    try:
        group.connect()
        base = torch.cuda.memory_allocated(device) if cuda else 0
        for how in ("in_place", "yielded"):
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            version, tensors = group.receive(
                metadata, **({"into": {"big": served}} if how == "in_place" else {})
            )
            for _, tensor in tensors:
                served.copy_(tensor)
            _sync(device)
            row[f"{how}_s"] = round(time.perf_counter() - start, 2)
            if cuda:  # read before the check below allocates its own
                peak = torch.cuda.max_memory_allocated(device) - base
                row[f"{how}_peak_beyond_served_gib"] = round(peak / 2**30, 3)
            row[f"{how}_ok"] = bool((served == version).all())
    finally:
        group.close()
        try:
            sender.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sender.kill()
    return row


def section_attention(smoke: bool) -> dict:
    """One layer's attention on packed rows: varlen vs dense-mask sdpa vs a padded batch."""
    return {
        str(n): _attention_row(smoke, n) for n in ((8192, 16384, 32768) if not smoke else (256,))
    }


def _attention_row(smoke: bool, row_tokens: int) -> dict:
    import torch
    import torch.nn.functional as F

    from rollflow.gpu_kernels.varlen_attention import varlen_attention_forward

    device = _device(smoke)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, dim = (32, 4, 64) if not smoke else (4, 2, 16)
    rep = heads // kv_heads
    # Sequences of 512..2048 tokens (64..256 in smoke) filling the row.
    lengths, left = [], row_tokens
    while left > 0:
        lengths.append(min(left, (512, 2048, 1024, 1536)[len(lengths) % 4] // (8 if smoke else 1)))
        left -= lengths[-1]
    pos_1_P = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    q = torch.randn(1, heads, row_tokens, dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, row_tokens, dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv_heads, row_tokens, dim, device=device, dtype=dtype, requires_grad=True)
    seg_P = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def varlen():
        return varlen_attention_forward(None, q, k, v, None, position_ids=pos_1_P)[0]

    def dense():  # transformers' sdpa path: a [P, P] block-diagonal causal mask
        causal = torch.ones(row_tokens, row_tokens, dtype=torch.bool, device=device).tril()
        mask = (seg_P[:, None] == seg_P[None, :]) & causal
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask[None, None]).transpose(1, 2)

    def padded():  # the same sequences as a padded batch, causal flash attention
        shape = (len(lengths), heads, max(lengths), dim)
        qs, ks, vs = (torch.zeros(shape, device=device, dtype=dtype) for _ in range(3))
        for i, (a, n) in enumerate(zip(starts, lengths, strict=True)):
            qs[i, :, :n] = q[0, :, a : a + n]
            ks[i, :, :n] = k[0, :, a : a + n].repeat_interleave(rep, 0)
            vs[i, :, :n] = v[0, :, a : a + n].repeat_interleave(rep, 0)
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    out, reference = {}, None
    for name, fn in (("varlen", varlen), ("dense_mask", dense), ("padded", padded)):
        try:
            out[name] = _time_fwd_bwd(fn, device)
            if name != "padded":
                with torch.no_grad():
                    y = fn().float()
                if reference is None:
                    reference = y
                else:
                    out[name]["max_abs_diff_vs_varlen"] = float((y - reference).abs().max())
        except Exception as exc:  # noqa: BLE001 - one variant's failure is a figure too
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _time_fwd_bwd(fn, device, reps: int = 3) -> dict:
    import torch

    for _ in range(2):
        fn().float().sum().backward()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn().float().sum().backward()
    _sync(device)
    elapsed_ms = (time.perf_counter() - start) / reps * 1e3
    return {"fwd_bwd_ms": round(elapsed_ms, 2), "peak_mem_gib": round(_peak_gib(device), 2)}


def section_logprobs(smoke: bool) -> dict:
    """The Triton log-prob kernel against the torch reference (values, gradients, time)."""
    return {str(v): _logprob_case(smoke, v) for v in ((32000, 151936) if not smoke else (128,))}


def _logprob_case(smoke: bool, vocab: int) -> dict:
    import torch

    from rollflow.gpu_kernels.logprobs import (
        TorchRowOps,
        reference_logprobs_entropy,
        selective_logprobs_entropy,
    )

    device = _device(smoke)
    n, h = (16384, 2048) if not smoke else (64, 32)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    hidden = (torch.randn(n, h, device=device) * 0.5).to(dtype).requires_grad_()
    head = (torch.randn(vocab, h, device=device) * 0.02).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device=device)
    variants = {
        "kernel": lambda: selective_logprobs_entropy(hidden, head, targets),
        "torch_chunked": lambda: selective_logprobs_entropy(
            hidden, head, targets, row_ops=TorchRowOps()
        ),
    }
    if vocab <= 32000:  # the full N x V reference at 152k holds ~10 GiB per fp32 copy
        variants["reference"] = lambda: reference_logprobs_entropy(hidden, head, targets)
    entry, results = {}, {}
    for name, fn in variants.items():
        for _warm_then_timed in range(2):
            hidden.grad = head.grad = None
            _sync(device)
            start = time.perf_counter()
            logp, ent = fn()
            (logp.sum() + 0.1 * ent.sum()).backward()
            _sync(device)
        entry[f"{name}_ms"] = round((time.perf_counter() - start) * 1e3, 1)
        results[name] = [x.detach().float() for x in (logp, ent, hidden.grad, head.grad)]
    base_name = "reference" if "reference" in results else "torch_chunked"
    base, kernel = results[base_name], results["kernel"]
    entry["vs"] = base_name
    for i, what in enumerate(("logprob", "entropy", "grad_hidden", "grad_head")):
        err = (kernel[i] - base[i]).abs().max()
        scale = base[i].abs().max() if what.startswith("grad") else 1.0
        entry[f"max_{'rel_' if what.startswith('grad') else ''}err_{what}"] = float(err / scale)
    return entry


# In the order they run (most wanted first): name -> (function, arguments, deadline in seconds).
SECTIONS = {
    "gpu": (section_gpu, {}, 60),
    "model": (section_model, {}, 120),
    "fsdp2 step": (section_trainer, {"weights": True}, 150),
    "attention": (section_attention, {}, 90),
    "log-probs": (section_logprobs, {}, 90),
    "deepspeed z2": (section_trainer, {"backend": "deepspeed", "zero_stage": 2}, 120),
    "fsdp2 step, sdpa mask": (section_trainer, {"attention": "sdpa"}, 120),
    "deepspeed z3": (section_trainer, {"backend": "deepspeed", "zero_stage": 3}, 120),
    "weight plane": (section_weight_plane, {}, 120),
    # trainer.activation_checkpointing: peak memory against the "fsdp2 step" row's
    "fsdp2 step, activation checkpointing": (
        section_trainer,
        {"activation_checkpointing": True},
        150,
    ),
}


def run_child(name: str, smoke: bool, deadline_s: float) -> dict:
    """One section in its own process, under its own deadline."""
    out = WORK / f"{name.replace(' ', '_').replace(',', '')}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--section", name, "--out", str(out)] + (
        ["--smoke"] if smoke else []
    )
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within its {deadline_s:.0f}s deadline"}
    row = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode != 0 and "error" not in row:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        row["error"] = f"exit {proc.returncode}: " + " | ".join(tail)[-400:]
    row["section_s"] = round(time.perf_counter() - start, 1)
    return row


def child(name: str, smoke: bool, out: Path) -> None:
    fn, kwargs, _ = SECTIONS[name]
    try:
        row = fn(smoke, **kwargs)
    except ImportError as exc:
        row = {"error": f"missing package: {exc.name or exc}"}
    except Exception as exc:  # noqa: BLE001 - the row reports it
        import traceback

        traceback.print_exc()
        row = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    out.write_text(json.dumps(row))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="toy sizes on CPU: checks the code, gives no figures"
    )
    parser.add_argument("--only", nargs="*", help="run these sections only")
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--weight-sender", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument("--budget-s", type=float, default=450, help="the whole check's deadline")
    args = parser.parse_args()
    if args.section:
        child(args.section, args.smoke, args.out)
        return 0
    if args.weight_sender:
        weight_sender(int(args.weight_sender[0]), args.weight_sender[1], args.smoke)
        return 0
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            f"device check: no CUDA device visible to torch {torch.__version__}: run it on a GPU machine (or --smoke here)",
            file=sys.stderr,
        )
        return 1
    WORK.mkdir(parents=True, exist_ok=True)
    names = args.only or list(SECTIONS)
    results = {}
    ends = time.monotonic() + args.budget_s
    for name in names:
        left = ends - time.monotonic()
        if left < 20:
            results[name] = {"error": f"skipped: the check's {args.budget_s:.0f}s budget is spent"}
            continue
        deadline = SECTIONS[name][2] * (3 if args.smoke else 1)
        row = run_child(name, args.smoke, min(deadline, left))
        results[name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(table(results))
    return 0 if all("error" not in row for row in results.values()) else 1


def table(results: dict) -> str:
    lines = ["", "| section | result |", "|---|---|"]
    for name, row in results.items():
        text = (
            row["error"]
            if "error" in row
            else ", ".join(f"{k} {v}" for k, v in row.items() if not isinstance(v, dict))
        )
        lines.append(f"| {name} | {text} |")
        for sub, entry in row.items():
            if isinstance(entry, dict):
                lines.append(f"| {name} {sub} | {json.dumps(entry)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
