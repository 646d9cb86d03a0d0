"""`rollflow status`, `export` and `scale` on a run in object storage (moto's S3 on 127.0.0.1):
reached with the run's storage options, and each way of failing to reach it is one line, before
the probe's backstop deadline, never a traceback. No address other than loopback is ever contacted."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
import time

import pytest

from rollflow.cli import main
from rollflow.infra.config import dump_config, validate_config
from rollflow.infra.storage import RunStorage
from rollflow.infra.storage_access import PROBE_DEADLINE_S, RunAddress, storage_problem
from rollflow.infra.vllm_fleet.fleet import asked_servers

ROOT = "s3://rollflow/cli"
COMMANDS = {
    "status": ["status"],
    "export": ["export", "--step", "1"],
    "scale": ["scale", "--servers", "1"],
}


pytestmark = pytest.mark.usefixtures("loopback_only")


@pytest.fixture(scope="module")
def s3_run(s3_endpoint) -> str:
    """Run ``done`` in moto: a config, two steps' metrics, a committed checkpoint of step 1."""
    storage = RunStorage(ROOT, "done", {"endpoint_url": s3_endpoint})
    cfg = validate_config(
        {"model": {"path": "unused"}, "envs": [{"name": "add"}], "inference": {"max_servers": 2}}
    )
    storage.write_json("config.json", dump_config(cfg))
    for step in (1, 2):
        storage.write_metrics(step, {"reward_mean": 0.5 + step / 10, "num_groups_kept": 8})
    folder = storage.step_dir("checkpoints", 1)
    storage.fs.pipe_file(f"{folder}/config.json", b'{"model_type": "llama"}')
    storage.fs.pipe_file(f"{folder}/model.safetensors", b"weights")
    storage.commit("checkpoints", 1)
    return s3_endpoint


