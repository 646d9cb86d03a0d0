"""The trainer's replies are held to the contract: every route declares a reply model, and what
rank 0's API answers fits it (a reply that drifts is a 500 naming the field, on rank 0).

One rank in this process (a 1-rank gloo group, FSDP2, the tiny model) runs the real rank code of
every command; only the command loop (run at once, in the HTTP thread) and the weight group's
wire are stand-ins. ``TrainerClient`` calls rank 0's app in process and parses every reply.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import get_args, get_origin
from unittest import mock

import pytest
import torch
from fastapi.testclient import TestClient

from rollflow.infra.config import LossConfig, TrainSection
from rollflow.infra.errors import ServiceError
from rollflow.infra.http import Endpoint
from rollflow.infra.storage import RunStorage
from rollflow.tasks.train import client as client_module
from rollflow.tasks.train.client import TrainerClient
from rollflow.trainer import checkpoints, weight_plane
from rollflow.trainer import protocol as p
from rollflow.trainer.api import TrainerAPI, build_app
from rollflow.trainer.control import ControlGroup, rank_identity
from rollflow.trainer.dispatch import Pending
from rollflow.trainer.ops import RankOps
from rollflow.trainer.rank_trainer import Trainer, TrainerSpec

from trainer_support import make_rows, one_process_group, write_batch

TOKEN = "run-token"


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    yield from one_process_group(tmp_path_factory)


def test_every_route_declares_a_reply_model_of_a_fixed_shape():
    for route in p.ROUTES:
        model = get_args(route.reply)[0] if get_origin(route.reply) is list else route.reply
        assert issubclass(model, p._Reply), f"{route.path}: its reply is {route.reply!r}"
        assert model.model_config["extra"] == "forbid", route.path


class RunsAtOnce:
    """Rank 0's dispatcher with the command loop folded in: a queued command runs at once on this
    rank, the only one (``rank_main.serve`` answers ``/shutdown`` itself, as here)."""

    watch = SimpleNamespace(failure=None)

    def __init__(self, ops: RankOps | None):
        self.ops = ops

    def enqueue(self, cmd: dict) -> Pending:
        pending = Pending(cmd)
        if cmd["op"] == p.SHUTDOWN.op:
            pending.resolve({"ok": True})
        else:
            pending.resolve(self.ops.run(cmd["op"], cmd["args"]))
        return pending

    def wait(self, pending: Pending, timeout_s: float):
        if pending.error is not None:
            raise pending.error
        return pending.result


class Wire:
    """The weight group's sender, minus the group: says what it would send."""

    def __init__(self, *args, **kwargs):
        pass

    def connect(self) -> None:
        pass

    def broadcast(self, named, version) -> int:
        return sum(t.numel() * t.element_size() for _, t in named)

    def close(self) -> None:
        pass


def in_process(monkeypatch, api: TrainerAPI) -> tuple[TrainerClient, list[str]]:
    """A client of ``api``'s app, called in process; and the paths it called."""
    http, called = TestClient(build_app(TOKEN, api)), []

    def call(ep, path, payload=None, *, timeout_s, method="POST"):
        called.append(path.split("?")[0])
        answer = http.request(method, path, json=payload, headers=ep.headers())
        if answer.status_code >= 400:
            raise ServiceError(f"HTTP {answer.status_code}: {answer.text}", answer.status_code)
        return answer.json()

    monkeypatch.setattr(client_module, "call", call)
    return TrainerClient(Endpoint("trainer", "http://trainer", TOKEN), timeout_s=60), called


