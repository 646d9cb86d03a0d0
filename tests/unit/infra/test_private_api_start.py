"""`rollflow run` imports the run flow's modules (~7 s here) while its private Prefect API starts,
not before (infra/prefect_api.py, ``local_prefect_api(meanwhile=...)``)."""

from __future__ import annotations

from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

from rollflow.infra import prefect_api


def test_the_work_given_runs_between_the_servers_start_and_its_health(monkeypatch, tmp_path):
    calls = []

    class Server:  # the private API's process, as local_prefect_api drives it
        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            calls.append("start")

        def wait_healthy(self, check, timeout_s):
            calls.append("healthy")

        def stop(self, timeout_s):
            calls.append("stop")

    monkeypatch.setattr(prefect_api, "ManagedProcess", Server)
    monkeypatch.setattr(prefect_api, "_drain_prefect_workers", lambda timeout_s: None)
    with temporary_settings(
        updates={PREFECT_HOME: str(tmp_path)}, restore_defaults={PREFECT_API_URL}
    ):
        with prefect_api.local_prefect_api(meanwhile=lambda: calls.append("meanwhile")) as url:
            calls.append("block")
    assert url.startswith("http://127.0.0.1:")
    assert calls == ["start", "meanwhile", "healthy", "block", "stop"]

    calls.clear()  # a configured API: no server, the work still runs before the block
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        with prefect_api.local_prefect_api(meanwhile=lambda: calls.append("meanwhile")) as url:
            calls.append("block")
    assert url == "http://127.0.0.1:9/api" and calls == ["meanwhile", "block"]
