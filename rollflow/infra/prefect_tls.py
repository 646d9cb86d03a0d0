"""One TLS context for every Prefect client of a process, instead of one per client.

Prefect 3.7 builds a new ``ssl.SSLContext`` in each ``PrefectClient`` and ``SyncPrefectClient``
it makes, loading the whole CA bundle (certifi's, or ``PREFECT_API_SSL_CERT_FILE``) each time,
and it makes a client per subflow it starts (the task run that tracks a step's flow run) and per
``get_client()`` outside a client context. On the project's 2 cores that load took 59-64 ms of
CPU per context (``ssl.create_default_context(cafile=certifi.where())``, median of 20), once per
step of a run at least: with a step of ~1.2 s, about 5% of the run process's CPU, for a local API
that speaks plain HTTP and never uses the context. Prefect's own pull request #19106 ("allow
using custom SSL contexts", open) proposes the same sharing.

``share_tls_context()`` wraps both clients' ``__init__``: a client given no ``verify`` in its
``httpx_settings`` gets the context Prefect would have built (same settings: the CA file, or
``PREFECT_API_TLS_INSECURE_SKIP_VERIFY``), built once per such settings and shared. A client given
its own ``verify`` keeps it. An ``SSLContext`` is safe to share between connections and threads
(httpx shares one between all connections of a client already). The run flow's module installs
it (``flows/rl_run.py``).
"""

from __future__ import annotations

import functools
import ssl
import threading

_CONTEXTS: dict[tuple[bool, str], ssl.SSLContext] = {}
_LOCK = threading.Lock()
_MARK = "_rollflow_shared_tls"


def prefect_tls_context() -> ssl.SSLContext:
    """The context Prefect's client would build for the current settings, built once per them."""
    import certifi
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

    skip = bool(PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value())
    key = (skip, "" if skip else (PREFECT_API_SSL_CERT_FILE.value() or certifi.where()))
    with _LOCK:
        ctx = _CONTEXTS.get(key)
        if ctx is None:
            if skip:  # as Prefect: no check of the server's certificate or name
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            else:
                ctx = ssl.create_default_context(cafile=key[1])
            _CONTEXTS[key] = ctx
        return ctx


def share_tls_context() -> None:
    """Make every Prefect client of this process share ``prefect_tls_context()`` (idempotent)."""
    from prefect.client.orchestration import PrefectClient, SyncPrefectClient

    for cls in (PrefectClient, SyncPrefectClient):
        original = cls.__init__
        if getattr(original, _MARK, False):
            continue

        @functools.wraps(original)
        def __init__(self, *args, httpx_settings=None, _original=original, **kwargs):
            if not httpx_settings or "verify" not in httpx_settings:
                httpx_settings = {**(httpx_settings or {}), "verify": prefect_tls_context()}
            _original(self, *args, httpx_settings=httpx_settings, **kwargs)

        setattr(__init__, _MARK, True)
        cls.__init__ = __init__
