"""A full weight sync: our weight group against a raw gloo broadcast and an in-process copy.

    .venv/bin/python bench/weight_sync.py                     # ~10M, ~100M, ~500M + vLLM, ~6 min
    .venv/bin/python bench/weight_sync.py --sizes 10M --no-vllm
    .venv/bin/python bench/weight_sync.py --sizes 10M 100M --lora 16   # part 4 alone

Part 1, transport (float32, the CPU path; two processes on this machine, gloo over loopback):
for Llama-shaped state dicts of ~10M, ~100M and ~500M parameters (random values; the transport
does not look at them), each repeated ``--repeats`` times in one weight group:

- ours: ``WeightSender.broadcast(named_tensors)`` → ``WeightReceiverGroup.receive`` and every
  tensor view taken (what the vLLM worker extension does before ``reload_weights``);
- raw gloo: one broadcast of a flat tensor of the same bytes on the same group (the floor of
  any gloo path);
- in-process copy: ``dst.copy_(src)`` of the same bytes in one process (memory bandwidth).

Timed from the sender's start (after a tiny broadcast that lines both ranks up) to the moment
the receiver holds every tensor; both clocks are ``time.perf_counter`` (CLOCK_MONOTONIC, shared
by the processes of one machine). Also shown: packing the tensors into the sender's bucket
alone (``torch.cat(..., out=bucket)``), the extra copy the one-bucket wire format costs.

Part 3, buckets: the ~100M model sent with buckets of ``--buckets-mb`` MiB (the first, 256 MiB,
holds it whole): time, and the bucket each side holds beyond the weights (its peak extra memory).

Part 4, LoRA (``--lora RANK``, run alone): what one sync of a LoRA policy costs, adapters of rank
RANK on every projection. ``train.lora.sync = "merged"`` (the default) sends merged weights
(``trainer/lora.merged_state`` on the trainer, then the full bytes through the weight group;
docs/lora.md says why); ``"adapter"`` the adapter alone over the same group. Both timed with part
1's method, in one run. Then, unless ``--no-vllm``, end to end on the ~10M model: each mode's sync
into a real vLLM under load (part 2's method; adapter mode: the server serves the adapter, the
worker writes it as a peft folder and loads it in place).

Part 2, generation paused (real vLLM, ``--no-vllm`` skips it): one and two vLLM servers (one
weight group, ``--servers``) of the quickstart model (0.4M parameters) and of a ~10M one, under a load of 32 requests kept in flight, receives
``--vllm-syncs`` syncs through ``tasks.sync.weights.sync_weights`` (pause(keep) → broadcast ∥
receive + ``reload_weights`` → reset prefix cache → resume). "Paused" is from the pause request
to the resume's answer; the baseline is our transport of the same model's bytes to a plain
receiver (part 1's method), measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

from rollflow.infra.processes import free_port  # noqa: E402
from rollflow.infra.weights.group import (  # noqa: E402
    DEFAULT_BUCKET_BYTES,
    WeightReceiverGroup,
    WeightSender,
    weight_metadata,
)

from machine import Machine, table  # noqa: E402

# (hidden, layers, intermediate, vocab) of Llama-shaped models of about the named size.
SHAPES = {
    "10M": (256, 4, 1024, 12_000),
    "100M": (768, 10, 2048, 16_000),
    "500M": (1536, 14, 4096, 32_000),
}
SECRET = "bench-secret"  # the membership challenge (weights/group.py) is part of connect()
TIMEOUT_S = 300.0


def llama_shapes(hidden: int, layers: int, inter: int, vocab: int) -> list[tuple[str, list[int]]]:
    shapes = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + f"self_attn.{n}_proj.weight", [hidden, hidden]) for n in "qkvo"]
        shapes += [
            (p + "mlp.gate_proj.weight", [inter, hidden]),
            (p + "mlp.up_proj.weight", [inter, hidden]),
            (p + "mlp.down_proj.weight", [hidden, inter]),
            (p + "input_layernorm.weight", [hidden]),
            (p + "post_attention_layernorm.weight", [hidden]),
        ]
    return shapes + [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]


def flat_named_tensors(
    shapes: list[tuple[str, list[int]]],
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """One flat float32 storage and named views into it (so the raw broadcast needs no copy)."""
    total = sum(torch.Size(s).numel() for _, s in shapes)
    flat = torch.empty(total, dtype=torch.float32).uniform_(-0.02, 0.02)
    named, offset = [], 0
    for name, shape in shapes:
        n = torch.Size(shape).numel()
        named.append((name, flat[offset : offset + n].view(shape)))
        offset += n
    return flat, named


# ------------------------------------------------------------------------------ part 1


def receiver(spec: dict) -> None:
    """The receiving rank (a child process): prints the time it held each broadcast."""
    torch.set_num_threads(1)
    group = WeightReceiverGroup(
        "127.0.0.1",
        spec["port"],
        1,
        2,
        TIMEOUT_S,
        bucket_bytes=spec["bucket_bytes"],
        secret=SECRET,
    )
    group.connect()
    meta, done = spec["metadata"], {"raw": [], "ours": []}
    line_up = torch.zeros(1, dtype=torch.int64)
    raw = torch.empty(spec["numel"], dtype=torch.float32)
    for _ in range(spec["repeats"]):
        group._broadcast(line_up)
        group._broadcast(raw)
        done["raw"].append(time.perf_counter())
    del raw
    for _ in range(spec["repeats"]):
        group._broadcast(line_up)
        _, named = group.receive(meta)
        views = list(named)
        done["ours"].append(time.perf_counter())
        del views, named
    done["peak_bucket_bytes"] = group.peak_bucket_bytes
    group.close()
    print(json.dumps(done))


def measure_transport(
    named: list[tuple[str, torch.Tensor]],
    flat: torch.Tensor | None,
    repeats: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> dict:
    """Seconds per full sync: ours, raw gloo, in-process copy, and the sender's torch.cat."""
    if flat is None:
        flat = torch.cat([t.detach().reshape(-1) for _, t in named])
    meta = weight_metadata(named)
    port = free_port()
    spec = {
        "port": port,
        "metadata": meta,
        "numel": flat.numel(),
        "repeats": repeats,
        "bucket_bytes": bucket_bytes,
    }
    child = subprocess.Popen(
        [sys.executable, __file__, "--receiver", json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    sender = WeightSender("127.0.0.1", port, 2, TIMEOUT_S, bucket_bytes=bucket_bytes, secret=SECRET)
    started = {"raw": [], "ours": []}
    try:
        sender.connect()
        line_up = torch.zeros(1, dtype=torch.int64)
        for _ in range(repeats):
            sender._broadcast(line_up)
            started["raw"].append(time.perf_counter())
            sender._broadcast(flat)
        for version in range(repeats):
            sender._broadcast(line_up)
            started["ours"].append(time.perf_counter())
            sender.broadcast(named, version)
        sender_peak = sender.peak_bucket_bytes  # (close() lets the bucket go)
        out, _ = child.communicate(timeout=TIMEOUT_S)
    finally:
        sender.close()
        if child.poll() is None:
            child.kill()
    done = json.loads(out.strip().splitlines()[-1])
    peaks = {
        "sender_peak": sender_peak,
        "receiver_peak": done.pop("peak_bucket_bytes"),
    }
    result = {
        k: statistics.median(d - s for s, d in zip(started[k], done[k], strict=True))
        for k in started
    }
    dst = torch.empty_like(flat)
    result["cat"] = _best(
        lambda: torch.cat([t.detach().reshape(-1) for _, t in named], out=dst), repeats
    )
    result["copy"] = _best(lambda: dst.copy_(flat), repeats)
    result["bytes"] = flat.numel() * flat.element_size()
    result["params"] = flat.numel()
    return result | peaks


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# ------------------------------------------------------------------------------ part 2


def lora_policy(model_dir: Path, rank: int):
    """The trainer's state of a LoRA policy on ``model_dir``: rank ``rank`` on every projection,
    B random (peft starts it at zero)."""
    from transformers import AutoModelForCausalLM

    from rollflow.infra.config import LoraSection
    from rollflow.trainer.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir).float()
    cfg = LoraSection(rank=rank, alpha=2.0 * rank)
    apply_lora(model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape) * 0.01)
    return {k: v.detach() for k, v in model.state_dict().items()}, cfg


