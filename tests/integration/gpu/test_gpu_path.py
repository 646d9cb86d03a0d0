"""The GPU branch, ready to run: ``pytest -m gpu`` (``bash scripts/gpu_check.sh`` prints a table).

Without CUDA every test here skips with its reason. With GPUs:
- the NCCL weight group at three sizes (as many members as there are GPUs, up to 4), sender and
  receivers bit-equal, the bucket on each GPU, through the plan's backend decision;
- the compiled Triton log-prob kernel against the torch reference, values and gradients;
- one bf16 FSDP2 step of the trainer service on one GPU;
- a 3-step run of a tiny model with vLLM on a GPU (on its own, NCCL weights; or colocated on one
  GPU, where the plan sends the weights over gloo through host memory: NCCL refuses two members
  of one group on one GPU).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU visible here)"),
]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _receiver(port: int, rank: int, world: int, bucket_bytes: int, metadata, queue) -> None:
    from rollflow.infra.weights.group import WeightReceiverGroup

    device = torch.device("cuda", rank)
    group = WeightReceiverGroup(
        "127.0.0.1", port, rank, world, 60, device=device, bucket_bytes=bucket_bytes, secret="gpu"
    )
    group.connect()
    version, named = group.receive(metadata)
    queue.put((rank, version, {n: t.cpu() for n, t in named}))
    group.close()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_nccl_weight_group_delivers_bit_equal_weights(world_size):
    if world_size > _gpus():
        pytest.skip(f"a group of {world_size} needs {world_size} GPUs (NCCL: one rank per GPU)")
    from rollflow.infra.placement import choose_backend
    from rollflow.infra.processes import free_port
    from rollflow.infra.weights.group import WeightSender, weight_metadata

    wire = choose_backend("cuda", "cuda")
    assert wire.backend == "nccl" and wire.device == "cuda"
    gen = torch.Generator().manual_seed(0)
    tensors = [
        ("embed", torch.randn(4096, 256, generator=gen).to(torch.bfloat16)),
        ("norm", torch.randn(256, generator=gen)),
        *[(f"w{i}", torch.randn(512, 512, generator=gen).to(torch.bfloat16)) for i in range(4)],
    ]
    metadata = weight_metadata(tensors)
    bucket_bytes = 1 << 20
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_receiver, args=(port, r, world_size, bucket_bytes, metadata, queue))
        for r in range(1, world_size)
    ]
    for p in procs:
        p.start()
    sender = WeightSender(
        "127.0.0.1",
        port,
        world_size,
        60,
        device=torch.device("cuda", 0),
        bucket_bytes=bucket_bytes,
        secret="gpu",
    )
    sender.connect()
    start = time.perf_counter()
    sent = sender.broadcast([(n, t.cuda()) for n, t in tensors], version=7)
    elapsed = time.perf_counter() - start
    got = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    sender.close()
    print(f"\nNCCL group of {world_size}: {sent / 1e6:.1f} MB in {elapsed * 1e3:.1f} ms")
    for _, version, named in got:
        assert version == 7
        for name, t in tensors:
            assert named[name].dtype == t.dtype and torch.equal(named[name], t), name


def test_compiled_triton_logprobs_equal_the_torch_reference():
    pytest.importorskip("triton")
    from rollflow.gpu_kernels.logprobs import reference_logprobs_entropy, selective_logprobs_entropy

    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for temperature in (1.0, 0.7):
            hidden = torch.randn(300, 64, device="cuda", generator=gen).to(dtype).requires_grad_()
            head = (2 * torch.randn(1001, 64, device="cuda", generator=gen)).to(dtype)
            head.requires_grad_()
            targets = torch.randint(0, 1001, (300,), device="cuda", generator=gen)
            w = torch.randn(300, device="cuda", generator=gen)
            results = []
            for fn, kw in (
                (selective_logprobs_entropy, {"chunk_size": 128}),
                (reference_logprobs_entropy, {}),
            ):
                hidden.grad = head.grad = None
                lp, ent = fn(hidden, head, targets, temperature=temperature, **kw)
                ((w * lp).sum() + (w * ent).sum()).backward()
                results.append((lp.detach(), ent.detach(), hidden.grad.float(), head.grad.float()))
            for name, got, want in zip(
                ("logprobs", "entropy", "d hidden", "d head"), *results, strict=True
            ):
                scale = want.abs().max().item()
                err = (got.float() - want.float()).abs().max().item()
                assert err <= tol * scale, (
                    f"{dtype} T={temperature} {name}: {err} > {tol} x {scale}"
                )


def test_bf16_fsdp2_step_on_one_gpu(tmp_path, tiny_model_dir):
    import secrets

    from rollflow.infra.config import LossConfig, TrainerServiceSection, TrainSection
    from rollflow.infra.storage import RunStorage
    from rollflow.services.trainer_process import TrainerProcess
    from rollflow.trainer.protocol import ServiceArgs

    from trainer_support import make_rows, write_batch

    storage = RunStorage(str(tmp_path / "runs"), "gpu")
    write_batch(storage, 1, make_rows(16, seed=1))
    args = ServiceArgs(
        model_path=str(tiny_model_dir),
        storage_root=str(tmp_path / "runs"),
        run="gpu",
        train=TrainSection(lr=1e-3),
        trainer=TrainerServiceSection(backend="fsdp2", num_ranks=1, device="cuda"),
    )
    proc = TrainerProcess(
        args, token=secrets.token_hex(8), log_dir=tmp_path / "logs", device_env={}
    )
    proc.start()
    try:
        proc.wait_healthy()
        fb = proc.client.forward_backward(1, loss=LossConfig())
        step = proc.client.optim_step()
        assert fb.num_loss_tokens > 0 and step.grad_norm > 0
        print(f"\nbf16 FSDP2 step: loss {fb.loss:.4f}, grad norm {step.grad_norm:.4f}")
    finally:
        proc.stop()


def test_three_step_run_with_vllm_on_gpu(tmp_path, model_cache):
    from run_support import ROOT, env_for, write_config

    config = write_config(tmp_path, model_cache, name="gpu3", steps=3)
    overrides = [] if _gpus() > 1 else ["inference.colocate=true"]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", "run", str(config), *overrides],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**env_for(tmp_path), **os.environ},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 3/3" in proc.stdout
    print(f"\n3-step GPU run: {time.monotonic() - start:.0f}s")