@pytest.fixture
def credentials(monkeypatch) -> None:
    """Credentials as a user's environment has them (an endpoint of the test's own)."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(name, value)


def closed_port() -> str:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def one_error_line(capsys, argv: list[str]) -> str:
    """Run the CLI; it must fail with exit 2 and one ``error:`` line, before the probe's backstop
    deadline could have hung it (a slow but answering endpoint on loaded cores is not a hang)."""
    began = time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - began < PROBE_DEADLINE_S + 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.err
    return lines[0]


def no_credentials(monkeypatch) -> None:
    """No AWS credentials anywhere botocore looks, and no instance-metadata lookups."""
    import os

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# ---------------------------------------------------------------- reaching the run


def test_status_reads_a_run_in_s3_given_its_endpoint(s3_run, capsys):
    argv = ["status", "done", "--storage", ROOT, "--storage-option", f"endpoint_url={s3_run}"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["step", "reward", "eval"]
    assert [line.split()[:2] for line in lines[1:3]] == [["1", "0.600"], ["2", "0.700"]]
    assert lines[-1] == f"1 steps committed (last: 1); data in {ROOT}/done"


def test_the_endpoint_may_come_from_the_environment_as_botocore_reads_it(
    s3_run, capsys, monkeypatch
):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_run)
    assert main(["status", "done", "--storage", ROOT]) == 0
    assert "1 steps committed" in capsys.readouterr().out


def test_the_runs_config_gives_name_storage_and_options(s3_run, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        f'[run]\nname = "done"\nstorage = "{ROOT}"\n'
        f'storage_options = {{ endpoint_url = "{s3_run}" }}\n'
        '[model]\npath = "unused"\n[[envs]]\nname = "add"\n'
    )
    assert main(["status", "--config", str(config)]) == 0
    assert f"data in {ROOT}/done" in capsys.readouterr().out
    assert main(["scale", "--config", str(config), "--servers", "2"]) == 0
    assert "asked run 'done' for 2 vLLM server(s)" in capsys.readouterr().out
    out = tmp_path / "model"
    assert main(["export", "--config", str(config), "--step", "1", "--out", str(out)]) == 0
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert asked_servers(RunStorage(ROOT, "done", {"endpoint_url": s3_run})) == 2
    # The flags win over the config: another endpoint, named as the flag.
    line = one_error_line(
        capsys,
        ["status", "--config", str(config), "--storage-option", f"endpoint_url={closed_port()}"],
    )
    assert "check --storage-option endpoint_url=URL" in line
    config.write_text(config.read_text().replace(s3_run, closed_port()))
    line = one_error_line(capsys, ["status", "--config", str(config)])
    assert f"check run.storage_options.endpoint_url in {config} and that the service" in line


# ------------------------------------------------------------ each failure, one line


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unreachable_endpoint_is_one_line_naming_the_option(command, capsys):
    url = closed_port()
    argv = [
        *COMMANDS[command],
        "done",
        "--storage",
        ROOT,
        "--storage-option",
        f"endpoint_url={url}",
    ]
    line = one_error_line(capsys, argv)
    assert line.startswith(f"error: storage {ROOT}: {url} is unreachable (Could not connect")
    assert line.endswith("check --storage-option endpoint_url=URL and that the service is up")


@pytest.mark.parametrize("command", COMMANDS)
def test_missing_credentials_are_one_line_naming_the_variables(
    s3_run, command, capsys, monkeypatch
):
    no_credentials(monkeypatch)
    argv = [*COMMANDS[command], "done", "--storage", ROOT, "--storage-option"]
    line = one_error_line(capsys, [*argv, f"endpoint_url={s3_run}"])
    assert line.startswith(f"error: storage {ROOT}: no S3 credentials found; set AWS_ACCESS_KEY_ID")
    # As the issue met it: no endpoint either (nothing is sent: signing fails first).
    assert one_error_line(capsys, [*COMMANDS[command], "done", "--storage", ROOT]) == line


@pytest.mark.parametrize("command", COMMANDS)
def test_no_such_run_or_bucket_is_one_line_naming_the_storage(s3_run, command, capsys):
    option = ["--storage-option", f"endpoint_url={s3_run}"]
    line = one_error_line(capsys, [*COMMANDS[command], "ghost", "--storage", ROOT, *option])
    assert line == (
        f"error: no run 'ghost' in {ROOT} (nothing at {ROOT}/ghost); check the run's name and "
        "--storage (the run's run.storage)"
    )
    line = one_error_line(capsys, [*COMMANDS[command], "done", "--storage", "s3://nobkt", *option])
    assert line == (
        "error: storage s3://nobkt: the bucket 'nobkt' does not exist; check --storage (the "
        "run's run.storage)"
    )


def test_an_endpoint_that_never_answers_is_one_request_timing_out_not_the_deadline(
    capsys, credentials
):
    """The probe sends one request and the request's own read timeout answers: botocore's
    ``max_attempts`` counts retries (1 meant two requests, 2 x 2 s), and the whole-probe
    deadline is only a backstop."""
    with socket.socket() as server:  # accepts connections, never replies
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        server.settimeout(0.2)
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        accepted: list[socket.socket] = []
        done = threading.Event()

        def accept() -> None:
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    accepted.append(server.accept()[0])

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        began = time.monotonic()
        line = one_error_line(
            capsys, ["status", "done", "--storage", ROOT, "--storage-option", f"endpoint_url={url}"]
        )
        waited = time.monotonic() - began
        done.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
    assert line.startswith(f"error: storage {ROOT}: no answer from {url} (Read timeout on endpoint")
    assert len(accepted) == 1, f"{len(accepted)} connections: the probe retried"
    assert waited < PROBE_DEADLINE_S, "the backstop answered, not the request's timeout"


def test_a_slow_endpoint_is_waited_for_not_called_silent(capsys, credentials):
    """An endpoint that answers each request after 2.5 s (beyond the old 2 s read timeout; moto
    beside the suite's vLLM servers took 2+ s for a 404) is answered by what it says."""
    slow_s = 2.5

    class Slow(http.server.BaseHTTPRequestHandler):
        def answer(self, body: bytes) -> None:
            time.sleep(slow_s)
            self.send_response(404)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's names)
            self.answer(b"")

        def do_GET(self) -> None:  # noqa: N802
            self.answer(
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchBucket</Code>"
                b"<Message>The specified bucket does not exist</Message></Error>"
            )

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        argv = ["status", "done", "--storage", "s3://nobkt", "--storage-option"]
        line = one_error_line(capsys, [*argv, f"endpoint_url={url}"])
    finally:
        server.shutdown()
        server.server_close()
    assert line == (
        "error: storage s3://nobkt: the bucket 'nobkt' does not exist; check --storage (the "
        "run's run.storage)"
    )


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("key=AKIA123", "--storage-option key: credentials never go on a command line"),
        (
            "client_kwargs.aws_secret_access_key=x",
            "--storage-option client_kwargs.aws_secret_access_key: credentials never go on",
        ),
        ("endpoint_url", "--storage-option 'endpoint_url': give KEY=VALUE, e.g. endpoint_url="),
        ("foo=1", f"storage {ROOT}: the storage options were not accepted (TypeError: "),
    ],
)
def test_credentials_and_malformed_options_are_refused_before_any_request(option, expected, capsys):
    line = one_error_line(capsys, ["status", "done", "--storage", ROOT, "--storage-option", option])
    assert line.startswith(f"error: {expected}")
    assert "AKIA123" not in line


def test_a_command_without_a_run_asks_for_one(capsys):
    line = one_error_line(capsys, ["status", "--storage", ROOT])
    assert line == "error: which run? give its name (run.name), or --config with the run's config"


def test_with_no_endpoint_set_the_hint_says_how_to_give_one(monkeypatch):
    """The case of the issue (AWS's endpoint tried for a MinIO run), without contacting AWS."""
    from botocore.exceptions import EndpointConnectionError

    exc = EndpointConnectionError(endpoint_url="https://rollflow.s3.amazonaws.com/cli/done")
    line = storage_problem(exc, RunAddress(ROOT, "done"))
    assert line.startswith(f"storage {ROOT}: AWS's S3 endpoint is unreachable (Could not connect")
    assert line.endswith(
        "no endpoint is set, so AWS's was used; for MinIO or another S3-compatible store give "
        "--storage-option endpoint_url=URL, AWS_ENDPOINT_URL_S3, or --config with the run's config"
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    line = storage_problem(exc, RunAddress(ROOT, "done"))
    assert line.endswith("check AWS_ENDPOINT_URL_S3 and that the service is up")
