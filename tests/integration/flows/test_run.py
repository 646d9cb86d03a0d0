"""End to end: the real CLI, real vLLM, the trainer service, Prefect flows, Parquet on storage."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from deployed_run import processes_marked
from run_support import (
    PLANTED_KEY,
    PLANTED_SECRET,
    ROOT,
    RestartableApi,
    assert_every_step_once,
    env_for,
    run_cli,
    run_cli_watched,
    seeded_prefect_home,
    session_prefect_api,
    write_config,
)

pytestmark = pytest.mark.slow
API_DOWN_S = 8  # how long the Prefect API is away under a run (noticed at once, probed every 2 s)
STORAGE_PAUSE_S = 16  # how long the S3 server is frozen under a run (noticed after 10 s)


def assert_api_record_whole(api: RestartableApi, run: str, steps: int) -> None:
    """The run's flow run and its step flow runs, and every task run under them, are Completed
    in the API (task runs' states reach it as events, recorded within a second or two), and each
    step flow run has its metrics artifact."""
    deadline = time.monotonic() + 30
    while True:
        flows = api.post("/flow_runs/filter")
        tasks = api.post("/task_runs/filter")
        states = sorted((f["name"], f["state_type"]) for f in flows)
        unfinished = [(t["name"], t["state_type"]) for t in tasks if t["state_type"] != "COMPLETED"]
        if (
            all(state == "COMPLETED" for _, state in states) and not unfinished
        ) or time.monotonic() > deadline:
            break
        time.sleep(1)
    step_runs = {f["id"]: f["name"] for f in flows if f["name"].startswith(f"{run}-step-")}
    assert sorted(step_runs.values()) == [f"{run}-step-{s}" for s in range(1, steps + 1)], states
    assert all(state == "COMPLETED" for _, state in states), states
    assert tasks and not unfinished, unfinished
    artifacts = api.post("/artifacts/filter")
    with_metrics = {a["flow_run_id"] for a in artifacts if a.get("type") == "table"}
    assert set(step_runs) <= with_metrics, (step_runs, artifacts)


def assert_no_planted_secret(
    name: str, storage: str, s3_endpoint: str, terminal: str, run_log: Path
) -> None:
    """A run given S3 credentials in run.storage_options said it kept them out of what it
    stores, and they are in none of its flow runs' parameters, its config.json on the storage,
    its run.log or its terminal (the same run read and wrote S3 with them)."""
    import fsspec

    from deployed_run import prefect_api

    assert "note: run.storage_options key, secret kept out of the stored config" in terminal
    runs = prefect_api(
        session_prefect_api(), "/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}}
    )
    parameters = json.dumps([r["parameters"] for r in runs])
    assert runs and name in parameters and s3_endpoint in parameters, runs
    fs = fsspec.filesystem("s3", endpoint_url=s3_endpoint, skip_instance_cache=True)
    stored = fs.cat_file(f"{storage.removeprefix('s3://')}/{name}/config.json").decode()
    assert s3_endpoint in stored
    for text in (parameters, stored, terminal, run_log.read_text()):
        assert PLANTED_SECRET not in text and PLANTED_KEY not in text


def test_async_steps_overlap_within_the_bound_and_end_on_the_trainers_event(tmp_path, model_cache):
    """max_staleness = 2, syncing every 2 steps: generation runs ahead, every step still lands
    once, versions are recorded, and the trainer's end of training stops the work in flight.
    Dynamic sampling is on, as by default: groups without signal were sampled anew, and every
    step still took its 8 groups within the bound.

    Its Prefect API (rollflow's private API, run by the test) is stopped once step 1 is reported
    and started again on the same database API_DOWN_S later (issue 44): the run says so in one
    line, and that it is back in another; Prefect's own dumps of the events it could not send
    (``Event(...)``) stay off the terminal; every step still lands once, and the run's record in
    the API is whole afterwards (every flow run and task run Completed, each step's artifact)."""
    import duckdb

    api = RestartableApi(seeded_prefect_home(tmp_path / "api"))
    api.start()
    outage: dict[str, float] = {}

    def outage_after_step_1(line: str) -> None:
        if line.startswith("step 1/4") and not outage:
            outage["stopped"] = time.monotonic()

            def restart():
                api.stop()
                time.sleep(API_DOWN_S)
                api.start()
                outage["started"] = time.monotonic()

            threading.Thread(target=restart, daemon=True).start()
        if "answering again" in line:
            outage["said_back"] = time.monotonic()
            outage["back_at"] = time.time()
        if line.startswith("done:"):  # said once the services are stopped
            outage["done"] = time.time()

    config = write_config(tmp_path, model_cache, name="async1", steps=4)
    try:
        code, out, err = run_cli_watched(
            config,
            tmp_path,
            "train.max_staleness=2",
            "train.sync_every=2",
            "run.eval_every=0",
            on_line=outage_after_step_1,
            env={**env_for(tmp_path), "PREFECT_API_URL": api.url},
        )
        assert code == 0, out[-3000:] + err[-3000:]
        assert "step 4/4" in out
        lost = [line for line in out.splitlines() if "not answering since" in line]
        back = [line for line in out.splitlines() if "answering again after" in line]
        assert len(lost) == 1 and lost[0].startswith(f"Prefect API at {api.url} not answering")
        assert lost[0].endswith("; steps wait for it") and len(back) == 1, out
        assert "Event(" not in out + err, err[-3000:]
        print(
            f"API down {outage['started'] - outage['stopped']:.1f} s; "
            f"the run said it back {outage['said_back'] - outage['started']:.1f} s after its start"
        )
        assert_api_record_whole(api, "async1", 4)
    finally:
        api.stop()
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
    # The steps under way at the outage go on with their work (their task runs' states are
    # events, sent later) and wait only to record their end: training may finish while the API
    # is away, and the run's end then waits for it.
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["version"] for e in events if e["event"] == "weights_published"] == [2, 4]
    end = events[-1]
    assert end["event"] == "training_finished" and end["source"] == "trainer" and end["step"] == 4
    assert end["groups_in_flight"] + end["groups_ready"] > 0
    assert outage["done"] - max(end["time"], outage["back_at"]) < 30
    assert not processes_marked(str(tmp_path)), "service processes outlived the run"


def test_background_sync_releases_the_trainer_and_keeps_syncs_in_order(tmp_path, model_cache):
    """trainer.background_sync with no checkpoint or evaluation in steps 1-3: each step's weights
    are captured and the next step trains while they are broadcast; syncs still land in step
    order and every rollout respects max_staleness = 1. Its held-out evaluations (steps 0 and 4)
    draw 2 samples per prompt (sampling.eval_samples): pass@1 and pass@2 are logged.

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
        "sampling.eval_samples=2",
    )
    assert "step 4/4" in out
    run_dir = tmp_path / "runs" / "bgsync"
    evals = duckdb.sql(
        f'select step, eval_reward, eval_pass_at_1, eval_pass_at_2, "eval_pass_at_2/add" from '
        f"read_parquet('{run_dir}/metrics/*.parquet', union_by_name=true) "
        f"where eval_reward is not null order by step"
    ).fetchall()
    assert [e[0] for e in evals] == [0, 4] and all(None not in e for e in evals), evals
    # exact-match rewards: pass@1 is the mean reward; pass@2 of 2 samples is at most twice it
    assert all(p1 == pytest.approx(r) and p1 <= p2 <= 2 * p1 + 1e-9 for _, r, p1, p2, _ in evals)
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
    # `rollflow eval` of its checkpoint of step 4 on a vLLM server of its own: the run's own
    # held-out figures at step 4, overall and per env (issue 40: one evaluation for both).
    held_out = duckdb.sql(
        f'select eval_reward, "eval_reward/add", "eval_reward/sort_letters" from '
        f"read_parquet('{run_dir}/metrics/*.parquet', union_by_name=true) where step = 4"
    ).fetchall()[0]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", "eval", str(config), "--checkpoint", "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env_for(tmp_path),
        cwd=ROOT,
    )
    print(f"rollflow eval --checkpoint 4: {time.monotonic() - start:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["env", "num_prompts", "samples", "reward", "pass@1"]
    assert [line.split()[0] for line in lines[1:4]] == ["add", "sort_letters", "overall"]
    summary = pq.read_table(run_dir / "evals" / "step=4-k1" / "summary.parquet").to_pylist()
    got = {r["env"]: r["reward"] for r in summary}
    assert (got["overall"], got["add"], got["sort_letters"]) == pytest.approx(held_out), proc.stdout
    samples = pq.read_table(run_dir / "evals" / "step=4-k1" / "samples.parquet")
    assert samples.num_rows == 32 and samples.column("error").null_count == 32


def test_a_lora_run_on_s3_checkpoints_resumes_and_exports_its_adapter(
    tmp_path, model_cache, pausable_s3
):
    """[train.lora] through the whole run with train.lora.sync = "adapter" (vLLM serves the base
    model and the adapter; the merged sync's run is in test_lora_sync.py, service level, to keep
    the suite short), on S3 (moto's server), one step, then a resume that reads the checkpoint back
    from S3 and whose vLLM starts from its adapter: the whole layout is on S3 (rollouts, batches,
    checkpoints with the trainer's sharded state), every checkpoint holds the adapter beside the
    merged model (peft's merge of the one is the other), and `rollflow export` writes the adapter
    in peft's format (the merged model with --merged).

    The S3 server freezes under the runs (SIGSTOP, issue 44): in the first for STORAGE_PAUSE_S
    after step 0, and the run says it waits, then that storage answers again, and completes; in
    the second past its run.storage_outage_timeout_s, and it stops with its resume line (nothing
    of step 2 committed); the third, that line's command, resumes after step 1."""
    peft = pytest.importorskip("peft")
    import shutil
    import uuid

    import duckdb
    import fsspec
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    s3_endpoint = pausable_s3.url
    name = f"lora-{uuid.uuid4().hex[:8]}"  # its logs are local, under ~/.cache/rollflow/logs
    storage = f"s3://rollflow/{tmp_path.name}"
    # With credentials, which the runs use and keep out of everything they store.
    options = (
        f'run.storage_options={{endpoint_url="{s3_endpoint}", key="{PLANTED_KEY}", '
        f'secret="{PLANTED_SECRET}"}}'
    )
    config = write_config(tmp_path, model_cache, name=name, steps=1, storage=storage)
    # The tiny policy's rewards may all be zero in two steps; zero-advantage groups are kept and an
    # entropy bonus gives them a gradient, so every step trains the adapter whatever the rewards.
    lora = ["train.lora.rank=4", "train.lora.sync=adapter", "train.lr=1e-3", "run.eval_every=0"]
    train = ["train.filter_zero_advantage=false", "train.loss.entropy_coef=0.01"]
    logs = Path("~/.cache/rollflow/logs").expanduser() / name
    paused: dict[str, float] = {}

    def pause_on(marker: str, for_s: float | None):
        def on_line(line: str) -> None:
            if line.startswith(marker) and not paused:
                paused["at"] = time.monotonic()
                pausable_s3.pause()
                if for_s is not None:
                    threading.Timer(for_s, pausable_s3.resume).start()
            if "answering again" in line:
                paused["back"] = time.monotonic()

        return on_line

    try:
        code, out, err = run_cli_watched(
            config, tmp_path, options, *lora, *train, on_line=pause_on("step 0:", STORAGE_PAUSE_S)
        )
        assert code == 0, out[-3000:] + err[-3000:]
        waiting = f"storage {storage}/{name} not answering for 10 s; waiting"
        assert waiting in out.splitlines() and "step 1/1" in out, out
        assert [line for line in out.splitlines() if "answering again" in line], out
        print(
            f"storage paused {STORAGE_PAUSE_S} s: said back {paused['back'] - paused['at']:.1f} s"
        )
        assert_no_planted_secret(name, storage, s3_endpoint, out + err, logs / "run.log")
        # Past the deadline: the run stops cleanly, with its resume line.
        paused.clear()
        deadline = ["run.num_steps=2", "run.storage_outage_timeout_s=12"]
        try:
            code, out, err = run_cli_watched(
                config,
                tmp_path,
                options,
                *lora,
                *train,
                *deadline,
                on_line=pause_on("run ", None),  # "run NAME: resuming after committed step 1"
            )
            stopped_after = time.monotonic() - paused["at"]
        finally:
            pausable_s3.resume()
        last = err.strip().splitlines()[-1]
        assert code == 75 and last.startswith(f"stopped: storage {storage}/{name} not answering")
        assert "(run.storage_outage_timeout_s = 12)" in last and "resume with: rollflow run" in last
        assert "Traceback" not in err and "step 2/2" not in out, err[-3000:]
        print(f"storage paused past its 12 s deadline: stopped {stopped_after:.1f} s after")
        # The rerun, as that line says; the resume's vLLM starts from the base model and the
        # checkpoint's adapter, read from S3.
        out = run_cli(config, tmp_path, options, *lora, *train, *deadline)
        assert "resuming after committed step 1" in out and "step 2/2" in out
        # vllm.log holds every launch; each logs the adapter it serves as the policy.
        vllm_log = (logs / "vllm.log").read_text()
        served = [line for line in vllm_log.splitlines() if "lora_modules" in line]
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        for copy in Path("~/.cache/rollflow/checkpoints").expanduser().glob(f"{name}-*"):
            shutil.rmtree(copy, ignore_errors=True)
    # (the log's head on failure: a worker whose environment had VLLM_LOGGING_LEVEL=ERROR, as
    # importing TRL once left it, started servers that logged no such line)
    assert len(served) >= 2 and "adapter-v0" in served[0], (served, vllm_log[:3000])
    assert f"{name}-checkpoints-step=1-" in served[-1] and "/adapter" in served[-1], served
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
