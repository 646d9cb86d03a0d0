"""The trainer service on 2 gloo ranks through the real launchers, against one process on the batch.

One service per backend configuration for the whole module (launches are the slow part):
torchrun + FSDP2, and the deepspeed launcher with ZeRO-1, -2 and -3. Every configuration runs
the exactness test; FSDP2 and ZeRO-3 (one per launcher) run the whole suite, which ends by
killing a rank. Batches have widely varying lengths and a small micro-batch budget, so ranks
hold different token counts and several micro-batches, some of them empty. fsdp2-2nodes and
zero2-2nodes run their two nodes on separate hosts (tests/host_support.py: network and mount
namespaces, storage on S3, the only thing the hosts share), node 1 started as its flow run
starts it: its command made on its host from the trainer's arguments alone, on the first GPU
of that host's own CUDA_VISIBLE_DEVICES; fsdp2-2nodes also round-trips a checkpoint across them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from rollflow.infra.config import LossConfig, TrainerServiceSection, TrainSection
from rollflow.infra.errors import ServiceError
from rollflow.infra.http import Endpoint
from rollflow.infra.processes import ManagedProcess, free_port
from rollflow.infra.storage import RunStorage
from rollflow.infra.weights.group import WeightReceiverGroup
from rollflow.services.trainer_process import TrainerProcess
from rollflow.tasks.train.client import TrainerClient
from rollflow.trainer.deepspeed_op import OP, built_op_path
from rollflow.trainer.protocol import HEALTH, ServiceArgs, TensorMeta

from host_support import object_storage, two_hosts
from trainer_support import (
    adamw_step,
    load,
    make_rows,
    max_abs,
    max_abs_diff,
    reference,
    write_batch,
)

pytestmark = pytest.mark.slow

CONFIGS = {  # name: (backend, ZeRO stage, trainer nodes; 2 ranks in all)
    "fsdp2": ("fsdp2", None, 1),
    "fsdp2-2nodes": ("fsdp2", None, 2),  # two torchrun launchers on two hosts, one rank each
    "zero1": ("deepspeed", 1, 1),
    # DeepSpeed's per-node launchers on two hosts (before: ZeRO-2 on one; ZeRO-1 and -3 start
    # the same launcher on one node, as DeepSpeed's runner would)
    "zero2-2nodes": ("deepspeed", 2, 2),
    "zero3": ("deepspeed", 3, 1),
}
HOST_1_GPUS = "5,6"  # host 1's own CUDA_VISIBLE_DEVICES (a worker's GPUs); host 0 sets none
WHOLE_SUITE = ("fsdp2", "zero3")
LR, MAX_GRAD_NORM = 1e-2, 0.05
PPO = LossConfig(eps_low=0.1, eps_high=0.2, entropy_coef=0.01)


class Service:
    def __init__(self, name, proc: TrainerProcess, storage: RunStorage, root):
        self.name, self.proc, self.storage, self.root = name, proc, storage, root
        self.ep, self.client = proc.endpoint, proc.client

    def export(self, name: str):
        path = self.root / name
        self.client.export_hf(str(path))
        return path

    def gradients(self, name: str) -> dict[str, torch.Tensor]:
        path = self.root / f"{name}.safetensors"
        self.client.gradients(str(path))
        return load_file(path)


@pytest.fixture(scope="module", params=list(CONFIGS))
def service(request, tiny_model_dir, tmp_path_factory):
    backend, stage, nodes = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    with contextlib.ExitStack() as hosts_and_storage:
        if nodes == 1:
            hosts, storage_root, options, master_addr = [], str(root / "runs"), {}, "127.0.0.1"
        else:  # node 1 on a host of its own; storage is the only thing the hosts share
            hosts = hosts_and_storage.enter_context(two_hosts(visible=(None, HOST_1_GPUS)))
            endpoint = hosts_and_storage.enter_context(object_storage(hosts[0]))
            storage_root = f"s3://rollflow/{request.param}"
            options = {"endpoint_url": endpoint, "skip_instance_cache": True}
            master_addr = hosts[0].address
        yield from _service(
            request.param, root, tiny_model_dir, hosts, storage_root, options, master_addr
        )


def _service(name, root, model_dir, hosts, storage_root, options, master_addr):
    backend, stage, nodes = CONFIGS[name]
    storage = RunStorage(storage_root, "t", options)
    write_batch(storage, 1, make_rows(22, seed=11))
    write_batch(storage, 2, make_rows(9, seed=12, step=2))
    write_batch(storage, 3, make_rows(14, seed=13, step=3, masked=True))
    args = ServiceArgs(
        model_path=str(model_dir),
        storage_root=storage_root,
        storage_options=options,
        run="t",
        train=TrainSection(lr=LR, max_grad_norm=MAX_GRAD_NORM),
        trainer=TrainerServiceSection(
            backend=backend,
            num_ranks=2 // nodes,
            num_nodes=nodes,
            master_addr=master_addr,
            master_port=free_port(),
            zero_stage=stage,
            # ZeRO-3 gathers each layer's shards in the recomputation too: the exactness test
            # holds activation checkpointing to the one-process reference there.
            activation_checkpointing=stage == 3,
            micro_batch_tokens=48,
            device="cpu",
            request_timeout_s=120,
            startup_timeout_s=600,
        ),
        dead_rank_grace_s=3,
    )
    token = secrets.token_hex(8)
    proc = TrainerProcess(args, token=token, log_dir=root / "logs")
    extensions = proc.process.env["TORCH_EXTENSIONS_DIR"]  # (DeepSpeed's op, built once)
    # The other node on its own host, with its own copy of the model (tests/host_support.py).
    others = []
    for n, host in enumerate(hosts[1:], start=1):
        own_model = shutil.copytree(model_dir, host.root / "model")
        own = args.model_copy(update={"model_path": str(own_model)})
        others.append(_node_on_its_host(host, n, own, root / f"trainer-node-{n}.log", extensions))
    if hosts:
        proc.process.argv = hosts[0].wrap(proc.process.argv)
    # DeepSpeed's CPU all-reduce op, if a start before this one (of any checkout) built it: the
    # ranks load it as built, and no start after the first on a machine compiles it (~55 s).
    built = backend == "deepspeed" and built_op_path(extensions).is_file()
    start = time.monotonic()
    try:
        proc.start()
        for other in others:
            other.start()
        proc.wait_healthy()
        print(f"\n{name}: 2 ranks healthy after {time.monotonic() - start:.0f}s")
        if built:
            loaded = f"DeepSpeed's {OP} op loaded as built before: {built_op_path(extensions)}"
            assert loaded in (root / "logs" / "trainer.log").read_text(), loaded
        # DeepSpeed's CPU all-reduce workspaces (66 MB of RAM each, in /dev/shm) lose their names
        # once every rank has mapped them: none outlives the ranks, killed or not.
        ports = {psutil.Process(p).environ().get("MASTER_PORT") for p in proc.process.pids()}
        shm = Path("/dev/shm")
        left = [
            p.name for port in ports for p in shm.glob(f"deepspeed_allreduce_buffer_*_{port}_*")
        ]
        assert ports - {None} and not left, (ports, left)
        # Node 1's rank on its own host's first GPU (named to DeepSpeed's launcher, which sets
        # its ranks' variable), resolved there: the test's host sets none.
        for other in others:
            ranks = [p.environ() for p in other.members() if "RANK" in p.environ()]
            assert [r.get("CUDA_VISIBLE_DEVICES") for r in ranks] == ["5"], ranks
        yield Service(name, proc, storage, root)
    finally:
        pids = proc.process.pids() + [p for o in others for p in o.pids()]
        proc.stop(timeout_s=30)
        for other in others:
            other.stop(timeout_s=30)
    assert not [
        p
        for p in pids
        if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
    ]


# What a placed node's flow run does on its host (flows/trainer_node.py), without Prefect.
NODE_ON_ITS_HOST = """
import os, sys
from rollflow.services.trainer_process import node_command
argv, env = node_command(sys.argv[1], int(sys.argv[2]), [0])
os.execve(argv[0], argv, {**os.environ, **env})
"""


def _node_on_its_host(
    host, node: int, args: ServiceArgs, log_path: Path, extensions: str
) -> ManagedProcess:
    """Trainer node ``node`` started on ``host`` as its flow run starts it: its launcher command
    made there (``node_command``) from the trainer's arguments alone, on the first GPU of the
    host's own CUDA_VISIBLE_DEVICES (the ranks compute on CPU; the launchers pass the device
    on, which shows where it was resolved). Nothing of node 0's folder is there."""
    argv = host.wrap([sys.executable, "-c", NODE_ON_ITS_HOST, args.model_dump_json(), str(node)])
    # DeepSpeed's compiled op: node 0's build cache, the image's (else each host builds it)
    return ManagedProcess(
        f"trainer-node-{node}", argv, log_path, env={"TORCH_EXTENSIONS_DIR": extensions}
    )


