"""Fixtures of the unit tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture
def prefect_pools(monkeypatch):
    """The Prefect API's deployments and work pools, faked: ``prefect_pools({pool: template})``
    makes deployment ``<flow>/<pool>`` exist on each pool given (with that base job template);
    any other deployment is not found."""
    import prefect.client.orchestration
    from prefect.exceptions import ObjectNotFound

    def install(pools: dict[str, dict]) -> None:
        class Client:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def read_deployment_by_name(self, name):
                pool = name.split("/", 1)[1]
                if pool not in pools:
                    raise ObjectNotFound(http_exc=Exception(name))
                return SimpleNamespace(work_pool_name=pool)

            def read_work_pool(self, name):
                return SimpleNamespace(base_job_template=pools[name])

        monkeypatch.setattr(prefect.client.orchestration, "get_client", lambda **kw: Client())

    return install
