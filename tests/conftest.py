"""Test-wide settings: a project-local Prefect home, no analytics, quiet logs, small thread pools."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# One Prefect home (its SQLite database) per pytest-xdist worker: two workers never share one.
# The controller sets it first and its workers inherit its environment, so a worker replaces the
# controller's (a setdefault kept it: every worker shared `main`); a PREFECT_HOME set outside the
# suite is kept.
_HOMES = ROOT / ".prefect" / "tests"
if Path(os.environ.get("PREFECT_HOME", _HOMES / "main")).parent == _HOMES:
    os.environ["PREFECT_HOME"] = str(_HOMES / os.environ.get("PYTEST_XDIST_WORKER", "main"))
os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)
# Every process the suite starts inherits this mark, set by the controller (a pytest that a test
# starts sets its own) and kept by its workers: whatever still carries it once the suite is over
# outlived its test (pytest_sessionfinish).
SUITE_MARK = "ROLLFLOW_TESTS_SUITE"
if os.environ.get("PYTEST_XDIST_WORKER") is None:
    os.environ[SUITE_MARK] = f"{os.getpid()}-{time.time_ns()}"
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

VLLM_MAX_LEN = 64
# The session server's KV block (tokens): vLLM caches only whole blocks, and the CPU default (128)
# is longer than any sequence here, which would hide every prefix-cache hit from the tests.
VLLM_BLOCK = 32


def pytest_report_header(config) -> str:
    """The fault campaign's seed, in every run's header (CI sets a new one per run)."""
    seed = os.environ.get("ROLLFLOW_CHAOS_SEED")
    return f"chaos seed: {seed or '6 (default; set ROLLFLOW_CHAOS_SEED to vary or replay)'}"


# The suite runs on two pytest-xdist workers (pyproject.toml's addopts: ``--dist loadgroup``) and
# sends each test file to one worker whole, so that a file's module-scoped services (a server, a
# trainer, the chaos campaign's run directory) start once. The files that share one of the
# session's services below also share a worker: the service starts once per suite, not per worker.
SHARED_SERVICES = ("deployed_run", "vllm_server")
DEPLOYED_RUN_TIMEOUT_S = 1200  # pytest-timeout's limit for a test that may start the deployed run


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session):
    """In the controller, once its workers are gone: the processes that still carry the suite's
    mark outlived their tests. They are named in the terminal and killed, so that a run of the
    suite leaves nothing behind on the machine (one did: Prefect's ephemeral API server, its
    parent gone, took 400 MB for good)."""
    import psutil

    result = yield
    if os.environ[SUITE_MARK].startswith(f"{os.getpid()}-"):
        run_support = sys.modules.get("run_support")
        if run_support is not None:  # (without workers, its session API stops at exit: now)
            run_support.stop_session_api()
        from deployed_run import processes_marked

        left = processes_marked(os.environ[SUITE_MARK])
        if left:
            writer = session.config.get_terminal_writer()
            writer.line(f"{len(left)} process(es) outlived the suite, now killed:", yellow=True)
            for proc in left:
                writer.line(
                    f"  pid {proc.pid}: {' '.join(proc.info['cmdline'] or [])[:200]}", yellow=True
                )
                with contextlib.suppress(psutil.Error):
                    proc.kill()
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Put every test file that uses one of ``SHARED_SERVICES`` in that service's xdist_group,
    and order the work units (a file, or a group) by their count of ``slow`` tests, most first:
    the longest start first and the quick unit files fill the workers' ends. (Within a unit the
    order stays the file's: the chaos campaign's tests build on each other.)"""
    group: dict[Path, str] = {}
    for item in items:
        for name in SHARED_SERVICES:
            if name in item.fixturenames:
                group.setdefault(item.path, name)
    for item in items:
        if item.path in group and not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(group[item.path]))
        if "deployed_run" in item.fixturenames and not item.get_closest_marker("timeout"):
            # Whichever test asks first pays for the deployed run: a run, a lost host and its
            # rerun, and a run submitted from the form in a browser (~5 min on 2 busy cores).
            item.add_marker(pytest.mark.timeout(DEPLOYED_RUN_TIMEOUT_S))
        _name_the_group(item)
    unit = [group.get(item.path, str(item.path)) for item in items]
    slow: dict[str, int] = {}
    for key, item in zip(unit, items, strict=True):
        slow[key] = slow.get(key, 0) + (item.get_closest_marker("slow") is not None)
    first = {key: i for i, key in reversed(list(enumerate(unit)))}
    order = sorted(range(len(items)), key=lambda i: (-slow[unit[i]], first[unit[i]], i))
    items[:] = [items[i] for i in order]


