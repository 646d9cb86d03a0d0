"""The integration tests' reads of the Prefect API (``deployed_run.prefect_api``) against a loaded
server: a slow answer or a 503 is tried again until the read's deadline, other errors are not.

A 10-second read of a flow run's state, while the whole suite shared two cores with the two-host
run's server, failed that run's test in CI (a ReadTimeout) though the run itself went on."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from deployed_run import prefect_api


@pytest.fixture
def server():
    """A stand-in Prefect API answering from a script: one entry per request, ``("slow", s)`` to
    answer after ``s`` seconds, else ``(status, body)``."""
    script: list = []
    seen: list[tuple[str, str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            seen.append((self.command, self.path, self.rfile.read(length)))
            entry = script.pop(0)
            if entry[0] == "slow":
                time.sleep(entry[1])
                entry = (200, {"late": True})
            body = json.dumps(entry[1]).encode()
            self.send_response(entry[0])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}/api", script, seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_read_slower_than_one_try_is_tried_again(server):
    api, script, seen = server
    script += [("slow", 1.5), (200, {"state": {"type": "RUNNING"}})]
    assert prefect_api(api, "/flow_runs/x", try_s=0.5, deadline_s=10) == {
        "state": {"type": "RUNNING"}
    }
    assert [(method, path) for method, path, _ in seen] == [("GET", "/api/flow_runs/x")] * 2


def test_a_busy_server_is_asked_again_and_a_filter_is_posted(server):
    api, script, seen = server
    script += [(503, "database is locked"), (200, [{"id": "a"}])]
    query = {"flows": {"name": {"any_": ["rl-run"]}}}
    assert prefect_api(api, "/flow_runs/filter", query, try_s=5, deadline_s=10) == [{"id": "a"}]
    assert [(m, json.loads(body)) for m, _, body in seen] == [("POST", query)] * 2


def test_other_errors_are_raised_at_once(server):
    api, script, seen = server
    script += [(404, {"detail": "Flow run not found"}), (200, {})]
    with pytest.raises(httpx.HTTPStatusError, match="404"):
        prefect_api(api, "/flow_runs/missing", try_s=5, deadline_s=10)
    assert len(seen) == 1


def test_no_answer_by_the_deadline_names_the_path(server):
    api, script, _ = server
    script += [("slow", 1.0)] * 4
    with pytest.raises(TimeoutError, match=r"Prefect API /logs/filter: no answer within 2s"):
        prefect_api(api, "/logs/filter", {"logs": {}}, try_s=0.3, deadline_s=2)
