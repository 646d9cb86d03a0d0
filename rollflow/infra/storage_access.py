"""Reaching an existing run's storage from outside the run: ``rollflow status``, ``export``, ``scale``.

Owns: where such a command finds the run (its name, ``run.storage``, ``run.storage_options`` and
``run.storage_secret``, from the run's own config file and from ``--storage`` and
``--storage-option`` over it), the probe that opens the run, and how a failure reads.

Invariant: every failure to reach a run is one ``StorageError`` or ``InputError`` line that names
the setting to change (``--storage-option endpoint_url``, ``AWS_ENDPOINT_URL_S3``, the
credentials' variables, ``--storage``, the run's name), never a traceback; and the probe answers
within ``PROBE_DEADLINE_S`` however the endpoint behaves (refused, silent, black-holed): one
attempt with a 2 s connect and ``PROBE_READ_TIMEOUT_S`` read timeout answers a silent endpoint;
the deadline is the backstop for whatever those timeouts miss, long enough that a slow but
answering endpoint on busy cores is not called silent.
Credentials never come from a command line: they stay in the environment or in the Prefect
Secret block the run's config names (infra/secrets.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollflow.infra.errors import InputError, StorageError
from rollflow.infra.secrets import merge, secret_storage_options
from rollflow.infra.storage import RunStorage

PROBE_DEADLINE_S = 10.0
# A request's own read timeout: long enough for a slow but answering endpoint (moto beside the
# suite's vLLM servers took 2+ s for one 404 on busy cores), short enough that a silent one is
# named in seconds.
PROBE_READ_TIMEOUT_S = 5.0
# botocore reads these when no endpoint_url option is given (botocore >= 1.31).
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment, or "
    "give --config with the run's config if its run.storage_secret names a Prefect Secret block"
)


@dataclass
class RunAddress:
    """Where a run is and how to reach it; ``endpoint_key`` is how the user sets its endpoint."""

    root: str
    run: str
    options: dict[str, Any] = field(default_factory=dict)
    endpoint_key: str = "--storage-option endpoint_url=URL"

    @property
    def uri(self) -> str:
        return f"{self.root.rstrip('/')}/{self.run}"


def run_address(
    run: str | None,
    storage: str | None,
    storage_options: list[str],
    config: str | None = None,
) -> RunAddress:
    """The run named on the command line, in the run's config file's storage (if ``config``),
    with ``--storage`` and each ``--storage-option KEY=VALUE`` over it. Loads the Secret block
    the config's ``run.storage_secret`` names. Raises ``InputError`` naming the bad input."""
    from rollflow.infra.config import apply_override, load_config
    from rollflow.infra.secrets import hand_over_secret_block, split_secrets

    data: dict[str, Any] = {"run": {"storage_options": {}}}
    secret, endpoint_key = None, "--storage-option endpoint_url=URL"
    if config is not None:
        section = load_config(config).run  # a ConfigError names the file and the key
        data["run"]["storage_options"] = dict(section.storage_options)
        run, storage, secret = (
            run or section.name,
            storage or section.storage,
            section.storage_secret,
        )
        if "endpoint_url" in section.storage_options:
            endpoint_key = f"run.storage_options.endpoint_url in {config}"
    if not run:
        raise InputError("which run? give its name (run.name), or --config with the run's config")
    for item in storage_options:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip() or item.startswith("~"):
            raise InputError(
                f"--storage-option {item!r}: give KEY=VALUE, e.g. endpoint_url=http://127.0.0.1:9000"
            )
        if split_secrets({key.strip().split(".")[-1]: "x"})[1]:
            raise InputError(
                f"--storage-option {key.strip()}: credentials never go on a command line (shell "
                f"history, the process list); {_CREDENTIALS_HINT}"
            )
        apply_override(data, f"run.storage_options.{item}")  # values as `rollflow run` reads them
        if key.strip() == "endpoint_url":
            endpoint_key = "--storage-option endpoint_url=URL"
    root = storage or "runs"
    if secret:
        if not os.environ.get("PREFECT_API_URL"):
            raise InputError(
                f"run.storage_secret = {secret!r} in {config}: a Prefect Secret block needs a "
                "Prefect server: set PREFECT_API_URL, or give the credentials in the environment"
            )
        try:
            hand_over_secret_block(root, secret)
        except Exception as exc:  # not found, not JSON, server down: one line
            raise InputError(f"run.storage_secret = {secret!r}: cannot load it: {exc}") from None
    return RunAddress(root, run, data["run"]["storage_options"], endpoint_key)


def open_run(address: RunAddress) -> RunStorage:
    """The run's storage, once a probe (one request, short timeouts, one try, under
    ``PROBE_DEADLINE_S``) found the run's folder. Raises ``StorageError`` (unreachable, no
    answer, no credentials, refused, no bucket) or ``InputError`` (no such run), one line each."""
    opts = merge(dict(address.options), secret_storage_options(address.root))  # as RunStorage
    seen: dict[str, Any] = {}

    def probe() -> Exception | None:
        try:
            fs, base = fail_fast_fs(address.uri, opts, read_timeout_s=PROBE_READ_TIMEOUT_S)
            seen["fs"] = fs
            fs.info(base)
        except Exception as exc:  # classified by the caller
            return exc
        return None

    outcome = within_deadline(probe, PROBE_DEADLINE_S, _TIMED_OUT)
    if outcome is _TIMED_OUT:
        endpoint = _endpoint_of(seen.get("fs"), address)
        raise StorageError(
            f"storage {address.root}: no answer from {endpoint} within {PROBE_DEADLINE_S:.0f} s; "
            f"{_endpoint_hint(address)}"
        )
    if isinstance(outcome, FileNotFoundError) and "bucket does not exist" not in str(outcome):
        raise InputError(
            f"no run {address.run!r} in {address.root} (nothing at {address.uri}); check the "
            "run's name and --storage (the run's run.storage)"
        )
    if outcome is not None:
        raise StorageError(storage_problem(outcome, address, seen.get("fs"))) from None
    return RunStorage(address.root, address.run, address.options)