def _whole_suite(service):
    if service.name not in WHOLE_SUITE:
        pytest.skip(
            "the whole suite runs on fsdp2 and zero3; this configuration runs the exactness test"
        )


def test_two_ranks_match_one_process_on_the_whole_batch(service):
    rows = service.storage.read_step_table("batches", 1).to_pylist()
    before = service.export("before-ppo")
    fb = service.client.forward_backward(1, loss=PPO)
    grads = service.gradients("ppo")
    ref = reference(before, rows, PPO)
    assert fb.loss == pytest.approx(ref["loss"], abs=1e-6)
    assert max_abs_diff(grads, ref["grads"]) < 1e-6 * max_abs(ref["grads"])
    step = service.client.optim_step()
    assert step.grad_norm == pytest.approx(adamw_step(ref["model"], LR, MAX_GRAD_NORM), rel=1e-5)
    after = dict(load(service.export("after-ppo")).named_parameters())
    expected = dict(ref["model"].named_parameters())
    # Adam's first update is lr * g / (|g| + eps): fp32 rounding moves near-zero entries by ~1e-3 lr.
    assert (
        max_abs_diff(
            {k: v.detach() for k, v in after.items()}, {k: v.detach() for k, v in expected.items()}
        )
        < 1e-3 * LR
    )
    # Metrics: every row counted once, per environment and overall.
    n_all, *_ = fb.per_env["clip_fraction"]["all"]
    assert n_all == len(rows)
    assert {e for e in fb.per_env["entropy"]} == {"all", "sort", "add"}
    assert 0 < fb.ess <= 1 and fb.num_loss_tokens == sum(len(r["completion_ids"]) for r in rows)


