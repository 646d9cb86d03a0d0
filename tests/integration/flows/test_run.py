"""End to end: the real CLI, real vLLM, the trainer service, Prefect flows, Parquet on storage."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deployed_run import processes_marked
from run_support import ROOT, assert_every_step_once, env_for, run_cli, write_config

pytestmark = pytest.mark.slow


def test_async_steps_overlap_within_the_bound_and_end_on_the_trainers_event(tmp_path, model_cache):
    """max_staleness = 2, syncing every 2 steps: generation runs ahead, every step still lands
    once, versions are recorded, and the trainer's end of training stops the work in flight.
    Dynamic sampling is on, as by default: groups without signal were sampled anew, and every
    step still took its 8 groups within the bound."""
    import duckdb

    config = write_config(tmp_path, model_cache, name="async1", steps=4)
    out = run_cli(
        config, tmp_path, "train.max_staleness=2", "train.sync_every=2", "run.eval_every=0"
    )
    exited = time.time()
    assert "step 4/4" in out
    run_dir = tmp_path / "runs" / "async1"
    assert_every_step_once(run_dir, 4)
    versions = duckdb.sql(
        f"select step, min(version_started), max(version_started), max(version_finished) "
        f"from '{run_dir}/rollouts/*/*.parquet' group by step order by step"
    ).fetchall()
    for step, v_min, v_max, v_fin in versions:
        assert step - 3 <= v_min <= v_max <= step - 1  # within the bound, never from the future
        assert v_fin <= step - 1
    assert any(
        v_max < step - 1 for step, _, v_max, _ in versions[1:]
    )  # some step trained off-policy
    metrics = duckdb.sql(
        f"select staleness_max, loop_lag_p99_s, trainer_wait_for_data_s, resampled from "
        f"read_parquet('{run_dir}/metrics/*.parquet', union_by_name=true) where step > 0"
    ).fetchall()
    assert all(None not in m for m in metrics)
    assert sum(m[-1] for m in metrics) > 0, metrics  # the tiny policy's groups often agree
    # The end came from the trainer, with generation still under way (S = 2 runs ahead),
    # and the teardown (producer, weight group, both services) took well under its 30 s deadline.
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["version"] for e in events if e["event"] == "weights_published"] == [2, 4]
    end = events[-1]
    assert end["event"] == "training_finished" and end["source"] == "trainer" and end["step"] == 4
    assert end["groups_in_flight"] + end["groups_ready"] > 0
    assert exited - end["time"] < 30
    assert not processes_marked(str(tmp_path)), "service processes outlived the run"


def test_background_sync_releases_the_trainer_and_keeps_syncs_in_order(tmp_path, model_cache):
    """trainer.background_sync with no checkpoint or evaluation in steps 1-3: each step's weights
    are captured and the next step trains while they are broadcast; syncs still land in step
    order and every rollout respects max_staleness = 1.

    The run computes and serves in bf16, as on GPUs (trainer.mixed_precision, inference.dtype):
    every sync carries exactly the model's bytes in bf16, and vLLM's log-probs stay within bf16
    rounding (plus one step of lag) of the trainer's (issue 26: the bf16 simulation)."""
    import duckdb
    from transformers import AutoModelForCausalLM

    config = write_config(tmp_path, model_cache, name="bgsync", steps=4)
    out = run_cli(
        config,
        tmp_path,
        "train.max_staleness=1",
        "run.eval_every=0",
        "run.checkpoint_every=4",
        "trainer.mixed_precision=bf16",
        "inference.dtype=bfloat16",
        # Every group trains, so that every step measures the mismatch KL.
        "train.filter_zero_advantage=false",
    )
    assert "step 4/4" in out
    run_dir = tmp_path / "runs" / "bgsync"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["version"] for e in events if e["event"] == "weights_published"] == [1, 2, 3, 4]
    metrics = duckdb.sql(
        f"select step, capture_s from read_parquet('{run_dir}/metrics/*.parquet', "
        f"union_by_name=true) where step > 0 order by step"
    ).fetchall()
    assert [s for s, c in metrics if c is not None] == [1, 2, 3]  # step 4 checkpoints: it holds
    versions = duckdb.sql(
        f"select step, min(version_started), max(version_finished) "
        f"from '{run_dir}/rollouts/*/*.parquet' group by step order by step"
    ).fetchall()
    assert [v[0] for v in versions] == [1, 2, 3, 4]
    for step, v_min, v_fin in versions:
        assert step - 2 <= v_min and v_fin <= step - 1
    assert (run_dir / "checkpoints" / "step=4" / "_SUCCESS").exists()
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step=4")
    state = model.state_dict()
    bf16_bytes = sum(t.numel() * 2 for t in state.values())
    synced = duckdb.sql(
        f"select step, sync_bytes, mismatch_kl from read_parquet('{run_dir}/metrics/*.parquet', "
        f"union_by_name=true) where step > 0 order by step"
    ).fetchall()
    # The model in bf16, plus the wire's 16-byte header and its 64-byte alignment of each tensor
    # (fp32 would be twice bf16_bytes).
    most = bf16_bytes + 16 + 63 * len(state)
    assert len(synced) == 4 and all(bf16_bytes < b <= most for _, b, _ in synced), synced
    assert all(0 < kl < 1e-2 for _, _, kl in synced), synced