def test_every_route_answers_its_reply_model(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(p.TOKEN_ENV, TOKEN)
    monkeypatch.setattr(weight_plane, "WeightSender", Wire)
    monkeypatch.setattr(checkpoints, "LOCAL_CHECKPOINTS", tmp_path / "local")
    storage = RunStorage(str(tmp_path / "storage"), "t")
    write_batch(storage, 1, make_rows(8))
    with mock.patch.dict("os.environ"):  # ControlGroup names a gloo interface in the env
        control = ControlGroup(timeout_s=60)
    spec = TrainerSpec(str(tiny_model_dir), train=TrainSection(lr=1e-3))
    trainer = Trainer(spec, torch.device("cpu"))
    ops = RankOps(trainer, control, storage, micro_batch_tokens=10_000, row_tokens=None)
    api = TrainerAPI(
        ops, trainer, RunsAtOnce(ops), [rank_identity()], backend="fsdp2", timeout_s=60, num_steps=1
    )
    client, called = in_process(monkeypatch, api)

    health = client.health()
    assert health.ok and health.weights_version == 0 and health.ranks[0].pid == os.getpid()
    assert client.weights_port() > 0
    metadata = client.metadata()
    assert metadata and all(m.shape for m in metadata)
    assert client.forward(1).num_sequences == 8
    fb = client.forward_backward(1, loss=LossConfig(), old_logprobs="trainer")
    assert fb.num_loss_tokens > 0 and set(fb.per_env["entropy"]) == {"all", "sort", "add"}
    assert client.gradients(str(tmp_path / "grads.safetensors")).num_tensors > 0
    assert client.optim_step().optim_step == 1
    assert client.end_step(1).finished
    finished = client.training_finished()
    assert finished.finished and finished.step == 1 and finished.optim_step == 1
    assert client.weights_connect("127.0.0.1", 1, 2, 5.0, "cpu", 1 << 20).ok
    captured = client.weights_capture()
    assert captured.version == 1 and captured.bytes > 0
    from_capture = client.weights_broadcast(1)
    assert from_capture.captured and from_capture.bytes == captured.bytes
    at_once = client.weights_broadcast()
    assert at_once.version == 1 and not at_once.captured
    assert client.save_checkpoint(1).uri.endswith("checkpoints/step=1")
    assert client.load_checkpoint(1).optim_step == 1
    assert client.export_hf(str(tmp_path / "hf")).uri.endswith("hf")
    assert client.weights_close().ok and client.shutdown().ok
    assert sorted(set(called)) == sorted(r.path for r in p.ROUTES)


def test_a_reply_that_drifts_fails_on_rank_0_naming_the_field(monkeypatch):
    """A rank that no longer says its pid: /health answers 500 naming ``ranks.0.pid``, rather
    than a caller meeting a missing key later."""
    api = TrainerAPI(
        SimpleNamespace(),
        SimpleNamespace(step=0),
        RunsAtOnce(None),
        [{"rank": 0, "host": "h"}],
        backend="fsdp2",
        timeout_s=5,
    )
    client, _ = in_process(monkeypatch, api)
    with pytest.raises(ServiceError, match=r"HTTP 500.*/health.*ranks\.0\.pid: Field required"):
        client.health()

    def drifted(req: p.StepRef) -> dict:
        return {"finished": False, "step": req.step}

    monkeypatch.setattr(api, "end_step", drifted)
    client, _ = in_process(monkeypatch, api)  # the app takes the handlers as it is built
    with pytest.raises(ServiceError, match=r"HTTP 500.*/end_step.*step: Extra inputs"):
        client.end_step(1)


def test_the_wire_carries_the_keys_the_handler_gave(monkeypatch):
    """Held to its model, a reply keeps its JSON: no default field is added on the way out."""
    api = TrainerAPI(
        SimpleNamespace(),
        SimpleNamespace(step=0),
        RunsAtOnce(None),
        [],
        backend="fsdp2",
        timeout_s=5,
    )
    http = TestClient(build_app(TOKEN, api))
    answer = http.get(p.TRAINING_FINISHED.path, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.json() == {"finished": False}
    assert p.WEIGHTS_BROADCAST.reply_json({"version": 1, "bytes": 2, "broadcast_s": 0.5}) == {
        "version": 1,
        "bytes": 2,
        "broadcast_s": 0.5,
    }
