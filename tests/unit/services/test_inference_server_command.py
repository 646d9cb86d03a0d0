"""What a vLLM server rollflow starts on CPU runs as: one rank's worker inside the engine core."""

from __future__ import annotations

import tempfile

import pytest

from rollflow.inference.protocol import FORK_ENGINE_ENV, INSPECT_IN_PROCESS_ENV
from rollflow.infra.config import vllm_flag
from rollflow.infra.errors import InferenceError
from rollflow.services import vllm_server as server_module
from rollflow.services.vllm_server import InferenceServer


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    monkeypatch.setattr(server_module, "_on_cpu", lambda: True)


def _backend(server: InferenceServer) -> tuple[str | None, str | None, str | None]:
    """The executor backend, vLLM's multiprocessing switch, and whether the engine core forks."""
    cmd = server.command()
    flag = "--distributed-executor-backend"
    backend = cmd[cmd.index(flag) + 1] if flag in cmd else None
    env = server.environment()
    return backend, env.get("VLLM_ENABLE_V1_MULTIPROCESSING"), env.get(FORK_ENGINE_ENV)


def test_one_rank_runs_its_worker_in_the_engine_core(tiny_model_dir, monkeypatch):
    # One process fewer than vLLM's CPU default (API server, engine core, worker), and no
    # shared-memory queue between engine and worker; vLLM's CPU platform keeps "uni" only
    # where VLLM_ENABLE_V1_MULTIPROCESSING is 0. Its engine core is forked from the API server
    # (inference/plugin.py; that it is, is checked on a real server in test_inference.py).
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert _backend(InferenceServer(tiny_model_dir)) == ("uni", "0", "1")


@pytest.mark.parametrize(
    "tp_args", [["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"], ["-tp", "2"]]
)
def test_tensor_parallel_ranks_keep_their_worker_processes(tiny_model_dir, monkeypatch, tp_args):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert _backend(InferenceServer(tiny_model_dir, extra_args=tp_args)) == (None, None, None)
    one = InferenceServer(tiny_model_dir, extra_args=["--tensor-parallel-size", "1"])
    assert _backend(one) == ("uni", "0", "1")


@pytest.mark.parametrize(
    ("bind", "threads"),
    [("0", "1"), ("2,3", "2"), ("0-3,8", "5"), ("auto", None), ("0|1", None), ("0,x", None)],
)
def test_one_rank_computes_on_one_thread_per_core_it_was_given(
    tiny_model_dir, monkeypatch, bind, threads
):
    # vLLM 0.32 binds no OpenMP threads for a rank inside the engine core (the real server's
    # threads are counted in test_inference.py): OMP_NUM_THREADS is the one bound that holds.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    placed = InferenceServer(tiny_model_dir, extra_env={"VLLM_CPU_OMP_THREADS_BIND": bind})
    assert placed.environment().get("OMP_NUM_THREADS") == threads
    tp = InferenceServer(
        tiny_model_dir, extra_args=["-tp", "2"], extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0"}
    )
    assert "OMP_NUM_THREADS" not in tp.environment()  # vLLM's own executor binds each rank's
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's choice stands
    assert placed.environment()["OMP_NUM_THREADS"] == "4"


def test_a_flag_is_found_in_both_spellings_and_only_as_a_flag():
    assert vllm_flag(["--dtype", "bfloat16"], "--dtype") == "bfloat16"
    assert vllm_flag(["--dtype=half", "--x"], "--dtype") == "half"
    assert vllm_flag(["--enforce-eager", "--dtype"], "--dtype") == ""
    assert vllm_flag(["--dtype-policy", "x", "bfloat16"], "--dtype") is None
    assert vllm_flag(["-tp", "2"], "--tensor-parallel-size", "-tp") == "2"