def test_a_fractional_staleness_sends_weights_mid_step_and_samples_the_next_step_from_them(
    tmp_path, model_cache
):
    """max_staleness = 0.5 with 2 optimizer steps per step: each step's weights go to vLLM after
    its first optimizer step, as version N - 0.5, and step N + 1's groups start from exactly
    those; the last step evaluates, so it syncs its whole weights at its end."""
    import duckdb

    config = write_config(tmp_path, model_cache, name="midstep", steps=4)
    out = run_cli(
        config,
        tmp_path,
        "train.max_staleness=0.5",
        "train.filter_zero_advantage=false",  # every step has its 2 optimizer steps
        "run.eval_every=0",
    )
    assert "step 4/4" in out
    run_dir = tmp_path / "runs" / "midstep"
    assert_every_step_once(run_dir, 4)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["version"] for e in events if e["event"] == "weights_published"] == [1, 2, 3, 4]
    metrics = duckdb.sql(
        f"select step, synced_version, num_optim_steps, capture_s, staleness_max "
        f"from read_parquet('{run_dir}/metrics/*.parquet', union_by_name=true) "
        f"where step > 0 order by step"
    ).fetchall()
    assert [(s, v) for s, v, *_ in metrics] == [(1, 0.5), (2, 1.5), (3, 2.5), (4, None)]
    assert all(n == 2 and (c is not None) == (s < 4) for s, _, n, c, _ in metrics)
    versions = duckdb.sql(
        f"select step, min(version_started), max(version_started) "
        f"from '{run_dir}/rollouts/*/*.parquet' group by step order by step"
    ).fetchall()
    assert versions == [(1, 0.0, 0.0), (2, 0.5, 0.5), (3, 1.5, 1.5), (4, 2.5, 2.5)]
    assert [m[-1] for m in metrics] == [0.0, 0.5, 0.5, 0.5]  # staleness in steps: 1 of 2 optim


