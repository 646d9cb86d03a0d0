"""A service the run depends on but does not own stops answering: the Prefect API, the object store.

Owns: watching each of them while a run runs (a probe every ``PROBE_EVERY_S``, one request under a
short deadline), the two lines a user sees (one when the service is noticed gone, one when it
answers again), and the bounded wait: past its deadline setting (``run.api_outage_timeout_s``,
``run.storage_outage_timeout_s``) the run stops as Ctrl-C stops it, with its resume line.

Invariant: one outage gives at most one "not answering" line and one "answering again" line,
however many probes fail; the stop comes once, from the watcher's thread, as ``OutageStop`` raised
in the main thread (``stop_main``). What the run does meanwhile is its own: steps wait for the API
(``Outage.wait_up``), and a storage request waits inside its client (s3fs's retries).
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime

PROBE_EVERY_S = 2.0
PROBE_TIMEOUT_S = 3.0
# Storage is noticed after this much silence (a slow PUT of a checkpoint is not an outage);
# the API at once (each of its probes is a /health on the loopback or the user's server).
STORAGE_NOTICE_S = 10.0
API_NOTICE_S = 0.0
TICK_S = 0.25  # how often a silent service's outage is looked at while a probe is out


class OutageStop(KeyboardInterrupt):
    """The run stops because a service it needs has not answered within its deadline setting;
    a KeyboardInterrupt so that the run unwinds (and the CLI prints its stop line) as on Ctrl-C."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Outage:
    """The state of one service, fed by probes (``answered``, ``failed``) with the time of each.

    ``down_line(since_wall, silent_s)`` is said once the service has been silent ``notice_s``;
    ``up_line(silent_s)`` when it answers after that; ``on_deadline(reason)`` is called once when
    it has been silent ``deadline_s`` (None: no deadline)."""

    def __init__(
        self,
        *,
        notice_s: float,
        deadline_s: float | None,
        down_line: Callable[[float, float], str],
        up_line: Callable[[float], str],
        stop_reason: Callable[[float], str],
        say: Callable[[str], None],
        on_deadline: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.notice_s, self.deadline_s = notice_s, deadline_s
        self.down_line, self.up_line, self.stop_reason = down_line, up_line, stop_reason
        self.say, self.on_deadline = say, on_deadline
        self.clock, self.wall = clock, wall
        self.silent_since: float | None = None  # monotonic time of the first failed probe
        self.silent_since_wall: float | None = None
        self.noticed = False
        self.stopped = False
        self.outages: list[float] = []  # seconds of each noticed outage, once it ended
        self._up = threading.Event()
        self._up.set()

    @property
    def down(self) -> bool:
        """Whether the service's outage has been noticed and has not ended."""
        return self.noticed

    def failed(self, since: float | None = None) -> None:
        """A probe got no answer; ``since``: when it was sent (default: now). Called again while
        the service stays silent, it says the line and stops the run when their times come."""
        now = self.clock()
        if self.silent_since is None:
            self.silent_since = now if since is None else min(since, now)
            self.silent_since_wall = self.wall() - (now - self.silent_since)
        silent = now - self.silent_since
        if not self.noticed and silent >= self.notice_s:
            self.noticed = True
            self._up.clear()
            self.say(self.down_line(self.silent_since_wall, silent))
        if self.deadline_s is not None and silent >= self.deadline_s and not self.stopped:
            self.stopped = True
            self.on_deadline(self.stop_reason(silent))

    def answered(self) -> None:
        if self.silent_since is None:
            return
        silent = self.clock() - self.silent_since
        if self.noticed:
            self.outages.append(silent)
            self.say(self.up_line(silent))
        self.silent_since = self.silent_since_wall = None
        self.noticed = False
        self._up.set()

    def wait_up(self, timeout_s: float | None = None) -> bool:
        """Block while a noticed outage lasts (at most ``timeout_s``); whether it is over."""
        return self._up.wait(timeout_s)


class Watch:
    """Probes a service every ``every_s`` in a daemon thread and feeds ``outage``. ``probe()``
    returns whether the service answered; one that raises, or has not returned within
    ``timeout_s``, did not."""

    def __init__(
        self,
        outage: Outage,
        probe: Callable[[], bool],
        every_s: float = PROBE_EVERY_S,
        timeout_s: float = PROBE_TIMEOUT_S,
        name: str = "outage-watch",
    ) -> None:
        self.outage, self.probe, self.every_s, self.timeout_s = outage, probe, every_s, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self.outage._up.set()  # nobody waits on a watch that ended

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = self.outage.clock()
            ok = self._probe_once(started)
            if self._stop.is_set():
                return
            if ok:
                self.outage.answered()
            else:
                self.outage.failed(since=started)
            self._stop.wait(max(0.0, self.every_s - (self.outage.clock() - started)))

    def _probe_once(self, started: float) -> bool:
        """One probe under ``timeout_s``, in a daemon thread (one that hangs is left behind);
        while it is out and the service already silent, the outage's clock still runs."""
        box: list[bool] = []

        def probe() -> None:
            try:
                box.append(bool(self.probe()))
            except Exception:
                box.append(False)

        thread = threading.Thread(target=probe, daemon=True, name=f"{self._thread.name}-probe")
        thread.start()
        while thread.is_alive() and self.outage.clock() - started < self.timeout_s:
            thread.join(TICK_S)
            if thread.is_alive() and self.outage.silent_since is not None:
                self.outage.failed()
        return bool(box and box[0])


def clock_time(wall: float) -> str:
    return datetime.fromtimestamp(wall).strftime("%H:%M:%S")


def api_outage(url: str, deadline_s: float | None, say, on_deadline, **clocks) -> Outage:
    """The Prefect API's outage: its lines, and the reason a run stops past ``deadline_s``."""
    return Outage(
        notice_s=API_NOTICE_S,
        deadline_s=deadline_s,
        down_line=lambda since, _: (
            f"Prefect API at {url} not answering since {clock_time(since)}; steps wait for it"
        ),
        up_line=lambda silent: f"Prefect API at {url} answering again after {silent:.0f} s",
        stop_reason=lambda silent: (
            f"Prefect API at {url} not answering for {silent:.0f} s "
            f"(run.api_outage_timeout_s = {deadline_s:g})"
        ),
        say=say,
        on_deadline=on_deadline,
        **clocks,
    )


def storage_outage(uri: str, deadline_s: float | None, say, on_deadline, **clocks) -> Outage:
    """The object store's outage: its lines, and the reason a run stops past ``deadline_s``."""
    return Outage(
        notice_s=min(STORAGE_NOTICE_S, deadline_s) if deadline_s else STORAGE_NOTICE_S,
        deadline_s=deadline_s,
        down_line=lambda _, silent: f"storage {uri} not answering for {silent:.0f} s; waiting",
        up_line=lambda silent: f"storage {uri} answering again after {silent:.0f} s",
        stop_reason=lambda silent: (
            f"storage {uri} not answering for {silent:.0f} s "
            f"(run.storage_outage_timeout_s = {deadline_s:g})"
        ),
        say=say,
        on_deadline=on_deadline,
        **clocks,
    )


# ------------------------------------------------------------------ the stop, in the main thread

_pending: list[str] = []
_STOP_SIGNAL = signal.SIGUSR2


def install_stop_handler() -> None:
    """In the main thread, before the run: ``stop_main`` raises ``OutageStop`` there."""

    def handler(signum, frame):
        if _pending:
            raise OutageStop(_pending[-1])

    signal.signal(_STOP_SIGNAL, handler)


def stop_main(reason: str) -> None:
    """Stop the run from any thread: ``OutageStop(reason)`` in the main thread (a plain
    KeyboardInterrupt where no handler was installed; ``pending_reason`` then says why)."""
    _pending.append(reason)
    # What still fails to reach the service on the way out is expected now: Prefect's log
    # worker would print "--- Error logging to API ---" and its error on the terminal (it
    # writes to stderr itself, under the stdlib's logging.raiseExceptions).
    logging.raiseExceptions = False
    installed = signal.getsignal(_STOP_SIGNAL)
    if callable(installed):
        # A real signal, not interrupt_main's flag: it also ends a blocking wait of the main
        # thread (a lock, a socket), where the flag would be seen only once the wait ends.
        signal.pthread_kill(threading.main_thread().ident, _STOP_SIGNAL)
    else:
        _thread.interrupt_main()


def pending_reason() -> str | None:
    return _pending[-1] if _pending else None


# ------------------------------------------------------------------ Prefect's client meanwhile


class _PatientTime:
    """``time`` for Prefect's sync client: a retry's back-off lasts while the API's outage does
    (up to its deadline), then at most ``cap_s``; past the deadline no back-off (the client's
    retries end at once and the run's stop is not held up by them)."""

    def __init__(self, module, outage: Outage, cap_s: float) -> None:
        self._module, self._outage, self._cap_s = module, outage, cap_s

    def __getattr__(self, name):
        return getattr(self._module, name)

    def sleep(self, seconds: float) -> None:
        outage = self._outage
        while outage.down and not outage.stopped:
            outage.wait_up(0.5)
        if not outage.stopped:
            self._module.sleep(min(seconds, self._cap_s))


class _PatientAnyio(_PatientTime):
    """The same for Prefect's async client (``anyio.sleep``)."""

    async def sleep(self, seconds: float) -> None:
        outage = self._outage
        while outage.down and not outage.stopped:
            await self._module.sleep(0.5)
        if not outage.stopped:
            await self._module.sleep(min(seconds, self._cap_s))


class patient_prefect_client:
    """While the block runs, Prefect's clients in this process retry a request through the API's
    outage (Prefect alone backs off 2, 4, ... 32 s and gives up after ~62 s, failing the step
    whose request it was; and its last back-offs held a step up to 32 s after the API was back).
    """

    def __init__(self, outage: Outage, cap_s: float = PROBE_EVERY_S) -> None:
        self.outage, self.cap_s = outage, cap_s

    def __enter__(self) -> patient_prefect_client:
        import anyio
        import prefect.client.base as base

        self._base = base
        self._saved = (base.anyio, base.time)
        base.anyio = _PatientAnyio(anyio, self.outage, self.cap_s)
        base.time = _PatientTime(time, self.outage, self.cap_s)
        return self

    def __exit__(self, *exc_info) -> None:
        # After a stop for the outage, the patch stays: what the run still reports on its way out
        # (Prefect marks its flow runs crashed) fails at once instead of backing off ~62 s.
        if not self.outage.stopped:
            self._base.anyio, self._base.time = self._saved
