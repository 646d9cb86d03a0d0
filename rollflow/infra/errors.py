"""Every error rollflow raises on purpose, in one small hierarchy.

    RollflowError
    ├── InputError          bad input a user can fix (a dataset row, a batch, a deployment, a step
    │   └── ConfigError     that has no checkpoint); the config's own errors name the key
    ├── StorageError        a read or write of the run's storage failed; names the path
    ├── ServiceError        a service failed, died or did not answer; ``status`` is the HTTP
    │   │                   status of its answer (None: no answer)
    │   ├── InferenceError  the vLLM server: failed to start, or failed a request
    │   │   ├── InferenceUnavailable  unreachable or dropped the connection: retry later
    │   │   ├── RequestAborted        the server aborted a generation: retry
    │   │   ├── InferenceGone         down for good (given up on, or the run is stopping)
    │   │   └── PrefixCacheNotReset   refused to drop KV of old weights after a sync, to its deadline
    │   └── WeightSyncError the weight plane (trainer → vLLM workers) failed or timed out
    ├── TrainingFinished    the explicit end of training: a waiter learns there is no more
    └── ProducerFailed      the rollout producer stopped on an error (the cause is chained)

A message says what failed and what to do; the class says how the caller reacts: an
``InputError`` is shown as one line, a ``ServiceError`` fails the step or the run naming the
service, the retryable inference errors are retried. ``raise ... from`` keeps the cause.
"""

from __future__ import annotations


class RollflowError(RuntimeError):
    """Base of every error rollflow raises on purpose."""


class InputError(RollflowError, ValueError):
    """Bad input a user can fix; the message names the file, row, key or step and the fix."""


class ConfigError(InputError):
    """A config that cannot be used; the message names the key and what to do."""


class StorageError(RollflowError):
    """A storage read or write that failed; the message names the path."""


class ServiceError(RollflowError):
    """A service call that failed, or a service that did not start, died or does not answer.

    ``status`` is the HTTP status of the answer; None when there was none (unreachable, no
    answer within the deadline, a process that exited)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class TrainerLost(ServiceError):
    """The trainer died or stopped answering: the run may restart it from its last committed
    checkpoint (``trainer.max_restarts``; ``rl_run``)."""


class InferenceError(ServiceError):
    """The vLLM server failed to start, or failed a request (``status``: its HTTP status)."""


class InferenceUnavailable(InferenceError):
    """The server could not be reached, or dropped the connection (retry later)."""


class RequestAborted(InferenceError):
    """The server aborted a generation (``finish_reason == "abort"``, e.g. pause(mode="abort"))."""


class InferenceGone(InferenceError):
    """The server is down for good: its supervisor gave up on it, it stayed unhealthy with no
    restart under way, or the run is stopping. Fatal for the step."""


class PrefixCacheNotReset(InferenceError):
    """The server kept refusing to reset its prefix cache after a weight sync, until the reset's
    deadline: its cached KV, computed by the old weights, could still be reused."""


class WeightSyncError(ServiceError):
    """The weight group could not be formed, or a weight sync failed or overran its deadline."""


class TrainingFinished(RollflowError):
    """The explicit end of training (or the run closing): no more groups, no more waiting."""


class ProducerFailed(RollflowError):
    """The rollout producer stopped: a group's run raised (e.g. ``InferenceGone``) or the prompt
    source broke; every waiter gets this, with the cause chained."""