def test_a_lora_run_on_s3_checkpoints_resumes_and_exports_its_adapter(
    tmp_path, model_cache, s3_endpoint
):
    """[train.lora] through the whole run with train.lora.sync = "adapter" (vLLM serves the base
    model and the adapter; the merged sync's run is in test_lora_sync.py, service level, to keep
    the suite short), on S3 (moto's server), one step, then a resume that reads the checkpoint back
    from S3 and whose vLLM starts from its adapter: the whole layout is on S3 (rollouts, batches,
    checkpoints with the trainer's sharded state), every checkpoint holds the adapter beside the
    merged model (peft's merge of the one is the other), and `rollflow export` writes the adapter
    in peft's format (the merged model with --merged)."""
    peft = pytest.importorskip("peft")
    import shutil
    import uuid

    import duckdb
    import fsspec
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    name = f"lora-{uuid.uuid4().hex[:8]}"  # its logs are local, under ~/.cache/rollflow/logs
    storage = f"s3://rollflow/{tmp_path.name}"
    options = f'run.storage_options={{endpoint_url="{s3_endpoint}"}}'
    config = write_config(tmp_path, model_cache, name=name, steps=1, storage=storage)
    # The tiny policy's rewards may all be zero in two steps; zero-advantage groups are kept and an
    # entropy bonus gives them a gradient, so every step trains the adapter whatever the rewards.
    lora = ["train.lora.rank=4", "train.lora.sync=adapter", "train.lr=1e-3", "run.eval_every=0"]
    train = ["train.filter_zero_advantage=false", "train.loss.entropy_coef=0.01"]
    logs = Path("~/.cache/rollflow/logs").expanduser() / name
    try:
        run_cli(config, tmp_path, options, *lora, *train)
        # The resume's vLLM starts from the base model and the checkpoint's adapter, read from S3.
        out = run_cli(config, tmp_path, options, *lora, *train, "run.num_steps=2")
        assert "resuming after committed step 1" in out and "step 2/2" in out
        # vllm.log holds both launches; each logs the adapter it serves as the policy.
        vllm_log = (logs / "vllm.log").read_text()
        served = [line for line in vllm_log.splitlines() if "lora_modules" in line]
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        for copy in Path("~/.cache/rollflow/checkpoints").expanduser().glob(f"{name}-*"):
            shutil.rmtree(copy, ignore_errors=True)
    # (the log's head on failure: a worker whose environment had VLLM_LOGGING_LEVEL=ERROR, as
    # importing TRL once left it, started servers that logged no such line)
    assert len(served) == 2 and "adapter-v0" in served[0], (served, vllm_log[:3000])
    assert f"{name}-checkpoints-step=1-" in served[1] and "/adapter" in served[1], served
    fs = fsspec.filesystem("s3", endpoint_url=s3_endpoint)
    root = f"rollflow/{tmp_path.name}/{name}"
    for kind in ("rollouts", "batches", "checkpoints"):
        assert sorted(p.rsplit("/", 2)[-2] for p in fs.glob(f"{root}/{kind}/step=*/_SUCCESS")) == [
            "step=1",
            "step=2",
        ]
    # The trainer's sharded state went up with the model (FSDP2: DCP shards and their metadata).
    assert fs.exists(f"{root}/checkpoints/step=2/trainer/state.json")
    assert fs.glob(f"{root}/checkpoints/step=2/trainer/dcp/*.distcp")
    # The rest is read from a local copy of the run.
    fs.get(f"{root}/", str(tmp_path / "runs" / name), recursive=True)
    run_dir = tmp_path / "runs" / name
    assert_every_step_once(run_dir, 2)
    optim_steps = duckdb.sql(
        f"select step, num_optim_steps from read_parquet('{run_dir}/metrics/step=[12].parquet', "
        "union_by_name=true) order by step"
    ).fetchall()
    assert optim_steps == [(1, 2), (2, 2)]  # train_batch_size 8 / mini_batch_size 4
    for step in (1, 2):
        adapter = run_dir / "checkpoints" / f"step={step}" / "adapter"
        assert (adapter / "adapter_model.safetensors").exists()
        assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    checkpoint = run_dir / "checkpoints" / "step=2"
    base_path = json.loads((checkpoint / "adapter/adapter_config.json").read_text())[
        "base_model_name_or_path"
    ]
    base = AutoModelForCausalLM.from_pretrained(base_path)
    by_peft = peft.PeftModel.from_pretrained(base, checkpoint / "adapter").merge_and_unload()
    merged = load_file(checkpoint / "model.safetensors")
    assert merged.keys() <= by_peft.state_dict().keys()
    assert max((merged[k] - by_peft.state_dict()[k]).abs().max().item() for k in merged) < 1e-6
    assert any(  # the adapter moved: the merged model is not the base
        not torch.equal(merged[k], v)
        for k, v in load_file(f"{base_path}/model.safetensors").items()
    )
    storage = ["--storage", str(tmp_path / "runs")]
    for extra, wanted in (([], "adapter_config.json"), (["--merged"], "model.safetensors")):
        folder = tmp_path / f"export{len(extra)}"
        done = subprocess.run(
            [sys.executable, "-m", "rollflow.cli", "export", name, "--step", "2"]
            + ["--out", str(folder), *storage, *extra],
            capture_output=True,
            text=True,
            timeout=60,
            env=env_for(tmp_path, api=False),
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr
        assert (folder / wanted).exists()