def test_environment_tokens_are_context_only_on_two_ranks(service):
    """Multi-turn rows: mask-0 tokens are in the forward pass (context) but in no loss, count or
    gradient; two ranks match one process computing the masked loss by hand."""
    rows = service.storage.read_step_table("batches", 3).to_pylist()
    assert sum(0 in (r["completion_mask"] or []) for r in rows) >= 3
    before = service.export("before-masked")
    fb = service.client.forward_backward(3, loss=PPO)
    ref = reference(before, rows, PPO)
    assert fb.loss == pytest.approx(ref["loss"], abs=1e-6)
    assert fb.num_loss_tokens == sum(
        sum(r["completion_mask"] or [1] * len(r["completion_ids"])) for r in rows
    )
    grads = service.gradients("masked")
    assert max_abs_diff(grads, ref["grads"]) < 1e-6 * max_abs(ref["grads"])
    service.client.optim_step()


def test_forward_then_gspo_with_truncated_importance_sampling(service):
    rows = service.storage.read_step_table("batches", 1).to_pylist()
    weights = service.export("before-gspo")
    out = service.client.forward(1)
    logprobs = service.storage.read_step_table("logprobs", 1).to_pylist()
    assert out.num_sequences == len(rows) == len(logprobs)
    old = {(r["group_index"], r["sample_index"]): r["logprobs"] for r in logprobs}
    gspo = LossConfig(kind="gspo", eps_low=3e-3, eps_high=4e-3, tis_cap=1.5)
    ref = reference(weights, rows, gspo, old=old)
    for r, expected in zip(rows, ref["logprobs"], strict=True):
        got = torch.tensor(old[(r["group_index"], r["sample_index"])])
        assert torch.allclose(got, expected, atol=1e-5)
    fb = service.client.forward_backward(1, loss=gspo, old_logprobs="trainer")
    assert fb.tis_weight < 1.5  # TIS is active: trainer and the batch's sampler log-probs differ
    grads = service.gradients("gspo")
    assert max_abs_diff(grads, ref["grads"]) < 1e-6 * max_abs(ref["grads"])
    service.client.optim_step()


