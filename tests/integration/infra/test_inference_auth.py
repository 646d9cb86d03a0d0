"""Closed endpoints: every route of the vLLM server refuses a request without the run's key.

vLLM's own --api-key guards only /v1, /v2, /inference and /cohere; rollflow's middleware
(inference/auth.py) guards every path, the development routes included. Checked on the
middleware alone (fast) and on a real vLLM server started as the run starts it.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rollflow.inference import auth, protocol
from rollflow.infra.vllm_fleet import keys
from rollflow.infra.vllm_fleet.client import InferenceClient

from conftest import PROMPT_IDS


async def _ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _guarded(monkeypatch, key="k3y") -> httpx.AsyncClient:
    monkeypatch.setenv(protocol.KEY_ENV, key)
    app = auth.RunKeyMiddleware(_ok_app)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.mark.parametrize(
    "headers,status",
    [
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": "Basic k3y"}, 401),
        ({"Authorization": "Bearer k3y "}, 401),
        ({"Authorization": "Bearer k3y"}, 200),
        ({"authorization": "bearer k3y"}, 200),
    ],
)
def test_middleware_checks_the_key_on_any_path(monkeypatch, headers, status):
    async def go():
        async with _guarded(monkeypatch) as http:
            for path in ("/health", "/pause", "/collective_rpc", "/anything/else", "/v1/models"):
                response = await http.post(path, headers=headers)
                assert response.status_code == status, path
                if status == 401:
                    assert "run key" in response.json()["error"]

    asyncio.run(go())


def test_server_without_a_key_refuses_to_start(monkeypatch):
    monkeypatch.delenv(protocol.KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"{protocol.KEY_ENV} is not set"):
        auth.RunKeyMiddleware(_ok_app)


def test_the_key_is_in_the_environment_not_on_the_command_line(tiny_model_dir):
    from rollflow.services.vllm_server import InferenceServer

    server = InferenceServer(tiny_model_dir)
    assert server.api_key not in " ".join(server.command())
    assert server.environment()[protocol.KEY_ENV] == server.api_key
    assert protocol.MIDDLEWARE in server.command()
    assert keys.key_for(server.url) == server.api_key


# Every route rollflow uses, the development routes, and the open ones vLLM registers anyway.
ROUTES = [
    ("GET", "/health", None),
    ("GET", "/is_paused", None),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
    ("GET", "/server_info", None),
    ("POST", "/pause?mode=keep", None),
    ("POST", "/resume", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/collective_rpc", {"method": protocol.CLOSE_WEIGHT_GROUP.name}),
    ("POST", "/v1/completions", {"model": "policy", "prompt": PROMPT_IDS, "max_tokens": 1}),
    ("POST", "/invocations", {"model": "policy", "prompt": PROMPT_IDS, "max_tokens": 1}),
    ("POST", "/tokenize", {"model": "policy", "prompt": "12"}),
]


@pytest.mark.slow
def test_every_route_of_a_real_server_refuses_a_request_without_the_key(vllm_server):
    refused = {}
    with httpx.Client(base_url=vllm_server.url, timeout=30) as http:
        for method, path, body in ROUTES:
            for headers in ({}, {"Authorization": "Bearer not-the-key"}):
                response = http.request(method, path, json=body, headers=headers)
                refused[(path, bool(headers))] = response.status_code
        assert set(refused.values()) == {401}, refused
        # With the key the same routes answer (the server is not merely broken).
        key = keys.auth_headers(vllm_server.url)
        for method, path, body in ROUTES[:3]:
            assert http.request(method, path, json=body, headers=key).status_code == 200, path
        assert http.get("/is_paused", headers=key).json() == {"is_paused": False}

    async def go():  # the run's client sends the key by itself
        async with InferenceClient(vllm_server.url, timeout_s=60) as client:
            assert await client.health()
            await client.pause(mode="keep")
            await client.resume()
            assert len(await client.complete(PROMPT_IDS, max_tokens=2, temperature=0.0)) == 1
        async with InferenceClient(vllm_server.url, timeout_s=60, api_key="wrong") as client:
            assert not await client.health()

    asyncio.run(go())


def test_vllm_gets_jemalloc_when_there_is_one(tiny_model_dir, tmp_path, monkeypatch):
    from rollflow.services.vllm_server import JEMALLOC_ENV, InferenceServer

    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    monkeypatch.setenv(JEMALLOC_ENV, str(lib))
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    assert InferenceServer(tiny_model_dir).environment()["LD_PRELOAD"] == f"{lib} /other.so"
    monkeypatch.setenv(JEMALLOC_ENV, "0")
    assert InferenceServer(tiny_model_dir).environment()["LD_PRELOAD"] == "/other.so"
    monkeypatch.setenv(JEMALLOC_ENV, str(tmp_path / "missing.so"))
    assert InferenceServer(tiny_model_dir).environment()["LD_PRELOAD"] == "/other.so"
