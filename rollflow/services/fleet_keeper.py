"""The run's vLLM fleet, kept at the size asked of it: a supervisor per server, grown and shrunk
one server at a time toward the size ``rollflow scale`` wrote in the run's storage.

Owns: the fleet's supervisors (in slot order), the server that is joining, and the joins that
failed for each size asked. The fleet's membership itself (``infra/vllm_fleet/fleet.py``) is
what every sampler follows: a server is a member once it is in the weight group and holds the
policy the others serve, and stops being one before it is stopped.

Invariant: membership changes only under the weight group's turn, and the group is formed anew
with every server of the fleet at each change; a size whose joins failed ``JOIN_TRIES`` times is
not tried again until another size is asked. Main thread only: a server dies with the thread
that spawned it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rollflow.infra.errors import ServiceError
from rollflow.infra.events import Event, publish
from rollflow.infra.vllm_fleet.fleet import Fleet, asked_servers, record_fleet
from rollflow.services.run_parts import RunParts
from rollflow.services.vllm_supervisor import InferenceSupervisor, WeightLink
from rollflow.services.weight_link import WeightGroupLink

JOIN_TRIES = 3  # failed joins of a server before the fleet stops trying to grow to that size


class FleetKeeper:
    """The fleet's servers and their reconciliation toward the size asked."""

    def __init__(
        self,
        parts: RunParts,
        link: WeightGroupLink,
        supervisor: Callable[[int], InferenceSupervisor],
        trainer: Callable[[], object],
    ):
        """``supervisor(slot)``: the (unstarted) supervisor of plan slot ``slot``'s server;
        ``trainer()``: the trainer's client now (it changes when the trainer restarts)."""
        self.cfg, self.plan, self.storage, self.link = parts.cfg, parts.plan, parts.storage, link
        self.supervisor, self.trainer, self.progress = supervisor, trainer, parts.progress
        self.supervisors: list[InferenceSupervisor] = []
        self.fleet = Fleet()
        self._joining: _Joining | None = None
        self._asked_error: str | None = None  # a bad control file, said once
        self._join_failures: dict[int, int] = {}  # fleet size asked → joins that failed for it
        self._join_target = 0  # the size the last join was for

    # ---------------------------------------------------------------- the group

    def servers(self) -> list[tuple[str, int]]:
        """(url, first weight-group rank) of every server: after the trainer's rank 0, each
        server's workers in slot order."""
        out, rank = [], 1
        for sup in self.supervisors:
            out.append((sup.url, rank))
            rank += len(self.plan.servers[sup.index].weight_ranks)
        return out

    def num_workers(self) -> int:
        return sum(len(self.plan.servers[sup.index].weight_ranks) for sup in self.supervisors)

    def rejoin(self) -> int:
        """The group formed anew with every server (a server joined, left or restarted)."""
        return self.link.rejoin(self.trainer(), self.servers(), self.num_workers())

    def moved(self, slot: int, url: str) -> None:
        """Server ``slot`` came back at ``url`` after a restart (a pool placed its flow run on
        another host): the fleet follows it (under the group's lock, which the restart holds)."""
        self.fleet.add(slot, url)
        self.record()

    def record(self) -> None:
        record_fleet(self.storage, self.cfg.inference.fleet_slots(), self.fleet)

    # ------------------------------------------------------------ its size

    def first_size(self) -> int:
        """How many servers the run starts with: the size last asked of the fleet
        (``rollflow scale``: a rerun keeps it), else ``inference.num_servers``."""
        return self.asked() or self.cfg.inference.num_servers

    def asked(self) -> int | None:
        """The fleet size asked, within 1..``inference.fleet_slots()`` (None: nothing asked, or
        a bad control file). What is wrong with the ask is said once, while it stays so."""
        try:
            asked = asked_servers(self.storage)
        except ValueError as exc:
            self._say_bad_control(str(exc))
            return None
        slots = self.cfg.inference.fleet_slots()
        if asked is not None and asked > slots:
            self._say_bad_control(
                f"{asked} servers were asked but the plan has {slots} slot(s) "
                f"(inference.max_servers = {self.cfg.inference.max_servers}); growing to {slots}"
            )
            return slots
        self._asked_error = None
        return asked

    def _say_bad_control(self, message: str) -> None:
        if message != self._asked_error:
            self._asked_error = message
            self.progress(f"fleet: {message}")

    def reconcile(self) -> None:
        """Grow or shrink the fleet toward the size asked, one server at a time. A server starts
        in the background and joins at a later call once healthy; a leaving one is a dead server
        first (a preempted one is not restarted when the fleet is to shrink), else the newest."""
        target = self.asked()
        if self._joining is not None:
            if target is not None and target <= len(self.supervisors):
                self._cancel_join("the fleet was asked to shrink meanwhile")
            elif self._joining.done():
                self._finish_join()
            return
        if target is None or target == len(self.supervisors):
            return
        if target > len(self.supervisors):
            if self._join_failures.get(target, 0) < JOIN_TRIES:
                self._join_target = target
                self._begin_join()
        else:
            self._leave(*self._leaver())

    # ----------------------------------------------------------------- joins

    def _begin_join(self) -> None:
        taken = {sup.index for sup in self.supervisors}
        slot = min(set(range(self.cfg.inference.fleet_slots())) - taken)
        sup = self.supervisor(slot)
        self.progress(f"fleet: starting {sup.name} ({len(taken) + 1} server(s) asked)")
        sup.spawn()
        self._joining = _Joining(sup)

    def _cancel_join(self, why: str) -> None:
        joining, self._joining = self._joining, None
        self.progress(f"fleet: {joining.sup.name} stopped before joining: {why}")
        joining.sup.server.stop(timeout_s=10.0)

    def _finish_join(self) -> None:
        """The started server is healthy (or failed to start): join it to the weight group with
        every server, give all of them the trainer's weights, then let sampling in."""
        joining, self._joining = self._joining, None
        sup = joining.sup
        if joining.error is not None:
            self._join_failed(sup, "did not start", joining.error)
            return
        with self.link.turn(f"{sup.name} joining"):  # no sync meanwhile: the group changes
            self.supervisors = sorted([*self.supervisors, sup], key=lambda s: s.index)
            try:
                version = self.rejoin()
            except Exception as exc:
                # The group is formed again without it; only if that fails too is the run lost.
                self.supervisors.remove(sup)
                sup.server.stop(timeout_s=10.0)
                try:
                    self.rejoin()
                except Exception as again:
                    raise ServiceError(
                        f"{sup.name} could not join the weight group ({exc}), and the group "
                        f"could not be formed again without it: {again}"
                    ) from again
                self._join_failed(sup, "could not join the weight group", exc)
                return
            sup.open_gate(self.weight_link_of_servers())
            self.fleet.add(sup.index, sup.url)
        join_s = joining.elapsed()
        self._changed(
            f"fleet: {sup.name} joined in {join_s:.0f}s, serving policy version {version}; "
            f"{len(self.supervisors)} server(s)",
            joined=sup.index,
            url=sup.url,
            join_s=join_s,
            version=version,
        )

    def _join_failed(self, sup: InferenceSupervisor, why: str, error: BaseException) -> None:
        """Say and record a join that failed, and count it toward the size it was for (asking
        another size starts anew); at ``JOIN_TRIES`` the fleet stops trying that size."""
        target = self._join_target
        failures = self._join_failures.get(target, 0) + 1
        self._join_failures = {target: failures}
        self.progress(f"fleet: {sup.name} {why}, the fleet stays as it is: {error}")
        if failures == JOIN_TRIES:
            self.progress(
                f"fleet: {target} servers asked, {len(self.supervisors)} serve: {JOIN_TRIES} "
                "joins failed; ask another size to try again"
            )
        publish(
            self.storage,
            Event.FLEET_CHANGED,
            servers=len(self.supervisors),
            failed=sup.index,
            error=str(error),
        )

    # ---------------------------------------------------------------- leaves

    def _leaver(self) -> tuple[InferenceSupervisor, bool]:
        """Which server leaves: one that does not serve (preempted: dead or not answering),
        else the newest; and whether it was preempted."""
        down = [sup for sup in self.supervisors if not sup.serving()]
        return (down or self.supervisors)[-1], bool(down)

    def _leave(self, sup: InferenceSupervisor, preempted: bool) -> None:
        """Take ``sup``'s server out: no new request, its requests in flight retried on the
        others, the weight group formed anew without it."""
        start = time.monotonic()
        with self.link.turn(f"{sup.name} leaving"):
            self.fleet.remove(sup.index)
            self.supervisors.remove(sup)
            sup.retire(timeout_s=10.0)
            version = self.rejoin()
        leave_s = time.monotonic() - start
        self._changed(
            f"fleet: {sup.name} left{' (it was down: preempted)' if preempted else ''} in "
            f"{leave_s:.0f}s; {len(self.supervisors)} server(s) serve policy version {version}",
            left=sup.index,
            preempted=preempted,
            leave_s=leave_s,
            version=version,
        )

    def _changed(self, said: str, **info) -> None:
        """A server joined or left: recorded in the run's storage and its events, and said."""
        self.record()
        publish(self.storage, Event.FLEET_CHANGED, servers=len(self.supervisors), **info)
        self.progress(said)

    # ------------------------------------------------------------ life

    def weight_link_of_servers(self) -> WeightLink:
        """What a supervisor needs of the weight group to restart its server."""
        return WeightLink(rejoin=self.rejoin, lock=self.link.lock, moved=self.moved)

    def dead_server(self) -> ServiceError | None:
        """The error naming a server whose process died, None while all live."""
        for sup in self.supervisors:
            server = sup.server
            if not server.is_alive():
                return ServiceError(f"{sup.name} died ({server.ended()}); see {server.log_path}")
        return None

    def stop_joining(self) -> None:
        """Stop a server that was starting to join (teardown)."""
        if self._joining is not None:
            self._joining, joining = None, self._joining
            joining.sup.server.stop(timeout_s=10.0)


class _Joining:
    """A server started to join the fleet, waited for in the background (only the wait: it was
    spawned on the main thread)."""

    def __init__(self, sup: InferenceSupervisor):
        self.sup, self.error = sup, None
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._wait, name=f"join-{sup.index}", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        try:
            self.sup.wait_ready()
        except Exception as exc:  # noqa: BLE001 - said by the run's services
            self.error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def elapsed(self) -> float:
        return time.monotonic() - self._start
