"""A vLLM general plugin, loaded by every vLLM process: idle waits without spinning, on request.

vLLM's processes hand work to each other through shared-memory queues whose readers spin
(``sched_yield`` in a loop) for 1 s after every message before they sleep on a socket. On a GPU
host that buys microseconds of latency for a spare CPU core. On a CPU host the spinning worker
is the core that the trainer and the control plane need: measured in a tiny run on 2 cores,
vLLM's worker was busy 85% of the time, ~72% of it in that spin and ~15% generating.

``rollflow`` sets ``ROLLFLOW_VLLM_SPIN_S`` for the servers it starts on CPU (20 ms); the plugin
then uses that window instead of 1 s. Without the variable, as for any vLLM a user starts,
nothing changes.

Why not 0: the writer's wake-up goes through a zmq PUB socket with a send high-water mark of 1,
and zmq drops a message sent within ~1 ms of the previous one (the socket has not yet processed
its peer's "read" credit). vLLM counts on the reader still spinning then. With no window at all
a dropped wake-up cost a 5 s recheck (measured: every ``/pause`` took 5.03 s); a reader that
keeps spinning for 20 ms after each read sees every message written that soon after another.
"""

from __future__ import annotations

import os

SPIN_ENV = "ROLLFLOW_VLLM_SPIN_S"


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point (called once per process, maybe more)."""
    spin = os.environ.get(SPIN_ENV)
    if spin is None:
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    if getattr(SpinCondition.wait, "_rollflow_spin_s", None) is not None:
        return
    spin_s = float(spin)
    spin_wait = SpinCondition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        # Queues made before the plugin loaded get the window too: vLLM reads it on every wait.
        self.busy_loop_s = spin_s
        return spin_wait(self, timeout_ms)

    wait._rollflow_spin_s = spin_s
    SpinCondition.wait = wait