def test_waiting_for_health_builds_no_tls_context_per_poll(tiny_model_dir, monkeypatch):
    """The start-up poll (4 a second for the whole start) goes through the process's shared
    client: httpx.get built a TLS context, loading the CA bundle, on every call (~70 ms of CPU)."""
    import ssl
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(503 if polls.append(1) or len(polls) < 10 else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    polls: list[int] = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    contexts: list[int] = []
    made = ssl.SSLContext.load_verify_locations
    monkeypatch.setattr(
        ssl.SSLContext,
        "load_verify_locations",
        lambda self, *a, **k: contexts.append(1) or made(self, *a, **k),
    )

    class Started:  # the spawned process, as far as the wait goes: alive, polled until healthy
        def wait_healthy(self, probe, timeout_s):
            while not probe():
                pass

    server = InferenceServer(tiny_model_dir, port=httpd.server_address[1])
    server._proc = Started()
    try:
        server.wait_ready()
    finally:
        httpd.shutdown()
    assert len(polls) == 10
    assert len(contexts) <= 1, f"{len(contexts)} TLS contexts for {len(polls)} polls"


def test_a_server_is_not_started_on_a_port_another_process_listens_on(tiny_model_dir, monkeypatch):
    """vLLM binds with SO_REUSEPORT: on a port that a process still listens on (a restarted
    server's previous engine core, still exiting) it started anyway, and the kernel sent part of
    the connections to the old socket, where nothing answered them (a weight group set-up hung).
    The start now waits for the port and names who holds it."""
    import os
    import socket

    monkeypatch.setattr(server_module, "PORT_FREE_TIMEOUT_S", 0.3)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as vLLM binds
        held.bind(("127.0.0.1", 0))
        held.listen()
        server = InferenceServer(tiny_model_dir, port=held.getsockname()[1])
        try:
            with pytest.raises(InferenceError, match=rf"port {server.port} .*pid {os.getpid()} "):
                server.spawn()
            assert not server.is_alive()
        finally:
            server.stop(timeout_s=5)


def test_a_server_on_cpu_compiles_nothing_unless_the_user_asks(tiny_model_dir, monkeypatch):
    # That the real server then loads no kernel torch.compile built is checked in
    # test_inference.py; here, that the user's own setting stands.
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    assert InferenceServer(tiny_model_dir).environment()["TORCH_COMPILE_DISABLE"] == "1"
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    assert InferenceServer(tiny_model_dir).environment()["TORCH_COMPILE_DISABLE"] == "0"


def test_a_server_on_cpu_inspects_its_model_in_process_unless_the_user_asks(
    tiny_model_dir, monkeypatch
):
    # What the real server then does on an empty vLLM cache is checked in test_inference.py.
    monkeypatch.delenv(INSPECT_IN_PROCESS_ENV, raising=False)
    assert InferenceServer(tiny_model_dir).environment()[INSPECT_IN_PROCESS_ENV] == "1"
    monkeypatch.setenv(INSPECT_IN_PROCESS_ENV, "0")
    assert InferenceServer(tiny_model_dir).environment()[INSPECT_IN_PROCESS_ENV] == "0"


@pytest.mark.parametrize("on_cpu", [True, False], ids=["cpu", "gpu"])
def test_a_servers_temporary_files_go_to_its_folder_and_compiled_kernels_stay_cached(
    tiny_model_dir, tmp_path, monkeypatch, on_cpu
):
    # vLLM's IPC sockets and file store in the server's own folder (made at spawn; that the real
    # server's are there, and that stop removes it, is checked in test_inference.py), but not
    # torch inductor's cache, which also follows tempfile's folder: where it was before, so that
    # kernels compiled at one start (on GPUs) are found at the next. A user's own place stands.
    monkeypatch.setattr(server_module, "_on_cpu", lambda: on_cpu)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "the-hosts-tmp"))  # gettempdir()'s
    server = InferenceServer(tiny_model_dir)
    assert "VLLM_RPC_BASE_PATH" not in server.environment()  # nothing spawned: no folder yet
    server.runtime_dir = tmp_path / "server"
    env = server.environment()
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == str(tmp_path / "server")
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "the-hosts-tmp"))
    assert "torchinductor_" in env["TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert server.environment()["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
