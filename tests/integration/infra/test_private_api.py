"""The private Prefect API (``local_prefect_api``, here the suite's session API) starts without
registering block types: no collection is imported for them and none is written into its
database; a block saved through it registers its own type and loads back."""

from __future__ import annotations

import os

import httpx

from run_support import session_prefect_api


def test_no_block_types_at_start_and_a_saved_block_loads_back():
    api = session_prefect_api()
    # prefect-kubernetes's and prefect-docker's block types: registered at start before.
    for slug in ("kubernetes-cluster-config", "docker-registry-credentials"):
        assert httpx.get(f"{api}/block_types/slug/{slug}", timeout=10).status_code == 404, slug
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}):
        name = f"private-api-{os.getpid()}"
        Secret(value="s3cret").save(name, overwrite=True)
        assert Secret.load(name).get() == "s3cret"
        from prefect.events.worker import EventsWorker

        EventsWorker.drain_all(timeout=10)  # the save's events, sent while the API is up
    assert httpx.get(f"{api}/block_types/slug/secret", timeout=10).status_code == 200
