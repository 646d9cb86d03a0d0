"""Quarantine of a failing environment: its prompts are set aside, and it is probed until it
recovers.

An environment whose groups keep failing (its tool server is down, its reward function raises
on everything) would otherwise fill step after step with error rows that no one trains on,
while the healthy environments of the run wait for batch slots. After ``after`` failed groups
of one environment in a row, the producer stops admitting its prompts (each one it draws is set
aside, counted) except one probe every ``probe_every_s``: a probe that succeeds ends the
quarantine, one that fails starts the wait again. A group is failed when it has no sample to
train on: the environment raised (its result is the error string) or every sample carries an
error. A failed group is still emitted, marked and never trained on, as before. When every
environment of the run has been quarantined for ``give_up_s``, the run fails with each one's
last error: a reward function that raises on everything is a bug, not an outage.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from rollflow.tasks.generate.rollouts import GroupResult

log = logging.getLogger(__name__)


def group_error(result: GroupResult) -> tuple[bool, str | None]:
    """Whether a group left nothing to train on, and its first error."""
    if isinstance(result, str):
        return True, result
    errors = [s.error for s in result if s.error is not None]
    return len(errors) == len(result), errors[0] if errors else None


@dataclass
class EnvQuarantine:
    """Per-environment failures in a row, and which environments are set aside until a probe."""

    after: int  # failed groups in a row that quarantine an env; 0: never
    probe_every_s: float
    clock: Callable[[], float]
    envs: frozenset[str] = frozenset()  # the run's envs: all of them quarantined → give up
    give_up_s: float = math.inf
    last_error: dict[str, str] = field(default_factory=dict)
    all_since_s: float | None = None  # since when every env is quarantined
    failed_in_a_row: dict[str, int] = field(default_factory=dict)
    next_probe_s: dict[str, float] = field(default_factory=dict)  # quarantined env → probe time
    probing: set[str] = field(default_factory=set)  # quarantined envs with a probe in flight
    num_quarantined: int = 0  # quarantines started, all envs
    num_set_aside: int = 0  # prompts not admitted because their env was quarantined
    num_probes: int = 0

    def admit(self, env: str) -> bool:
        """Whether a prompt of ``env`` may start now (healthy, or its probe is due)."""
        if env not in self.next_probe_s:
            return True
        if env not in self.probing and self.clock() >= self.next_probe_s[env]:
            self.probing.add(env)
            self.num_probes += 1
            log.info("env %r is quarantined: probing it with one group", env)
            return True
        self.num_set_aside += 1
        return False

    def record(self, env: str, result: GroupResult) -> None:
        """A finished group of ``env``."""
        failed, error = group_error(result)
        if error:
            self.last_error[env] = error
        probe = env in self.probing
        self.probing.discard(env)
        if not failed:
            self.failed_in_a_row[env] = 0
            if self.next_probe_s.pop(env, None) is not None:
                log.warning("env %r recovered: a probe group succeeded; admitting it again", env)
            return
        self.failed_in_a_row[env] = self.failed_in_a_row.get(env, 0) + 1
        if env in self.next_probe_s:
            if probe:  # still failing: wait a whole interval again
                self.next_probe_s[env] = self.clock() + self.probe_every_s
            return
        if self.after and self.failed_in_a_row[env] >= self.after:
            self.next_probe_s[env] = self.clock() + self.probe_every_s
            self.num_quarantined += 1
            log.warning(
                "env %r quarantined after %d failed groups in a row: its prompts are set aside, "
                "one probe every %gs until one succeeds",
                env,
                self.failed_in_a_row[env],
                self.probe_every_s,
            )

    def gave_up(self) -> str | None:
        """The failure of the run once every env has been quarantined for ``give_up_s``."""
        if not self.envs or not self.envs <= self.next_probe_s.keys():
            self.all_since_s = None
            return None
        now = self.clock()
        if self.all_since_s is None:
            self.all_since_s = now
        if now - self.all_since_s < self.give_up_s:
            return None
        return (
            f"every environment has failed for {now - self.all_since_s:.0f}s (quarantined, "
            f"probed every {self.probe_every_s:g}s; sampling.env_quarantine_give_up_s = "
            f"{self.give_up_s:g}): "
            + "; ".join(
                f"{env}: {self.failed_in_a_row.get(env, 0)} failed groups in a row, last error "
                f"{self.last_error.get(env, '?')}"
                for env in sorted(self.envs)
            )
        )

    def wait_s(self) -> float:
        """Until the next probe is due (admission found only quarantined prompts)."""
        due = [t for env, t in self.next_probe_s.items() if env not in self.probing]
        return max(0.0, min(due) - self.clock()) if due else self.probe_every_s

    def quarantined(self) -> list[str]:
        return sorted(self.next_probe_s)

    def describe(self) -> str:
        """For a timeout message: which envs are set aside and how long they have failed."""
        if not self.next_probe_s:
            return ""
        return "; quarantined envs (failing, probed every {:g}s): {}".format(
            self.probe_every_s,
            ", ".join(
                f"{env} ({self.failed_in_a_row.get(env, 0)} failed groups in a row)"
                for env in self.quarantined()
            ),
        )


def disabled(clock: Callable[[], float]) -> EnvQuarantine:
    return EnvQuarantine(after=0, probe_every_s=math.inf, clock=clock)
