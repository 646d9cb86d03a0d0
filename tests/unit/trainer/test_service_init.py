"""The trainer's default process group binds gloo to the interface that reaches MASTER_ADDR
(issue 26, item 12): on two nodes the hostname's 127.0.1.1 is unreachable from the other."""

from __future__ import annotations

import os

from rollflow.trainer import rank_main as service
from rollflow.trainer.protocol import ServiceArgs


def test_the_default_group_binds_gloo_toward_the_master_first(monkeypatch):
    calls = []
    monkeypatch.setattr(
        service.network,
        "bind_gloo_interface",
        lambda *a: calls.append(("bind", os.environ.get("MASTER_ADDR"))) or "eth9",
    )
    monkeypatch.setattr(
        service.dist, "init_process_group", lambda **kw: calls.append(("init", kw["backend"]))
    )
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.7")
    args = ServiceArgs(model_path="/m", storage_root="/s", run="r")
    args.trainer.device = "cpu"
    assert service._init_distributed(args).type == "cpu"
    assert calls == [("bind", "192.0.2.7"), ("init", "gloo")]