def _name_the_group(item) -> None:
    """On an xdist worker, suffix the test's id with its xdist_group (``id@group``), which the
    scheduler below reads. pytest-xdist 3.8 does it by setting ``item._nodeid``, which pytest 9.2
    no longer reads (ids live in ``item._id``): its groups silently did nothing, and the session
    fixtures of a group (the deployed run: ~150 s) were made once on each worker."""
    from _pytest.nodes import coerce_node_id

    names = sorted(
        {str(m.args[0] if m.args else "default") for m in item.iter_markers("xdist_group")}
    )
    if names and os.environ.get("PYTEST_XDIST_WORKER") and "@" not in item.nodeid:
        item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook
def pytest_xdist_make_scheduler(config, log):
    """A test goes to the worker of its xdist_group if it has one, else of its file."""
    from xdist.scheduler import LoadScopeScheduling

    class FileOrGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if "@" in nodeid:  # xdist's suffix for a test's xdist_group under --dist loadgroup
                return nodeid.rsplit("@", 1)[-1]
            return nodeid.split("::", 1)[0]

    return FileOrGroup(config, log)


PROMPT_IDS = [1, 10, 11, 12, 13]  # <bos> + "6789" in the character tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An untrained tiny char Llama saved as a HF directory."""
    from rollflow.infra.config import TinyModelSpec
    from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama, save_hf_dir

    tok = build_char_tokenizer()
    model = build_tiny_llama(
        TinyModelSpec(hidden_size=64, num_heads=2, intermediate_size=64), vocab_size=len(tok)
    )
    return save_hf_dir(model, tok, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One cache of warm-started tiny models for every end-to-end run of the session, shared by
    its workers (a model is built into a folder of its own and renamed into place: two workers
    building it at once both get a whole one)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):  # basetemp is <session's>/popen-gwN
        shared = tmp_path_factory.getbasetemp().parent / "models"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 endpoint (moto's server) on 127.0.0.1 with one bucket."""
    from moto.server import ThreadedMotoServer

    # Credentials for moto, inherited by the services a test starts.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    import boto3

    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="rollflow")
    yield url
    server.stop()


@pytest.fixture(scope="session")
def pausable_s3(tmp_path_factory):
    """An S3 endpoint (moto's server) in a process of its own, so that a test can freeze it
    (SIGSTOP) and let it go on (SIGCONT) under a run: ``.url``, ``.pause()``, ``.resume()``."""
    import signal
    import subprocess
    import sys

    import boto3
    import httpx

    from rollflow.infra.processes import free_port

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url, timeout=2)
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, "moto did not start"
            time.sleep(0.2)
    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="rollflow")

    class Server:
        def pause(self) -> None:
            proc.send_signal(signal.SIGSTOP)

        def resume(self) -> None:
            proc.send_signal(signal.SIGCONT)

    server = Server()
    server.url = url
    yield server
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


@pytest.fixture(scope="session")
def deployed_run(tmp_path_factory):
    """A tiny quickstart run made through a real Prefect server, deployment and process worker
    (tests/deployed_run.py); shared by the tests of deployments, export and the notebook."""
    from deployed_run import make_deployed_run

    return make_deployed_run(tmp_path_factory.mktemp("deployed"))


@pytest.fixture(scope="session")
def vllm_model_dirs(tmp_path_factory) -> list[Path]:
    """Two tiny Llamas of the same shape, differently seeded: served policy and new policy."""
    from rollflow.infra.config import TinyModelSpec
    from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama, save_hf_dir

    tok = build_char_tokenizer()
    root = tmp_path_factory.mktemp("models")
    return [
        save_hf_dir(
            build_tiny_llama(
                TinyModelSpec(seed=seed, max_position_embeddings=VLLM_MAX_LEN), vocab_size=len(tok)
            ),
            tok,
            root / f"s{seed}",
        )
        for seed in (0, 1)
    ]


