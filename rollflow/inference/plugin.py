"""A vLLM general plugin, loaded by every vLLM process: idle waits without spinning, an engine
core forked rather than spawned, the model's class inspected in process, and completions without
text, each on request.

**Idle waits.**

vLLM's processes hand work to each other through shared-memory queues whose readers spin
(``sched_yield`` in a loop) for 1 s after every message before they sleep on a socket. On a GPU
host that buys microseconds of latency for a spare CPU core. On a CPU host the spinning reader
takes the core that the model, the trainer and the control plane need: measured in a tiny run
on 2 cores, vLLM's worker was busy 85% of the time, ~72% of it in that spin; with a 20 ms window
the worker and the engine core still spun ~0.3 of a core between them (py-spy), because the
engine waits on the worker for every engine step.

Since the servers rollflow starts on CPU run one rank's worker inside the engine core
(``--distributed-executor-backend uni``, server.py), no such queue is left between engine and
worker there; with tensor parallelism (several worker processes) it is.

``rollflow`` sets ``ROLLFLOW_VLLM_SPIN_S`` for the servers it starts on CPU. The plugin then
replaces the spin by a wait on the reader's own notification socket with a 1 ms timeout, for
that window after each read: a message wakes the reader at once, and the CPU is free meanwhile.
Without the variable, as for any vLLM a user starts, nothing changes.

Why a window with a timeout at all, not vLLM's idle wait straight away: the writer's wake-up is
a zmq PUB message with a send high-water mark of 1, and zmq drops one sent within ~1 ms of the
previous (the socket has not yet processed its peer's "read" credit). vLLM counts on the reader
still spinning then. With no window a dropped wake-up cost a 5 s recheck (measured: every
``/pause`` took 5.03 s); within the window the reader looks at the queue again after 1 ms.

**A forked engine core.** ``vllm serve`` runs its engine core in a process of its own. vLLM's
CPU platform starts it with ``spawn``: a fresh interpreter that imports vLLM again, ~11 s of CPU
and of wall clock per server start on this machine (of ~26 s), paid by every start. The reason
for ``spawn`` is the processes that start after a model ran (worker processes, for tensor
parallelism): a fork after OpenMP's thread pool exists hangs the child. The engine core of a
one-rank server is started by the API server, which has run no model and no OpenMP parallel
region by then, so a fork is safe, and it is what vLLM itself does on a GPU host used as a
library. With ``ROLLFLOW_VLLM_FORK_ENGINE=1`` (set by rollflow for its one-rank CPU servers) the
plugin sets the start method back to ``fork`` after the CPU platform chose ``spawn``, for a
world size of 1 only: the engine core shares the API server's imports, and a start takes ~6 s
less. A server with worker processes keeps ``spawn``.

**The model's class inspected in process.** Before it builds its config, vLLM's API server
reads what the model's class supports (``_ModelInfo``: text generation, LoRA, pooling...). It
caches the answer per class under ``VLLM_CACHE_ROOT`` (``~/.cache/vllm/modelinfos``), and on a miss
it imports the class in a fresh interpreter (``registry._run_in_subprocess``), so that the import
cannot initialise CUDA in the server. That interpreter imports torch and vLLM again, ~10 s of
CPU: a start on an empty cache was ready after 24.4 s against 12.8 s in process on 2 cores
(``bench/vllm_start.py --compare inspect``). Every host whose cache is empty pays it at its
first server start: a new user's machine, a new node, every container started from an image. On CPU there is no CUDA to keep out, and the one-rank engine core, forked
from the API server, imports the class anyway. With ``ROLLFLOW_VLLM_INSPECT_IN_PROCESS=1`` (set by
rollflow for the servers it starts on CPU) the plugin runs that inspection in the API server's own
process. The answer is cached as before. A GPU server keeps the subprocess.

**Completions without text.** The run reads a completion's token ids and log-probs, never its
text (its own tokenizer decodes what an environment needs, in the run process). vLLM's API server
detokenizes every sampled token twice all the same: incrementally for the text, and one
``decode([id])`` per token for the log-probs' token strings; the completions API has no switch
for it (``SamplingParams.detokenize`` is not among its parameters). A request whose
``vllm_xargs`` carries ``TOKEN_IDS_ONLY`` (the run's client sends it, with
``return_tokens_as_token_ids``) gets ``detokenize = False``: vLLM then makes neither, and the
answer's text is empty. EOS and stop token ids stop generation as before (they are ids); stop
strings need text, so a request that names any keeps its detokenization. Other requests are
unchanged.
"""

from __future__ import annotations

import os
import sys
import time

from rollflow.inference.protocol import (
    FORK_ENGINE_ENV,
    INSPECT_IN_PROCESS_ENV,
    SPIN_ENV,
    TOKEN_IDS_ONLY,
)

POLL_MS = 1  # how soon a reader in its window looks at the queue again without a wake-up


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (called once per process, maybe more)."""
    if os.environ.get(FORK_ENGINE_ENV) == "1":
        _fork_the_engine_core()
    if os.environ.get(INSPECT_IN_PROCESS_ENV) == "1":
        _inspect_in_process()
    _idle_waits()
    _completions_without_text()


def _completions_without_text() -> None:
    # Only where the API is served: its module is loaded before the plugins are (a worker
    # process that spawned would import it for nothing).
    protocol = sys.modules.get("vllm.entrypoints.openai.completion.protocol")
    if protocol is None:
        return
    CompletionRequest = protocol.CompletionRequest  # noqa: N806 (vLLM's class)
    make = CompletionRequest.to_sampling_params
    if getattr(make, "_rollflow_token_ids_only", False):
        return

    def to_sampling_params(self, *args, **kwargs):
        params = make(self, *args, **kwargs)
        if params.extra_args and params.extra_args.pop(TOKEN_IDS_ONLY, None) and not params.stop:
            params.detokenize = False
        return params

    to_sampling_params._rollflow_token_ids_only = True
    CompletionRequest.to_sampling_params = to_sampling_params


def _fork_the_engine_core() -> None:
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    if getattr(platform.check_and_update_config, "_rollflow_fork", False):
        return
    update = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        update(cls, vllm_config)
        if vllm_config.parallel_config.world_size == 1:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_and_update_config._rollflow_fork = True
    platform.check_and_update_config = classmethod(check_and_update_config)


def _inspect_in_process() -> None:
    from vllm.model_executor.models import registry

    if getattr(registry._run_in_subprocess, "_rollflow_in_process", False):
        return

    def run_in_process(fn):
        return fn()

    run_in_process._rollflow_in_process = True
    registry._run_in_subprocess = run_in_process


def _idle_waits() -> None:
    window = os.environ.get(SPIN_ENV)
    if window is None:
        return
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    if getattr(SpinCondition.wait, "_rollflow_window_s", None) is not None:
        return
    window_s = float(window)
    idle_wait = SpinCondition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        if time.monotonic() > self.last_read + window_s:
            self.busy_loop_s = 0.0  # vLLM's idle wait: sleep until a wake-up (or its timeout)
            return idle_wait(self, timeout_ms)
        # Within the window: sleep on the wake-up socket, at most POLL_MS (a dropped wake-up).
        events = dict(
            self.poller.poll(timeout=POLL_MS if timeout_ms is None else min(POLL_MS, timeout_ms))
        )
        if self.local_notify_socket in events:
            self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)
        # A cancel event is left on its socket, as vLLM does: every later wait sees it at once.

    wait._rollflow_window_s = window_s
    SpinCondition.wait = wait