def test_bad_requests_are_named_and_leave_the_service_usable(service):
    _whole_suite(service)
    # A loss the config would refuse: sent as the raw body a client of another version could send.
    bad_loss = PPO.model_construct(**{**PPO.model_dump(), "eps_low": 1.5})
    bad = [
        (dict(step=1, group_indices=[0, 99], loss=PPO), "groups [99]"),
        (dict(step=7, loss=PPO), "batches/step=7 is not committed"),
        (dict(step=2, loss=PPO, old_logprobs="trainer"), "call forward first"),
        (dict(step=1, loss=PPO.model_copy(update={"kl_coef": 0.1})), "reference model"),
        (dict(step=1, loss=bad_loss), "loss.eps_low"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ServiceError, match="HTTP 400") as err:
            service.client.forward_backward(**kwargs)
        assert message in str(err.value) and err.value.status == 400
    with pytest.raises(ServiceError, match="no gradients"):
        service.client.optim_step()
    with pytest.raises(ServiceError, match="HTTP 401"):
        TrainerClient(Endpoint("trainer", service.ep.url, "wrong"), timeout_s=10).optim_step()
    assert service.client.health().ok
    service.client.forward_backward(2, loss=PPO)
    assert service.client.optim_step().optim_step >= 1


def test_nothing_answers_without_the_run_token(service):
    """FastAPI's own pages (/docs, /redoc, /openapi.json) would list every route to anyone."""
    _whole_suite(service)
    for path in ("/docs", "/redoc", "/openapi.json", HEALTH.path):
        answer = httpx.get(f"{service.ep.url}{path}", timeout=10)
        assert answer.status_code in (401, 404), f"{path} answered {answer.status_code}"
        assert "openapi" not in answer.text


def test_checkpoint_round_trip_is_sharding_aware_and_exact(service):
    """Saved, then loaded back exactly; on two hosts (fsdp2-2nodes), every node's shards reach
    storage and every node reads them back from its own copy (issue 26, item 9)."""
    if service.name != "fsdp2-2nodes":
        _whole_suite(service)
    saved = service.client.save_checkpoint(5)
    folder = service.storage.local_copy("checkpoints", 5, service.root / "cache")
    assert saved.uri.endswith("checkpoints/step=5")
    assert [p.name for p in folder.glob("*.safetensors")] == [
        "model.safetensors"
    ]  # vLLM loads the top
    assert (folder / "trainer" / "state.json").exists()
    load(folder)  # transformers loads the HF export as it is

    def one_step(tag: str) -> dict:
        service.client.forward_backward(2, loss=PPO)
        service.client.optim_step()
        return {k: v.detach() for k, v in load(service.export(tag)).named_parameters()}

    first = one_step("after-save")
    assert service.client.load_checkpoint(5).optim_step == saved_step(folder)
    second = one_step("after-load")
    assert max_abs_diff(first, second) == 0.0


def saved_step(folder) -> int:
    import json

    return json.loads((folder / "trainer" / "state.json").read_text())["step"]


def test_exported_model_is_served_by_vllm(service):
    """The HF export loads in the real inference deployment and generates what transformers does."""
    if service.name != "fsdp2":
        pytest.skip("one vLLM start covers the export format, which every backend shares")
    from transformers import AutoModelForCausalLM

    from rollflow.infra.vllm_fleet.client import InferenceClient
    from rollflow.services.vllm_server import InferenceServer

    export = service.export("for-vllm")
    prompt = [1, 10, 11, 12, 13]
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    srv = InferenceServer(export, max_model_len=64, log_path=service.root / "vllm.log")
    srv.start()
    try:

        async def go():
            async with InferenceClient(srv.url, timeout_s=60) as client:
                return await client.complete(prompt, max_tokens=8, temperature=0.0)

        (completion,) = asyncio.run(go())
    finally:
        srv.stop()
    assert completion.token_ids == expected[: len(completion.token_ids)]


def test_weights_broadcast_gathers_the_shards(service):
    """The weight group's sender is rank 0; every rank helps gather the full weights it sends."""
    _whole_suite(service)
    metadata = _wire(service.client.metadata())
    receiver = _join_weight_group(service, timeout_s=30)
    got: dict = {}

    def receive():
        version, named = receiver.receive(metadata)
        got.update({name: t.clone() for name, t in named}, version=version)

    thread = threading.Thread(target=receive)
    thread.start()
    sent = service.client.weights_broadcast(7)
    thread.join(30)
    service.client.weights_close()
    receiver.close()
    assert got.pop("version") == 7 and sent.bytes > 0
    assert max_abs_diff(got, load_file(service.export("sent") / "model.safetensors")) == 0.0


def test_captured_weights_are_sent_while_the_ranks_train(service):
    """Background sync: the weights captured at a step's end are what the broadcast sends, even
    when the ranks train the next step during it (the capture is a copy, not the live weights)."""
    _whole_suite(service)
    receiver = _join_weight_group(service, timeout_s=60)
    before = load_file(service.export("capture-before") / "model.safetensors")
    captured = service.client.weights_capture(7)
    assert captured.version == 7 and captured.bytes > 0
    metadata = _wire(service.client.metadata())
    got: dict = {}

    def receive() -> None:
        version, named = receiver.receive(metadata)
        got.update({n: t.clone() for n, t in named}, version=version)

    receiving = threading.Thread(target=receive)
    receiving.start()
    sent = []
    sending = threading.Thread(target=lambda: sent.append(service.client.weights_broadcast(7)))
    sending.start()
    service.client.forward_backward(2, loss=PPO)  # the ranks train meanwhile
    service.client.optim_step()
    sending.join(60)
    receiving.join(60)
    service.client.weights_close()
    receiver.close()
    assert sent[0].captured and got.pop("version") == 7
    after = load_file(service.export("capture-after") / "model.safetensors")
    assert max_abs_diff(after, before) > 0, "the optimizer step changed nothing"
    assert max_abs_diff({k: got[k] for k in before}, before) == 0.0


def test_a_failed_weight_group_leaves_the_service_usable(service):
    """vLLM gone mid-sync, or never joining, is the weight plane's failure (502), not the ranks':
    the service answers, and a restarted server joins again and gets the last step's weights."""
    _whole_suite(service)
    with pytest.raises(ServiceError, match="HTTP 502") as err:  # nobody joins
        service.client.weights_connect("127.0.0.1", free_port(), 2, 2, "cpu", 1 << 20)
    assert err.value.status == 502 and service.client.health().ok

    _join_weight_group(service, timeout_s=5).close()  # the receiver dies before the broadcast
    with pytest.raises(ServiceError, match="HTTP 502"):
        service.client.weights_broadcast(1)
    with pytest.raises(ServiceError, match="HTTP 409"):  # the broken group was dropped
        service.client.weights_broadcast(1)
    assert service.client.health().ok

    receiver = _join_weight_group(service, timeout_s=30)
    service.client.end_step(3)  # the last finished step: the version-less tag
    metadata = _wire(service.client.metadata())
    got: dict = {}

    def receive() -> None:
        version, named = receiver.receive(metadata)
        got.update(version=version, tensors=len(list(named)))  # the buckets arrive as read

    thread = threading.Thread(target=receive)
    thread.start()
    sent = service.client.weights_broadcast()
    thread.join(30)
    service.client.weights_close()
    receiver.close()
    assert sent.version == got["version"] == 3
    assert service.client.health().weights_version == 3


def _wire(metadata: list[TensorMeta]) -> list[dict]:
    """The trainer's metadata reply as a receiver reads it (what ``weights.join`` gives vLLM)."""
    return [m.model_dump() for m in metadata]


def _join_weight_group(service, timeout_s: float) -> WeightReceiverGroup:
    """A weight group of the service (rank 0 sends) and one receiver, as a vLLM worker joins it,
    at the port the service picked on its host."""
    port = service.client.weights_port()
    receiver = WeightReceiverGroup(
        "127.0.0.1", port, 1, 2, timeout_s=timeout_s, bucket_bytes=1 << 20, secret=service.ep.token
    )
    joiner = threading.Thread(target=receiver.connect)
    joiner.start()
    service.client.weights_connect("127.0.0.1", port, 2, timeout_s, "cpu", 1 << 20)
    joiner.join(30)
    return receiver


def test_a_dead_rank_is_named_within_seconds(service):
    """Kill rank 1: health and the next call fail within seconds naming it; then the tree exits."""
    _whole_suite(service)
    ranks = service.client.health().ranks
    victim = next(r for r in ranks if r.rank == 1)
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    while True:
        resp = httpx.get(service.ep.url + HEALTH.path, headers=service.ep.headers(), timeout=5)
        if resp.status_code == 503:
            break
        assert time.monotonic() - killed < 5, "health still OK 5 s after a rank died"
        time.sleep(0.1)
    assert f"rank 1 (pid {victim.pid}) died" in resp.json()["detail"]
    with pytest.raises(ServiceError, match="rank 1") as err:
        service.client.forward_backward(2, loss=PPO)
    assert "HTTP 503" in str(err.value)
    with pytest.raises(ServiceError, match="rank 1"):
        service.proc.check_alive()
    service.proc.process.proc.wait(timeout=60)  # the launcher tears the rest down
    with pytest.raises(ServiceError, match="rank 1"):
        service.proc.check_alive()  # named by the log once nobody answers
