"""``rollflow ui``'s addresses: what it checks and prints, and what the UI's pages call."""

from __future__ import annotations

import pytest

from rollflow.infra.prefect_ui import local_url, server_env, ui_api_url

# A bind address, never a destination.
EVERY_INTERFACE = "0.0.0.0"  # not connected to


@pytest.mark.parametrize(
    ("host", "local", "api"),
    [
        ("127.0.0.1", "http://127.0.0.1:4200", "http://127.0.0.1:4200/api"),
        ("192.0.2.5", "http://192.0.2.5:4200", "http://192.0.2.5:4200/api"),
        ("::1", "http://[::1]:4200", "http://[::1]:4200/api"),
        # Every interface: checked on loopback; the pages call the address they were opened at.
        (EVERY_INTERFACE, "http://127.0.0.1:4200", "/api"),
        ("::", "http://[::1]:4200", "/api"),
    ],
)
def test_a_server_is_reached_locally_and_by_its_pages_at_an_address_that_works(host, local, api):
    assert local_url(host, 4200) == local
    assert ui_api_url(host, 4200) == api
    assert server_env(host, 4200)["PREFECT_UI_API_URL"] == api