@pytest.fixture(scope="session")
def vllm_server(vllm_model_dirs, tmp_path_factory):
    """A real vLLM server (the CPU build) serving the first of ``vllm_model_dirs``, shared by the
    session. A test that changes its weights puts the first model's back (``restore_weights``);
    a test that stops or restarts a server starts its own. It starts as on a new host: its vLLM
    cache (``VLLM_CACHE_ROOT``, ``~/.cache/vllm`` by default) is empty."""
    from rollflow.services.vllm_server import InferenceServer

    logs = tmp_path_factory.mktemp("logs")
    srv = InferenceServer(
        vllm_model_dirs[0],
        max_model_len=VLLM_MAX_LEN,
        log_path=logs / "vllm.log",
        extra_args=["--block-size", str(VLLM_BLOCK)],
        extra_env={"VLLM_CACHE_ROOT": str(logs / "vllm-cache")},
    )
    start = time.monotonic()
    srv.start()
    print(f"\nvLLM server healthy after {time.monotonic() - start:.1f}s")
    yield srv
    srv.stop()


class SenderSource:
    """The trainer's half of the weight plane, in process: its weights are set by the test; it
    answers the trainer's replies (``trainer/protocol.py``)."""

    def __init__(self, weights, secret: str):
        self.weights, self.sender, self.version = weights, None, 0
        self.secret = secret  # the vLLM server's key: its workers prove it to join

    def metadata(self):
        from rollflow.infra.weights.group import weight_metadata
        from rollflow.trainer.protocol import WEIGHTS_METADATA

        return WEIGHTS_METADATA.parse(weight_metadata(self.weights))

    def weights_port(self):
        from rollflow.infra.processes import free_port

        return free_port()

    def weights_connect(self, host, port, world_size, timeout_s, wire_device, bucket_bytes):
        from rollflow.infra.weights.group import WeightSender
        from rollflow.trainer.protocol import OkReply

        self.sender = WeightSender(
            host, port, world_size, timeout_s, wire_device, bucket_bytes, secret=self.secret
        )
        self.sender.connect()
        return OkReply(ok=True)

    def weights_broadcast(self, version=None, timeout_s=None):
        from rollflow.trainer.protocol import SentReply

        version = self.version if version is None else version
        start = time.perf_counter()
        sent = self.sender.broadcast(self.weights, version)
        return SentReply(version=version, bytes=sent, broadcast_s=time.perf_counter() - start)

    def weights_close(self, timeout_s=None):
        from rollflow.trainer.protocol import OkReply

        self.sender.close()
        return OkReply(ok=True)

    def health(self, timeout_s=5.0):
        from rollflow.trainer.protocol import HealthReply

        return HealthReply(
            ok=True,
            optim_step=0,
            weights_version=self.version,
            backend="in-process",
            world_size=1,
            ranks=[],
            pid=os.getpid(),
        )


def restore_weights(server, model_dir) -> None:
    """Sync ``model_dir``'s weights back to ``server`` (tagged by the trainer: version None), so
    that the tests after one that changed them see the served policy they expect."""
    from transformers import AutoModelForCausalLM

    from rollflow.infra.vllm_fleet import keys
    from rollflow.tasks.sync.weights import GroupSpec, join, leave, publish

    weights = list(AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items())
    source = SenderSource(weights, secret=keys.key_for(server.url))
    join(source, [(server.url, 1)], GroupSpec.single(), timeout_s=30)
    try:
        publish(source, [server.url], None, timeout_s=30)
    finally:
        leave(source, [server.url], timeout_s=10)


def greedy_reference(model_dir, prompt_ids: list[int], max_tokens: int):
    """transformers' greedy completion of ``prompt_ids`` (and the model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollflow.infra.models.tiny import EOS_ID

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=EOS_ID,
            pad_token_id=0,
        )
    return model, out[0, len(prompt_ids) :].tolist()