def vllm_pause(
    model_dir: Path,
    syncs: int,
    log_dir: Path,
    servers: int = 1,
    lora: tuple[str, int] | None = None,
) -> dict:
    """Syncs into ``servers`` real vLLM servers (one weight group) under load; returns the
    sync_weights figures. ``lora = (sync, rank)``: a LoRA policy synced as ``train.lora.sync``
    does it: ``"merged"`` merges on every sync, as the trainer does, then sends the model;
    ``"adapter"`` sends the adapter to servers that serve it (``--enable-lora``)."""
    from transformers import AutoModelForCausalLM

    from rollflow.infra.vllm_fleet.client import InferenceClient
    from rollflow.infra.vllm_fleet.workers import WeightWorkers
    from rollflow.services.vllm_server import InferenceServer
    from rollflow.tasks.sync.weights import GroupSpec, init_weight_group, sync_weights
    from rollflow.trainer.lora import adapter_state, merged_state, save_initial_adapter

    initial = None
    if lora is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir).float()
        named = [(n, t.detach()) for n, t in model.state_dict().items()]
        sent = lambda: named  # noqa: E731
    else:
        full, cfg = lora_policy(model_dir, lora[1])
        if lora[0] == "adapter":
            named = list(adapter_state(full).items())
            sent = lambda: named  # noqa: E731
            initial = save_initial_adapter(log_dir / f"v0-{model_dir.name}", model_dir, cfg)
        else:
            named = list(merged_state(full, cfg).items())
            sent = lambda: list(merged_state(full, cfg).items())  # noqa: E731
    transport = measure_transport(named, None, 5)
    group = [
        InferenceServer(
            model_dir,
            max_model_len=64,
            log_path=log_dir / f"vllm-{model_dir.name}-{i}.log",
            api_key=SECRET,  # its workers prove the key to join the weight group
            lora_adapter=initial,
        )
        for i in range(servers)
    ]
    start = time.monotonic()
    for server in group:
        server.spawn()
    for server in group:
        server.wait_ready()
    startup_s = time.monotonic() - start
    port = free_port()
    sender = WeightSender("127.0.0.1", port, 1 + servers, TIMEOUT_S, secret=SECRET)
    spec = GroupSpec(world_size=1 + servers, wire_device="cpu", bucket_bytes=DEFAULT_BUCKET_BYTES)

    async def go() -> list[dict]:
        clients = [InferenceClient(server.url, timeout_s=120) for server in group]
        try:
            await init_weight_group(
                [(c, 1 + i) for i, c in enumerate(clients)],
                lambda: asyncio.to_thread(sender.connect),
                spec,
                port,
                TIMEOUT_S,
                weight_metadata(named),
            )
            stop = asyncio.Event()

            async def load(client) -> None:  # 32 requests kept in flight while syncs happen
                while not stop.is_set():
                    await client.complete([1, 5, 6, 7], n=1, max_tokens=32, temperature=1.0)

            loaders = [asyncio.create_task(load(clients[i % servers])) for i in range(32)]
            await asyncio.sleep(2.0)
            stats = []
            for version in range(1, syncs + 1):
                stats.append(
                    await sync_weights(
                        clients,
                        lambda v=version: asyncio.to_thread(lambda: sender.broadcast(sent(), v)),
                        version,
                        TIMEOUT_S,
                    )
                )
                await asyncio.sleep(0.5)
            stop.set()
            await asyncio.gather(*loaders)
            for client in clients:
                await WeightWorkers(client).close_weight_group()
            return stats
        finally:
            for client in clients:
                await client.aclose()

    try:
        stats = asyncio.run(go())
    finally:
        sender.close()
        for server in group:
            server.stop()
    paused = [s["total_s"] for s in stats]
    return {
        "params": transport["params"],
        "bytes": transport["bytes"],
        "startup_s": startup_s,
        "transport_s": transport["ours"],
        "paused_median_s": statistics.median(paused),
        "paused_max_s": max(paused),
        "broadcast_median_s": statistics.median(s["broadcast_s"] for s in stats),
        "pause_call_median_s": statistics.median(s["pause_s"] for s in stats),
        "syncs": len(stats),
        "servers": servers,
    }


