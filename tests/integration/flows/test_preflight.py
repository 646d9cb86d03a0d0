"""Preflight: every check fails in under 5 s with one line naming the key, the value and the fix,
before the Prefect API or any service starts."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from rollflow.flows.preflight import Preflight, PreflightError
from rollflow.infra.config import load_config

QUICKSTART = "configs/quickstart.toml"


def problems(overrides, *, dry_run=False, notes=None) -> list[str]:
    cfg = load_config(QUICKSTART, overrides)
    start = time.monotonic()
    try:
        Preflight(cfg, dry_run=dry_run, note=(notes.append if notes is not None else print)).run()
        found = []
    except PreflightError as exc:
        found = exc.problems
    assert time.monotonic() - start < 5.0
    assert all("\n" not in line for line in found)
    return found


def on_model(path) -> list[str]:
    return ["~model.tiny", f"model.path={path!s}"]


@pytest.fixture
def local_storage(tmp_path):
    return [f"run.storage={tmp_path / 'runs'}"]


def test_a_good_config_passes(local_storage, tiny_model_dir):
    assert problems(local_storage) == []
    assert problems([*local_storage, *on_model(tiny_model_dir)]) == []


# (case, overrides beyond the storage, expected line)
MODEL_CASES = [
    (
        "missing folder",
        on_model("/nonexistent/model"),
        "model.path = '/nonexistent/model': no such folder; give a Hugging Face model folder",
    ),
    (
        "relative missing folder",
        on_model("./no/such/model"),
        "model.path = './no/such/model': no such folder",
    ),
]


@pytest.mark.parametrize("case,overrides,line", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_model_folder_problems(case, overrides, line, local_storage):
    found = problems([*local_storage, *overrides])
    assert len(found) == 1 and found[0].startswith(line), found


def test_model_folder_without_config_or_weights(tmp_path, local_storage, tiny_model_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    found = problems([*local_storage, *on_model(empty)])
    assert found == [
        f"model.path = '{empty}': the folder has no config.json; is it a Hugging Face model?",
        f"model.path = '{empty}': the folder has no weights (*.safetensors or *.bin); save the "
        "model with save_pretrained() or download it whole",
    ]
    a_file = tiny_model_dir / "config.json"
    assert problems([*local_storage, *on_model(a_file)])[0].startswith(
        f"model.path = '{a_file}': is a file, not a folder"
    )


def test_hub_id_not_cached(local_storage, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    overrides = [*local_storage, *on_model("someone/not-cached-model")]
    notes: list[str] = []
    assert problems(overrides, dry_run=True, notes=notes) == []  # a dry run never downloads
    assert "model.path = 'someone/not-cached-model': not in the Hugging Face cache" in notes[0]
    found = problems(overrides)
    assert found == [
        "model.path = 'someone/not-cached-model': not in the Hugging Face cache and "
        "HF_HUB_OFFLINE is set; download it first (huggingface-cli download "
        "someone/not-cached-model) or point model.path at a local folder"
    ]


def test_s3_storage_on_moto_passes_and_leaves_nothing(s3_endpoint):
    import fsspec

    opts = f'run.storage_options={{endpoint_url="{s3_endpoint}"}}'
    assert problems(["run.storage=s3://rollflow/pf", "run.name=probe", opts]) == []
    fs = fsspec.filesystem("s3", endpoint_url=s3_endpoint, skip_instance_cache=True)
    assert not fs.exists("rollflow/pf/probe") or fs.ls("rollflow/pf/probe") == []


def test_s3_storage_problems(s3_endpoint, monkeypatch):
    opts = f'run.storage_options={{endpoint_url="{s3_endpoint}"}}'
    assert problems(["run.storage=s3://no-such-bucket", opts]) == [
        "run.storage = 's3://no-such-bucket': the bucket does not exist; create it "
        "(The specified bucket does not exist)"
    ]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    found = problems(
        ["run.storage=s3://rollflow", f'run.storage_options={{endpoint_url="{closed}"}}']
    )
    assert len(found) == 1 and found[0].startswith(
        f"run.storage_options.endpoint_url = '{closed}': unreachable (Could not connect"
    ), found
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert problems(["run.storage=s3://rollflow", opts]) == [
        "run.storage = 's3://rollflow': no S3 credentials found; set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment"
    ]


def test_endpoint_that_never_answers_fails_within_the_deadline():
    """A server that accepts connections and never replies (a hung proxy, a black hole)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        found = problems(
            ["run.storage=s3://rollflow", f'run.storage_options={{endpoint_url="{url}"}}']
        )
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()
    assert len(found) == 1 and found[0].startswith(
        f"run.storage_options.endpoint_url = '{url}': no answer"
    ), found


def test_local_storage_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    found = problems([f"run.storage={blocker}"])
    assert found == [
        f"run.storage = '{blocker}': cannot write in {blocker} (a file, not a folder); "
        "choose a writable folder"
    ]


def test_lora_target_modules_that_name_no_linear_layer(local_storage, tiny_model_dir):
    pytest.importorskip("peft")
    lora = ["train.lora.rank=4", 'train.lora.target_modules=["q_proj", "qkv_proj"]']
    for model in ([], on_model(tiny_model_dir)):  # a built tiny model, and a model folder
        assert problems([*local_storage, *model, *lora]) == [
            "train.lora.target_modules = ['q_proj', 'qkv_proj']: ['qkv_proj'] name no linear "
            "layer of the model; its linear layers are ['down_proj', 'gate_proj', 'k_proj', "
            "'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"
        ]
    assert problems([*local_storage, *on_model(tiny_model_dir), "train.lora.rank=4"]) == []


