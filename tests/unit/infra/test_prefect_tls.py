"""Prefect's clients share one TLS context per settings instead of loading the CA bundle each
(infra/prefect_tls.py)."""

from __future__ import annotations

import ssl

from prefect.client.orchestration import PrefectClient, SyncPrefectClient
from prefect.settings import PREFECT_API_TLS_INSECURE_SKIP_VERIFY, temporary_settings

from rollflow.infra.prefect_tls import prefect_tls_context, share_tls_context


def context_of(client) -> ssl.SSLContext:
    return client._client._transport._pool._ssl_context


def test_every_client_shares_the_context_prefect_would_build():
    import rollflow.flows.rl_run  # noqa: F401  (where the run's processes install it)

    assert getattr(PrefectClient.__init__, "_rollflow_shared_tls", False)
    assert getattr(SyncPrefectClient.__init__, "_rollflow_shared_tls", False)
    share_tls_context()
    share_tls_context()  # idempotent: one wrapper
    assert not getattr(PrefectClient.__init__.__wrapped__, "_rollflow_shared_tls", False)

    one = PrefectClient("http://127.0.0.1:1/api")
    other = SyncPrefectClient("https://127.0.0.1:1/api")
    assert context_of(one) is context_of(other) is prefect_tls_context()
    # Prefect's default: the server's certificate and name are checked.
    assert context_of(one).verify_mode == ssl.CERT_REQUIRED and context_of(one).check_hostname

    with temporary_settings({PREFECT_API_TLS_INSECURE_SKIP_VERIFY: True}):
        insecure = PrefectClient("http://127.0.0.1:1/api")
        again = SyncPrefectClient("http://127.0.0.1:1/api")
    assert context_of(insecure) is context_of(again) is not context_of(one)
    assert context_of(insecure).verify_mode == ssl.CERT_NONE

    own = ssl.create_default_context()
    assert (
        context_of(PrefectClient("http://127.0.0.1:1/api", httpx_settings={"verify": own})) is own
    )
