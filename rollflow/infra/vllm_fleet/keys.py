"""The run's side of the vLLM servers' keys: each server's key, and the header that sends it.

Every route of a server rollflow starts refuses a request without the server's key
(``inference/auth.py`` checks it inside vLLM). The launcher makes the key (``new_key``) and
hands it to the server in its environment (``inference/protocol.KEY_ENV``).

Owns: the key of each server this process started or adopted, by base URL (``register`` /
``key_for``), so that every client of that URL sends it without the key being passed around.
"""

from __future__ import annotations

import secrets
import threading

_KEYS: dict[str, str] = {}
_LOCK = threading.Lock()


def new_key() -> str:
    return secrets.token_urlsafe(32)


def register(base_url: str, key: str) -> None:
    """Remember ``key`` as the key of the server at ``base_url`` (for clients in this process)."""
    with _LOCK:
        _KEYS[base_url.rstrip("/")] = key


def key_for(base_url: str) -> str | None:
    with _LOCK:
        return _KEYS.get(base_url.rstrip("/"))


def auth_headers(base_url: str, key: str | None = None) -> dict[str, str]:
    """The header that a request to ``base_url`` needs (none if the server has no known key)."""
    key = key or key_for(base_url)
    return {"Authorization": f"Bearer {key}"} if key else {}