@contextlib.contextmanager
def storage_errors(address: RunAddress) -> Iterator[None]:
    """A storage failure met after ``open_run`` (the endpoint gone mid-command) as one line."""
    try:
        yield
    except (InputError, StorageError):
        raise
    except Exception as exc:
        if not (isinstance(exc, OSError) or _from_botocore(exc)):
            raise  # a bug, not the storage: keep its traceback
        raise StorageError(storage_problem(exc, address)) from None


def storage_problem(exc: BaseException, address: RunAddress, fs: Any = None) -> str:
    """One line for a failed request to the run's storage: what failed and which setting to
    change."""
    kind, name, text = failure_kind(exc)
    where = f"storage {address.root}"
    if kind == "no credentials":
        return f"{where}: no S3 credentials found; {_CREDENTIALS_HINT}"
    if kind == "no bucket":
        bucket = address.root.split("://", 1)[-1].split("/", 1)[0]
        return f"{where}: the bucket {bucket!r} does not exist; check --storage (the run's run.storage)"
    if kind == "denied":
        return f"{where}: not allowed to read it ({text}); check the credentials and their rights"
    if isinstance(exc, (TypeError, ValueError)):  # fsspec or botocore refused an option
        return (
            f"{where}: the storage options were not accepted ({name}: {text}); check each "
            "--storage-option (run.storage_options)"
        )
    endpoint = _endpoint_of(fs, address)
    if kind == "no answer":
        return f"{where}: no answer from {endpoint} ({text}); {_endpoint_hint(address)}"
    if kind == "unreachable":
        return f"{where}: {endpoint} is unreachable ({text}); {_endpoint_hint(address)}"
    return f"{where}: {name}: {text}" if _from_botocore(exc) else f"{name}: {text}"


def failure_kind(exc: BaseException) -> tuple[str | None, str, str]:
    """What a failed storage request met, for a message a user can act on: ``"no credentials"``,
    ``"no bucket"``, ``"denied"``, ``"no answer"``, ``"unreachable"`` or None; with the
    exception's class name and its first line. One reading for every caller (the CLI's probe
    here, the run's preflight)."""
    name = type(exc).__name__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    if name == "NoCredentialsError" or "Unable to locate credentials" in text:
        return "no credentials", name, text
    if "bucket does not exist" in text or "NoSuchBucket" in text:
        return "no bucket", name, text
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return "denied", name, text
    if "Timeout" in name:
        return "no answer", name, text
    if "EndpointConnection" in name or "ConnectionError" in name or "Could not connect" in text:
        return "unreachable", name, text
    return None, name, text


def fail_fast_fs(uri: str, options: dict[str, Any], read_timeout_s: float) -> tuple[Any, str]:
    """The filesystem and path of ``uri`` for a probe: on S3 one attempt with short timeouts and
    no s3fs retry loop (5 tries with backoff by default), so that a probe answers fast; the run
    and the commands themselves keep the user's timeouts and retries."""
    import fsspec

    opts = dict(options)
    s3 = (fsspec.core.split_protocol(uri)[0] or "file") in ("s3", "s3a")
    if s3:
        config = dict(opts.get("config_kwargs") or {})
        config.update(
            connect_timeout=2, read_timeout=read_timeout_s, retries={"total_max_attempts": 1}
        )
        opts.update(config_kwargs=config, skip_instance_cache=True)
    fs, base = fsspec.core.url_to_fs(uri, **opts)
    if s3:
        fs.retries = 1
    return fs, base


def _endpoint_hint(address: RunAddress) -> str:
    """Which setting gives the endpoint: the one in use, or, with none, the ways to give one."""
    for var in ENDPOINT_ENV:
        if os.environ.get(var) and not _endpoint_option(address):
            return f"check {var} and that the service is up"
    if _endpoint_option(address):
        return f"check {address.endpoint_key} and that the service is up"
    return (
        "no endpoint is set, so AWS's was used; for MinIO or another S3-compatible store give "
        "--storage-option endpoint_url=URL, AWS_ENDPOINT_URL_S3, or --config with the run's config"
    )


def _endpoint_option(address: RunAddress) -> str | None:
    opts = address.options
    return opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")


def _endpoint_of(fs: Any, address: RunAddress) -> str:
    """The endpoint the client used (s3fs knows it once connected), else the one configured."""
    client = getattr(fs, "_s3", None)  # s3fs's client, once connected
    url = getattr(getattr(client, "meta", None), "endpoint_url", None)
    url = (
        url
        or _endpoint_option(address)
        or next((os.environ[v] for v in ENDPOINT_ENV if os.environ.get(v)), None)
    )
    return url or "AWS's S3 endpoint"


def _from_botocore(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore", "urllib3", "aiohttp")


_TIMED_OUT = object()


def within_deadline(fn: Callable[[], Any], deadline_s: float, timed_out: Any) -> Any:
    """``fn()`` in a daemon thread; ``timed_out`` if it has not returned by the deadline (the
    thread is left to end on its own, or with the process)."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True, name="probe")
    thread.start()
    thread.join(deadline_s)
    return box[0] if box else timed_out