def test_envs_and_sinks_and_every_failure_at_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    found = problems(
        [
            "run.storage=/proc/rollflow-nope",
            'envs=[{name="no_such_env"}]',
            'metrics.sinks=["wandb"]',
        ]
    )
    assert found == [
        "run.storage = '/proc/rollflow-nope': cannot write in /proc (No such file or directory); "
        "choose a writable folder",
        "envs[0].name = 'no_such_env': unknown env 'no_such_env' in [[envs]]: use one of "
        "['add', 'calculator', 'dataset', 'guess_number', 'math', 'mod_add', 'reasoning_gym', "
        "'reverse_letters', 'shift_letters', 'sort_letters', 'verifiers'] or "
        "'package.module:Class'",
        "metrics.sinks = ['wandb']: the wandb package is not installed: pip install "
        "'rollflow[wandb]' (or: pip install wandb), or remove 'wandb' from metrics.sinks",
    ]


# `python -m rollflow.cli ARGS`, saying at exit which heavy packages the process had imported.
CLI_SAYING_IMPORTS = (
    "import atexit, runpy, sys\n"
    "heavy = ('prefect', 'vllm')\n"
    "atexit.register(lambda: print('imported:', *[m for m in heavy if m in sys.modules],"
    " file=sys.stderr))\n"
    "sys.argv = ['rollflow', *sys.argv[1:]]\n"
    "runpy.run_module('rollflow.cli', run_name='__main__')\n"
)


def test_cli_fails_before_any_service_with_one_line(tmp_path):
    """`rollflow run` with a model folder that does not exist: one line, exit 2, and no Prefect
    API was started (its log folder and process would be the first thing a run makes). It fails
    fast because it imports neither Prefect nor vLLM: importing Prefect alone costs ~1.2 s of the
    ~2.5 s (a module-level call into Prefect's client in rollflow/flows/__init__.py did,
    and a CI run under load took 9.1 s; the check was a time bound then)."""
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # unusable if reached
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CLI_SAYING_IMPORTS,
            "run",
            QUICKSTART,
            f"run.storage={tmp_path}",
            "~model.tiny",
            "model.path=/nonexistent/model",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == "imported:", f"{proc.stderr} ({elapsed:.1f} s)"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: model.path = '/nonexistent/model': no such folder; give a Hugging Face model "
        "folder (config.json + *.safetensors) or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
    ]
    assert "Traceback" not in proc.stderr


def test_free_disk_for_a_checkpoint(local_storage, tiny_model_dir, monkeypatch):
    """Too little room for one checkpoint (~4x the weights) where rank 0 stages it: an error;
    too little for every checkpoint the run keeps on local storage: a warning."""
    import shutil
    import tempfile
    from collections import namedtuple

    from rollflow.flows import preflight as pf

    weights = sum(p.stat().st_size for p in tiny_model_dir.glob("*.safetensors"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, weights))
    found = problems([*local_storage, *on_model(tiny_model_dir)])
    assert len(found) == 1 and found[0].startswith(
        f"free disk = '{tempfile.gettempdir()}': 0.0 GiB free, a checkpoint needs"
    ), found
    assert found[0].endswith("free space or set TMPDIR")
    one = weights * pf.CHECKPOINT_OVER_WEIGHTS
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, one * 2))
    notes: list[str] = []
    assert problems([*local_storage, *on_model(tiny_model_dir)], notes=notes) == []
    assert any(
        n.startswith("warning: run.storage = ") and "raise run.checkpoint_every" in n for n in notes
    )


def test_processes_placed_on_other_hosts_with_a_folder_for_storage_are_warned(local_storage):
    """Placed trainer nodes or servers get the policy, checkpoints and key from run.storage: a
    folder of this host is there only if every host mounts it (a warning, not a failure)."""
    notes: list[str] = []
    placed = [
        "trainer.master_addr=auto",
        "trainer.node_deployment=rollflow-trainer-node/default",
        "trainer.device=cpu",  # placed from a host without GPUs: named (the plan's rule)
    ]
    assert problems([*local_storage, *placed], notes=notes) == []
    [note] = [n for n in notes if "place processes on other hosts" in n]
    assert note.startswith("warning: run.storage = ") and "trainer.node_deployment" in note
    assert "use object storage (s3://...)" in note
    notes.clear()
    assert problems(local_storage, notes=notes) == []
    assert not [n for n in notes if "other hosts" in n]  # nothing placed: nothing to warn of


def test_a_run_this_host_cannot_place_fails_in_preflight(local_storage):
    """The placement plan runs in preflight, on this host: a run that cannot be placed fails in
    ~2 s, before its folder, Prefect API or model exist (it failed ~15 s in, after the Prefect
    API started). Cores beyond any machine's; a tensor parallelism that does not divide the
    model's heads. A dry run, which validates a config for wherever it will run (a GPU config
    on a laptop), notes it instead."""
    [cores] = problems([*local_storage, "inference.cpus=[4095]"])
    assert cores.startswith("placement: inference.cpus names core(s) [4095]"), cores
    [heads] = problems([*local_storage, "inference.tensor_parallel_size=3"])
    assert heads.startswith("placement: inference.tensor_parallel_size = 3 does not divide"), heads
    notes: list[str] = []
    assert problems([*local_storage, "inference.cpus=[4095]"], dry_run=True, notes=notes) == []
    assert [n for n in notes if n.startswith("warning: placement on this host: inference.cpus")]