def tiny_model_dirs(root: Path) -> list[tuple[str, Path]]:
    from rollflow.infra.config import TinyModelSpec, load_config
    from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama, save_hf_dir

    quick = load_config(ROOT / "configs/quickstart.toml").model.tiny
    specs = {
        "quickstart (0.4M)": quick.model_copy(update={"max_position_embeddings": 64}),
        "~10M": TinyModelSpec(
            hidden_size=512,
            num_layers=3,
            intermediate_size=1536,
            num_heads=8,
            max_position_embeddings=64,
        ),
    }
    tok = build_char_tokenizer(quick.alphabet)
    return [
        (name, save_hf_dir(build_tiny_llama(spec, len(tok)), tok, root / f"m{i}"))
        for i, (name, spec) in enumerate(specs.items())
    ]


# ------------------------------------------------------------------------------ main


# ------------------------------------------------------------------------------ part 4

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_costs(size: str, rank: int, repeats: int) -> dict:
    """Bytes and seconds of one sync of a LoRA policy: merged (ours) against the adapter alone."""
    from rollflow.infra.config import LoraSection
    from rollflow.trainer.lora import adapter_num_bytes, merged_state

    flat, named = flat_named_tensors(llama_shapes(*SHAPES[size]))
    full, adapter = {}, []
    for name, t in named:  # the trainer's state under LoRA: base_layer + lora_A / lora_B
        layer = name.removesuffix(".weight")
        if layer.endswith(PROJECTIONS):
            a_r_in = torch.randn(rank, t.shape[1]) * 0.01
            b_out_r = torch.randn(t.shape[0], rank) * 0.01
            full[f"{layer}.base_layer.weight"] = t
            full[f"{layer}.lora_A.default.weight"] = a_r_in
            full[f"{layer}.lora_B.default.weight"] = b_out_r
            adapter += [(f"{layer}.lora_A.weight", a_r_in), (f"{layer}.lora_B.weight", b_out_r)]
        else:
            full[name] = t
    cfg = LoraSection(rank=rank, alpha=2.0 * rank)
    merge_s = _best(lambda: merged_state(full, cfg), repeats)
    merged = measure_transport(named, flat, repeats)
    alone = measure_transport(adapter, None, repeats)
    assert alone["bytes"] == adapter_num_bytes(full)
    return {"merged": merged, "adapter": alone, "merge_s": merge_s}


