"""A train task that fails before keeping the mid-step weights fails the step at once, with its error."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from prefect import flow, task
from prefect.settings import PREFECT_API_URL, temporary_settings

from rollflow.flows import train_step as step_module
from rollflow.infra.config import load_config

from run_support import session_prefect_api


def test_a_train_task_that_fails_before_the_mid_step_capture_fails_the_step_with_its_error(
    monkeypatch,
):
    @task(name="train")
    def dead_trainer(ctx, step, group_indices, sample_keys=(), capture=None, num_loss_tokens=0):
        time.sleep(0.2)
        raise ConnectionError("trainer at 127.0.0.1:1 is gone")

    def must_not_sync(*_):
        raise AssertionError("no sync without captured weights")

    monkeypatch.setattr(step_module, "train", dead_trainer)
    monkeypatch.setattr(step_module, "sync", must_not_sync)
    cfg = load_config(
        "configs/quickstart.toml",
        ["train.train_batch_size=128", "train.mini_batch_size=32", "train.max_staleness=0.25"],
    )
    ctx = SimpleNamespace(config=cfg)
    batch = SimpleNamespace(group_indices=[0, 1], sample_keys=[], num_loss_tokens=0)

    @flow(persist_result=False)
    def one_step():
        return step_module.train_syncing_mid_step(ctx, 3, batch, 1, order=None, host=None)

    # On the session's Prefect API (else Prefect starts an ephemeral one for this process).
    with temporary_settings(updates={PREFECT_API_URL: session_prefect_api()}):
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="is gone"):
            one_step()
        assert time.monotonic() - start < 30
