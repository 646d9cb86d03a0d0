"""Storage credentials stay out of the run's config as Prefect stores it and as config.json.

The whole resolved config is the run flow's parameter (kept by the Prefect API, shown in the
UI's Parameters tab) and is written to ``config.json`` in storage. Credentials therefore never
ride in it:

- the usual way: the environment (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_PROFILE`` for S3; s3fs and botocore read them), nothing in the config;
- ``run.storage_secret``: the name of a Prefect Secret block whose value is a JSON object of
  fsspec options (``{"key": ..., "secret": ...}``), loaded from the configured Prefect server;
- credentials given in ``run.storage_options`` anyway (keys in ``SECRET_OPTION_KEYS``, at any
  depth, e.g. ``client_kwargs.aws_secret_access_key``) are taken out of the config before it
  reaches Prefect or storage (``move_storage_secrets``).

Either way they reach ``RunStorage`` through this process's environment (``SECRETS_ENV``, a JSON
object of options by storage root, merged into the options of a ``RunStorage`` of that root),
which the run's services inherit and other users cannot read. Owns: which option keys are secret, and that hand-over.
"""

from __future__ import annotations

import json
import os
from typing import Any

from rollflow.infra.errors import ConfigError

SECRETS_ENV = "ROLLFLOW_STORAGE_SECRETS"
SECRET_OPTION_KEYS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "account_key",
        "sas_token",
        "client_secret",
        "connection_string",
        "credential",
        "credentials",
    }
)


def split_secrets(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(options without secrets, the secrets)``, both nested as ``options`` is."""
    public: dict[str, Any] = {}
    hidden: dict[str, Any] = {}
    for name, value in options.items():
        if name.lower() in SECRET_OPTION_KEYS and value not in (None, ""):
            hidden[name] = value
        elif isinstance(value, dict):
            pub, sec = split_secrets(value)
            public[name] = pub
            if sec:
                hidden[name] = sec
        else:
            public[name] = value
    return public, hidden


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, nested dicts merged key by key."""
    out = dict(base)
    for name, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(name), dict):
            out[name] = merge(out[name], value)
        else:
            out[name] = value
    return out


def secret_storage_options(root: str) -> dict[str, Any]:
    """The secrets handed over in this process's environment for storage ``root`` (or {})."""
    raw = os.environ.get(SECRETS_ENV)
    return json.loads(raw).get(root, {}) if raw else {}


def hand_over(root: str, secrets: dict[str, Any]) -> None:
    """Put ``secrets`` where ``RunStorage(root, ...)`` finds them, here and in the services
    started later (they inherit the environment)."""
    if secrets:
        raw = os.environ.get(SECRETS_ENV)
        by_root = json.loads(raw) if raw else {}
        by_root[root] = merge(by_root.get(root, {}), secrets)
        os.environ[SECRETS_ENV] = json.dumps(by_root)


def move_storage_secrets(root: str, options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Take the credentials out of ``options`` and hand them over for ``root``; returns the
    options left and the dotted names of the keys moved."""
    public, hidden = split_secrets(options)
    hand_over(root, hidden)
    return public, _dotted(hidden)


def load_secret_block(name: str) -> dict[str, Any]:
    """The fsspec options stored in the Prefect Secret block ``name`` (a JSON object)."""
    from prefect.blocks.system import Secret

    value = Secret.load(name).get()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(
                f"run.storage_secret = {name!r}: the Secret block is not JSON ({exc}); store a "
                "JSON object of fsspec options"
            ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"run.storage_secret = {name!r}: the Secret block must hold a JSON object of fsspec "
            'options, e.g. {"key": ..., "secret": ...}'
        )
    return value


def secret_option_names(options: dict[str, Any]) -> list[str]:
    """The dotted names of the credentials in ``options`` (nothing is handed over)."""
    return _dotted(split_secrets(options)[1])


def _dotted(tree: dict[str, Any], prefix: str = "") -> list[str]:
    names = []
    for name, value in tree.items():
        if isinstance(value, dict):
            names += _dotted(value, f"{prefix}{name}.")
        else:
            names.append(prefix + name)
    return names


def take_secrets_out(run_section: Any) -> list[str]:
    """Move the credentials in ``run.storage_options`` out of the config (in place); returns
    the dotted names moved. Call before the config reaches Prefect or storage."""
    public, moved = move_storage_secrets(run_section.storage, run_section.storage_options)
    if moved:
        run_section.storage_options = public
    return moved


def load_storage_secret(run_section: Any) -> None:
    """Hand over the options of the Secret block ``run.storage_secret`` (needs the Prefect API)."""
    hand_over_secret_block(run_section.storage, run_section.storage_secret)


def hand_over_secret_block(root: str, name: str | None) -> None:
    """Hand over for ``root`` the options of the Prefect Secret block ``name``, if one is named.

    A process that Prefect places on another host (a vLLM server's or a trainer node's flow run)
    gets the block's name as a parameter, never its value, and loads it itself: the run's own
    environment does not travel there."""
    if name:
        hand_over(root, load_secret_block(name))