def print_lora(sizes: list[str], rank: int, repeats: int) -> None:
    rows = []
    for size in sizes:
        c = lora_costs(size, rank, repeats)
        m, a = c["merged"], c["adapter"]
        ours_s = c["merge_s"] + m["ours"]
        rows.append(
            [
                f"{m['params'] / 1e6:.0f}M",
                f"{m['bytes'] / 1e6:.1f}",
                f"{a['bytes'] / 1e6:.2f}",
                f"{c['merge_s'] * 1000:.1f}",
                f"{m['ours'] * 1000:.1f}",
                f"{ours_s * 1000:.1f}",
                f"{a['ours'] * 1000:.2f}",
                f"{m['bytes'] / a['bytes']:.0f}×",
                f"{ours_s / a['ours']:.1f}×",
            ]
        )
    print(f"\nLoRA rank {rank} on every projection, one sync, median of {repeats}\n")
    print(
        table(
            [
                "params",
                "full MB",
                "adapter MB",
                "merge ms",
                "merged transport ms",
                "merged sync ms (ours)",
                "adapter transport ms",
                "bytes full / adapter",
                "time ours / adapter",
            ],
            rows,
        )
    )


def print_lora_vllm(rank: int, syncs: int) -> None:
    """Part 4 end to end: a LoRA policy of the ~10M model synced into a real vLLM under load,
    merged (merge + model bytes + reload_weights) against adapter (adapter bytes + peft folder +
    in-place LoRA load), each through ``sync_weights``: pause(keep) to resume."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollflow-bench-lora-") as tmp:
        name, model_dir = tiny_model_dirs(Path(tmp))[1]
        for sync in ("merged", "adapter"):
            v = vllm_pause(model_dir, syncs, Path(tmp), lora=(sync, rank))
            rows.append(
                [
                    sync,
                    f"{v['bytes'] / 1e6:.2f}",
                    v["syncs"],
                    f"{v['pause_call_median_s'] * 1000:.0f}",
                    f"{v['broadcast_median_s'] * 1000:.0f}",
                    f"{v['paused_median_s'] * 1000:.0f}",
                    f"{v['paused_max_s'] * 1000:.0f}",
                ]
            )
            print(f"vLLM {sync}: done", file=sys.stderr, flush=True)
    print(f"\n{name} model, LoRA rank {rank} on every projection, into one vLLM under load\n")
    print(
        table(
            [
                "train.lora.sync",
                "MB sent",
                "syncs",
                "pause ms (median)",
                "send + load ms (median)",
                "paused ms (median)",
                "paused ms (max)",
            ],
            rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--vllm-syncs", type=int, default=10)
    parser.add_argument(
        "--servers", type=int, nargs="+", default=[1, 2], help="vLLM servers in the group (part 2)"
    )
    parser.add_argument(
        "--buckets-mb",
        type=float,
        nargs="+",
        default=[256, 64, 16],
        help="bucket sizes for part 3 (the ~100M model)",
    )
    parser.add_argument("--lora", type=int, metavar="RANK", help="part 4 alone: LoRA of this rank")
    parser.add_argument("--receiver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        receiver(json.loads(args.receiver))
        return
    if args.lora:
        machine = Machine()
        print_lora(args.sizes, args.lora, args.repeats)
        if not args.no_vllm:
            print_lora_vllm(args.lora, args.vllm_syncs)
        print("\n" + machine.line())
        return

    machine = Machine()
    gbps = lambda nbytes, s: f"{nbytes / s / 1e9:.2f}"  # noqa: E731
    rows = []
    for size in args.sizes:
        flat, named = flat_named_tensors(llama_shapes(*SHAPES[size]))
        r = measure_transport(named, flat, args.repeats)
        del flat, named
        b = r["bytes"]
        rows.append(
            [
                f"{r['params'] / 1e6:.0f}M",
                f"{b / 1e6:.0f}",
                f"{r['ours'] * 1000:.0f}",
                f"{r['raw'] * 1000:.0f}",
                f"{r['copy'] * 1000:.0f}",
                f"{r['cat'] * 1000:.0f}",
                gbps(b, r["ours"]),
                gbps(b, r["raw"]),
                gbps(b, r["copy"]),
                f"{r['raw'] / r['ours']:.2f}",
                f"{r['copy'] / r['ours']:.2f}",
            ]
        )
        print(f"{size}: done", file=sys.stderr, flush=True)
    vllm_rows = []
    if not args.no_vllm:
        with tempfile.TemporaryDirectory(prefix="rollflow-bench-sync-") as tmp:
            for (name, model_dir), servers in (
                (m, s) for m in tiny_model_dirs(Path(tmp)) for s in args.servers
            ):
                v = vllm_pause(model_dir, args.vllm_syncs, Path(tmp), servers)
                vllm_rows.append(
                    [
                        name,
                        servers,
                        f"{v['params'] / 1e6:.2f}M",
                        f"{v['bytes'] / 1e6:.1f}",
                        f"{v['startup_s']:.0f}",
                        v["syncs"],
                        f"{v['pause_call_median_s'] * 1000:.0f}",
                        f"{v['broadcast_median_s'] * 1000:.0f}",
                        f"{v['paused_median_s'] * 1000:.0f}",
                        f"{v['paused_max_s'] * 1000:.0f}",
                        f"{v['transport_s'] * 1000:.1f}",
                        f"{v['paused_median_s'] / v['transport_s']:.1f}×",
                    ]
                )
                print(f"vLLM {name}: done", file=sys.stderr, flush=True)

    bucket_rows = []
    if args.buckets_mb:
        flat, named = flat_named_tensors(llama_shapes(*SHAPES["100M"]))
        results = [
            (mb, measure_transport(named, flat, args.repeats, int(mb * (1 << 20))))
            for mb in args.buckets_mb
        ]
        base = results[0][1]["ours"]
        for mb, r in results:
            bucket_rows.append(
                [
                    f"{mb:g}",
                    f"{r['ours'] * 1000:.0f}",
                    gbps(r["bytes"], r["ours"]),
                    f"{r['sender_peak'] / 1e6:.0f}",
                    f"{r['receiver_peak'] / 1e6:.0f}",
                    f"{r['receiver_peak'] / r['bytes']:.0%}",
                    f"{base / r['ours']:.2f}",
                ]
            )
        del flat, named
        print("buckets: done", file=sys.stderr, flush=True)
    print(
        f"\nweight sync, float32, sender and receiver on this machine (gloo over loopback), "
        f"median of {args.repeats}"
    )
    print(machine.line() + "\n")
    print(
        table(
            [
                "params",
                "MB",
                "ours ms",
                "raw gloo ms",
                "in-process copy ms",
                "sender packing ms",
                "ours GB/s",
                "raw gloo GB/s",
                "copy GB/s",
                "ours vs raw gloo (speed)",
                "ours vs copy (speed)",
            ],
            rows,
        )
    )
    if vllm_rows:
        print(
            f"\ngeneration paused by a real sync into vLLM (CPU), under 32 requests in flight; "
            f"medians of {args.vllm_syncs} syncs\n"
        )
        print(
            table(
                [
                    "model",
                    "servers",
                    "params",
                    "MB",
                    "vLLM start s",
                    "syncs",
                    "pause call ms",
                    "broadcast + reload ms",
                    "paused ms (median)",
                    "paused ms (max)",
                    "transport alone ms (baseline)",
                    "paused vs transport",
                ],
                vllm_rows,
            )
        )
    if bucket_rows:
        print(
            f"\nbucketed transfer of the ~100M model (float32, gloo over loopback), median of "
            f"{args.repeats}: extra memory is the bucket each side holds beyond the weights "
            f"(before buckets, one whole extra copy on each side); with several buckets the receiver also "
            f"copies each tensor until vLLM loads it (its layer-wise reload: one layer at a time)\n"
        )
        print(
            table(
                [
                    "bucket MiB",
                    "sync ms",
                    "GB/s",
                    "sender extra MB",
                    "receiver extra MB",
                    "receiver extra / model",
                    f"speed vs {args.buckets_mb[0]:g} MiB",
                ],
                bucket_rows,
            )
        )


if __name__ == "__main__":
    main()
