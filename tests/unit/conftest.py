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


@pytest.fixture
def loopback_only(monkeypatch):
    """Any name but the loopback's fails to resolve, so an S3 client that misses its endpoint
    fails at once instead of reaching AWS; no storage endpoint or secret comes from the
    environment, and s3fs clients are made anew for each test (s3fs keeps them by options, with
    the credentials and endpoint they found)."""
    import logging
    import socket

    import s3fs

    from rollflow.infra.secrets import SECRETS_ENV

    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise socket.gaierror(f"test: {host} is not loopback")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(logging.getLogger("werkzeug"), "level", logging.ERROR)  # moto's access log
    monkeypatch.delenv(SECRETS_ENV, raising=False)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()
