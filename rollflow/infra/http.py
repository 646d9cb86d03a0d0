"""The control channel: JSON over HTTP with the run's token and a deadline on every call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


class ServiceCallError(RuntimeError):
    """A control call that failed; the message names the service, the path and the cause.

    ``status`` is the HTTP status of the answer, None when there was none (unreachable, no
    answer within the deadline)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Endpoint:
    """Where a service listens and the token it requires (JSON-able: tasks receive it)."""

    name: str
    url: str
    token: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def call(ep: Endpoint, path: str, payload: dict[str, Any] | None = None, *, timeout_s: float,
         method: str = "POST") -> Any:
    """One blocking call; raises ``ServiceCallError`` on transport errors, timeouts and non-2xx."""
    try:
        resp = httpx.request(method, ep.url + path, json=payload, headers=ep.headers(), timeout=timeout_s)
    except httpx.TimeoutException:
        raise ServiceCallError(f"{ep.name} {path}: no answer within {timeout_s:.0f}s") from None
    except httpx.TransportError as exc:
        raise ServiceCallError(f"{ep.name} {path}: cannot reach {ep.url}: {exc}") from None
    return _result(ep, path, resp)


async def acall(client: httpx.AsyncClient, ep: Endpoint, path: str, payload: dict[str, Any] | None = None,
                *, timeout_s: float, method: str = "POST") -> Any:
    """The async twin of ``call`` on a shared client."""
    try:
        resp = await client.request(method, ep.url + path, json=payload, headers=ep.headers(), timeout=timeout_s)
    except httpx.TimeoutException:
        raise ServiceCallError(f"{ep.name} {path}: no answer within {timeout_s:.0f}s") from None
    except httpx.TransportError as exc:
        raise ServiceCallError(f"{ep.name} {path}: cannot reach {ep.url}: {exc}") from None
    return _result(ep, path, resp)


def _result(ep: Endpoint, path: str, resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        raise ServiceCallError(f"{ep.name} {path}: HTTP {resp.status_code}: {detail}", resp.status_code)
    return resp.json() if resp.content else None
