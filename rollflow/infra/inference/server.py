"""The inference deployment: one real vLLM OpenAI server run as a subprocess.

The server is started with ``VLLM_SERVER_DEV_MODE=1`` (which adds ``/pause``, ``/resume``,
``/collective_rpc`` and ``/reset_prefix_cache``) and with rollflow's worker extension, so that
new weights can be received over the weight group (see ``worker_extension.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import TracebackType

import httpx
import psutil

WORKER_EXTENSION_CLS = "rollflow.infra.inference.worker_extension.WeightReceiver"
_PR_SET_PDEATHSIG = 1

# vLLM's EngineCore and workers are children of the API server: a parent-death signal on the API
# server alone leaves them running (measured). So a small bash guard leads the process group:
# when its parent dies the kernel sends it SIGUSR1 (PR_SET_PDEATHSIG), and it terminates the
# whole group, then kills it. Otherwise it just waits for the server and returns its exit code.
_GUARD = (
    "trap 'trap \"\" TERM; kill -TERM -- -$$; sleep 5; kill -KILL -- -$$' USR1; "
    '"$@" & child=$!; wait $child; exit $?'
)


class InferenceError(RuntimeError):
    """The inference server failed to start, or died."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel signals the guard when the thread
    # that started it dies, so a crashed trainer or test never leaves vLLM behind.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1)


def tail(path: Path, num_lines: int = 40) -> str:
    """The last ``num_lines`` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=num_lines))
    except FileNotFoundError:
        return ""


class InferenceServer:
    """Lifecycle of one ``vllm serve`` subprocess.

    Invariant: after ``start()`` returns, the server answers ``/health``; after ``stop()``
    returns, no process of the server's process group (API server, EngineCore, workers) is
    left alive. The server runs in its own session and dies with the thread that called
    ``start()`` (the kernel's parent-death signal is per thread): call it from a thread that
    lives as long as the server should, normally the main thread.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str = "policy",
        max_model_len: int | None = None,
        startup_timeout_s: float = 180.0,
        extra_args: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        kv_cache_space_gib: int = 1,
    ) -> None:
        self.model_path = str(model_path)
        self.host = host
        self.port = port or free_port(host)
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args or [])
        self.extra_env = dict(extra_env or {})
        self.log_path = Path(log_path or f"vllm-{self.port}.log")
        self.kv_cache_space_gib = kv_cache_space_gib
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts the server."""
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_path,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--worker-extension-cls",
            WORKER_EXTENSION_CLS,
            "--disable-log-stats",
            "--uvicorn-log-level",
            "warning",
        ]
        if _on_cpu():
            # Eager mode skips torch.compile and graph capture. (vLLM's CPU platform forces
            # the multiprocess executor, so "--distributed-executor-backend uni" cannot help.)
            cmd += ["--dtype", "float32", "--enforce-eager"]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """Environment of the server process."""
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_space_gib))
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        # The worker extension is imported by module path inside vLLM's worker processes.
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env.update(self.extra_env)
        return env

    def start(self) -> InferenceServer:
        """Start the server and wait until it is healthy; raise ``InferenceError`` otherwise."""
        if self.is_alive():
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            ["bash", "-c", _GUARD, "rollflow-vllm-guard", *self.command()],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.environment(),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as http:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise self._error(f"vLLM server exited with code {code} during startup")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise self._error(
                        f"vLLM server not healthy after {self.startup_timeout_s:.0f} s"
                    )
                time.sleep(0.25)

    def _error(self, message: str) -> InferenceError:
        return InferenceError(
            f"{message}; log: {self.log_path}\n--- last lines of the log ---\n{tail(self.log_path)}"
        )

    def is_alive(self) -> bool:
        """Whether the server process is running (not whether it is healthy)."""
        return self._proc is not None and self._proc.poll() is None

    def pids(self) -> list[int]:
        """Process ids of the server and every descendant still alive."""
        if self._proc is None:
            return []
        try:
            root = psutil.Process(self._proc.pid)
            return [root.pid] + [p.pid for p in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left after ``timeout_s``."""
        if self._proc is None:
            return
        # Descendants that left the group (none do today) are still ours: kill them by pid too.
        procs = _existing(self.pids())
        pgid = self._proc.pid  # start_new_session: the server leads its own group
        _signal_group(pgid, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=timeout_s)
        if alive or self._proc.poll() is None:
            _signal_group(pgid, signal.SIGKILL)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(alive, timeout=5.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5.0)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        return True


def _existing(pids: list[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    return procs


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
