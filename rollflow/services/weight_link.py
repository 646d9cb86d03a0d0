"""The run's weight group between the trainer and the fleet's servers, as the run keeps it.

Owns: the group's spec (what every member agrees on; its world size follows the fleet), its lock
(one sync, re-join, join or leave of a server at a time), and whether it is formed, so that
teardown closes it exactly when it was (partly) formed. The transfers themselves are
``tasks/sync/weights.py``'s; this class says when, and with whom.

Invariant: every change of the group's membership (a server joining, leaving or restarting, the
trainer restarted) forms it anew with every server of the fleet, under the lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence

from rollflow.infra.errors import ServiceError, WeightSyncError
from rollflow.tasks.sync import weights
from rollflow.tasks.sync.weights import GroupSpec

Servers = Sequence[tuple[str, int]]  # (url, first weight-group rank) of each server


class WeightGroupLink:
    """The trainer (rank 0) and every server's workers (ranks after it, in slot order)."""

    def __init__(self, spec: GroupSpec, timeout_s: float, request_timeout_s: float):
        self.spec, self.timeout_s, self.request_timeout_s = spec, timeout_s, request_timeout_s
        self.lock = threading.Lock()
        self.formed = False

    def meet_at(self, host: str) -> None:
        """The trainer's rank 0 hosts the group's store at ``host`` (a placed node 0 says where
        once it starts; a restarted one may be elsewhere)."""
        self.spec = dataclasses.replace(self.spec, host=host)

    def spec_for(self, num_workers: int) -> GroupSpec:
        """The group as it is with ``num_workers`` vLLM workers beside the trainer."""
        return dataclasses.replace(self.spec, world_size=1 + num_workers)

    def join(self, trainer, servers: Servers, num_workers: int) -> None:
        """Form the group for the first time: the trainer and every server's workers."""
        self.formed = True  # (partly) formed from here on: teardown closes it
        weights.join(trainer, servers, self.spec_for(num_workers), self.timeout_s)

    def publish(self, trainer, urls: Sequence[str], version: int) -> None:
        """Give every server the trainer's weights as ``version`` (servers started before the
        run serve whatever they were started with until then)."""
        weights.publish(trainer, urls, version, self.timeout_s)

    def rejoin(self, trainer, servers: Servers, num_workers: int) -> int:
        """Form the group anew (a server joined, left or restarted) and give every server the
        trainer's last finished weights; returns their version."""
        spec = self.spec_for(num_workers)
        return weights.rejoin(trainer, servers, spec, self.timeout_s, self.request_timeout_s)

    def reform_after_trainer_restart(
        self, trainer, servers: Servers, num_workers: int, version: int
    ) -> None:
        """A new trainer joins the servers, which may still wait in the lost trainer's
        broadcast (on NCCL, up to its timeout): leaving the group first waits that out."""
        urls = [url for url, _ in servers]
        with contextlib.suppress(WeightSyncError):
            weights.leave(trainer, urls, timeout_s=self.timeout_s)
        weights.join(trainer, servers, self.spec_for(num_workers), self.timeout_s)
        self.publish(trainer, urls, version)

    def close(self, trainer, urls: Sequence[str], said: Callable[[str], None]) -> None:
        """Close the group on every side where it was formed; a dead peer is said, not raised."""
        if not self.formed:
            return
        self.formed = False
        try:
            weights.leave(trainer, urls, timeout_s=5.0)
        except Exception as exc:  # noqa: BLE001 - a dead peer must not block teardown
            said(f"teardown: {exc}")

    @contextlib.contextmanager
    def turn(self, what: str) -> Iterator[None]:
        """The group's lock, within the longest a sync holding it may take."""
        timeout_s = 2 * self.timeout_s + 30.0
        if not self.lock.acquire(timeout=timeout_s):
            raise ServiceError(f"{what}: the weight group stayed busy for {timeout_s:.0f}s")
        try:
            yield
        finally:
            self.lock.release()
