"""Both sides of the crossing into vLLM held to its contract (``rollflow/inference/protocol.py``).

The worker extension defines exactly the declared worker methods, each taking one string that it
parses with the declared model and answering the declared reply; the run's typed client of the
workers calls exactly those methods with that string; every declared route is one vLLM serves;
and no other module of ``rollflow/`` spells a route or a worker method as a string. No server is
started: vLLM's routes are read from its installed source.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest

import rollflow
from rollflow.inference import auth, protocol, worker_extension
from rollflow.inference.protocol import (
    CLOSE_WEIGHT_GROUP,
    INIT_WEIGHT_GROUP,
    RECEIVE_WEIGHTS,
    ROUTES,
    WORKER_METHODS,
    CloseWeightGroup,
    JoinWeightGroup,
    ReceiveWeights,
)
from rollflow.inference.worker_extension import WeightReceiver
from rollflow.infra.vllm_fleet.workers import WeightWorkers

ROLLFLOW = Path(rollflow.__file__).parent
DECLARED = {m.name for m in WORKER_METHODS}
JOIN = JoinWeightGroup(
    host="127.0.0.1",
    port=29500,
    first_rank=1,
    world_size=2,
    timeout_s=30.0,
    metadata=[{"name": "w", "shape": [2, 2], "dtype": "float32"}],
    wire_device="cpu",
    bucket_bytes=1 << 20,
)


def _public(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if inspect.isfunction(v) and not n.startswith("_")}


# ------------------------------------------------------------------ vLLM's side


def test_the_declared_worker_methods_are_the_extensions_each_taking_one_string():
    assert {"init_weight_group", "receive_weights", "close_weight_group"} == DECLARED
    assert _public(WeightReceiver) == DECLARED  # none undeclared, none missing
    for method in WORKER_METHODS:
        params = list(inspect.signature(getattr(WeightReceiver, method.name)).parameters.values())
        assert [p.name for p in params][:1] == ["self"], method.name
        (arg,) = params[1:]  # vLLM's /collective_rpc passes one string: the arguments' JSON
        assert arg.default is inspect.Parameter.empty and arg.kind is arg.POSITIONAL_OR_KEYWORD


def test_the_dotted_paths_given_to_vllm_name_the_extension_and_the_middleware():
    def resolve(dotted: str) -> Any:
        module, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(module), name)

    assert resolve(protocol.WORKER_EXTENSION_CLS) is WeightReceiver
    assert resolve(protocol.MIDDLEWARE) is auth.RunKeyMiddleware


class _Group:
    """Stands in for the weight group's receiving end: records how the worker joined it."""

    joined: dict[str, Any] = {}

    def __init__(self, host, port, rank, world_size, timeout_s, **kw):
        _Group.joined = dict(host=host, port=port, rank=rank, world_size=world_size, **kw)
        _Group.joined["timeout_s"] = timeout_s

    def connect(self) -> None:
        pass

    def receive(self, metadata):
        return 7, iter([])

    def close(self) -> None:
        _Group.joined["closed"] = True


class _Worker(WeightReceiver):
    """vLLM's worker as far as the extension uses it: its rank in the engine, its model."""

    rank, device = 1, "cpu"

    def reload_weights(self, weights_iterator, is_checkpoint_format) -> None:
        self.reloaded = list(weights_iterator)


def test_the_worker_parses_the_declared_models_and_answers_the_declared_replies(monkeypatch):
    monkeypatch.setattr(worker_extension, "WeightReceiverGroup", _Group)
    monkeypatch.setenv(protocol.KEY_ENV, "the-key")
    monkeypatch.delenv(protocol.LORA_ROOT_ENV, raising=False)
    worker = _Worker()
    # A method that fails answers its failure (vLLM then reads every worker's answer); the
    # run's side raises it, naming the worker, once every answer was read.
    failed = worker.receive_weights(*RECEIVE_WEIGHTS.encode(ReceiveWeights()))
    with pytest.raises(
        protocol.WorkerMethodFailed,
        match=r"receive_weights failed on worker\(s\) "
        r"1: RuntimeError: receive_weights called before init_weight_group",
    ):
        RECEIVE_WEIGHTS.replies([{"version": 3}, failed])

    answer = worker.init_weight_group(*INIT_WEIGHT_GROUP.encode(JOIN))
    assert [j.rank for j in INIT_WEIGHT_GROUP.replies([answer])] == [2]  # first_rank + its rank
    assert _Group.joined["rank"] == 2 and _Group.joined["secret"] == "the-key"
    assert _Group.joined["bucket_bytes"] == JOIN.bucket_bytes and _Group.joined["device"] == "cpu"
    answer = worker.receive_weights(*RECEIVE_WEIGHTS.encode(ReceiveWeights()))
    assert [v.version for v in RECEIVE_WEIGHTS.replies([answer])] == [7]
    assert worker.close_weight_group(*CLOSE_WEIGHT_GROUP.encode(CloseWeightGroup())) is None
    assert _Group.joined["closed"]

    # Another method's arguments, or a stray field: refused by the model, answered as failed.
    for answer in (
        worker.init_weight_group(CloseWeightGroup().model_dump_json()),
        worker.close_weight_group('{"force": true}'),
    ):
        assert answer[protocol.FAILED_KEY].startswith("ValidationError: "), answer


def test_a_method_takes_only_its_own_argument_model():
    with pytest.raises(TypeError, match="receive_weights takes ReceiveWeights"):
        RECEIVE_WEIGHTS.encode(CloseWeightGroup())
    (raw,) = INIT_WEIGHT_GROUP.encode(JOIN)
    assert isinstance(raw, str) and INIT_WEIGHT_GROUP.decode(raw) == JOIN


# ------------------------------------------------------------------ the run's side


class _Client:
    """Stands in for ``InferenceClient``: records each ``collective_rpc`` and answers as two
    workers of a server would."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    async def collective_rpc(self, method: str, args: list[str], *, timeout_s=None) -> list[Any]:
        self.calls.append((method, args))
        replies = {"init_weight_group": [{"rank": 1}, {"rank": 2}]}
        replies["receive_weights"] = [{"version": 4}, {"version": 4}]
        return replies.get(method, [None, None])


def test_the_run_calls_exactly_the_declared_worker_methods_with_one_json_string():
    client = _Client()
    workers = WeightWorkers(client)

    async def every_call():
        ranks = await workers.init_weight_group(
            **JOIN.model_dump(exclude={"timeout_s"}), group_timeout_s=JOIN.timeout_s, timeout_s=35
        )
        versions = await workers.receive_weights(timeout_s=35)
        await workers.close_weight_group(timeout_s=5)
        return ranks, versions

    assert _public(WeightWorkers) == DECLARED
    assert asyncio.run(every_call()) == ([1, 2], [4, 4])
    assert [name for name, _ in client.calls] == [m.name for m in WORKER_METHODS]
    by_name = {m.name: m for m in WORKER_METHODS}
    for name, args in client.calls:
        (raw,) = args
        by_name[name].decode(raw)  # what the worker parses
    assert INIT_WEIGHT_GROUP.decode(client.calls[0][1][0]) == JOIN


# ------------------------------------------------------------------ the routes


def _vllm_routes() -> set[tuple[str, str]]:
    """(method, path) of every route vLLM's entrypoints declare, read from its installed source
    (importing vLLM's server would take seconds, and starting one minutes)."""
    spec = importlib.util.find_spec("vllm")
    root = Path(next(iter(spec.submodule_search_locations))) / "entrypoints"
    served = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            first = node.args[0] if node.args else None
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            verb = node.func.attr
            if verb in ("get", "post", "put", "delete"):
                served.add((verb.upper(), first.value))
            elif verb in ("add_api_route", "api_route"):
                for kw in node.keywords:
                    if kw.arg == "methods" and isinstance(kw.value, ast.List | ast.Tuple):
                        served |= {(m.value, first.value) for m in kw.value.elts}
    return served


def test_every_declared_route_is_one_vllm_serves():
    served = _vllm_routes()
    assert ("POST", "/collective_rpc") in served and ("GET", "/v1/models") in served  # the reader
    assert len({r.path for r in ROUTES}) == len(ROUTES)
    missing = [r for r in ROUTES if (r.method, r.path) not in served]
    assert not missing, f"vLLM does not serve {missing}"


def _vllm_handler_params() -> dict[tuple[str, str], set[str]]:
    """(method, path) → the parameter names of vLLM's handler of the route (its query
    parameters among them), for every route declared by a decorator such as
    ``@router.post("/path")``."""
    spec = importlib.util.find_spec("vllm")
    root = Path(next(iter(spec.submodule_search_locations))) / "entrypoints"
    handlers: dict[tuple[str, str], set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            names = {a.arg for a in node.args.args + node.args.kwonlyargs}
            for decorator in node.decorator_list:
                if not (
                    isinstance(decorator, ast.Call)
                    and isinstance(decorator.func, ast.Attribute)
                    and decorator.func.attr in ("get", "post")
                    and decorator.args
                    and isinstance(decorator.args[0], ast.Constant)
                ):
                    continue
                key = (decorator.func.attr.upper(), decorator.args[0].value)
                handlers.setdefault(key, set()).update(names)
    return handlers


def test_every_declared_query_parameter_is_one_vllms_handler_takes():
    """FastAPI ignores a query parameter its handler does not take: a misspelt or dropped one
    would be sent and never read (``reset_running_requests`` is what makes the prefix-cache
    reset succeed with requests in flight)."""
    handlers = _vllm_handler_params()
    assert "reset_running_requests" in protocol.RESET_PREFIX_CACHE.params
    for route in ROUTES:
        taken = handlers.get((route.method, route.path), set())
        assert set(route.params) <= taken, f"vLLM's {route.path} takes {sorted(taken)}"


def _strings(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


# Other services' routes of the same spelling: Prefect's and the trainer's own health checks.
OTHER_SERVICES = {"infra/prefect_api.py": {"/health"}, "trainer/protocol.py": {"/health"}}


def test_no_other_module_spells_a_route_or_a_worker_method():
    """A route or a worker method named as a string is a crossing the import graph cannot see:
    the protocol's constants are the only spelling."""
    names = DECLARED | {r.path for r in ROUTES}
    spelt = []
    for path in sorted(ROLLFLOW.rglob("*.py")):
        module = path.relative_to(ROLLFLOW).as_posix()
        if module == "inference/protocol.py":
            continue
        for text in _strings(path) - OTHER_SERVICES.get(module, set()):
            if text.split("?")[0] in names:
                spelt.append(f"rollflow/{module}: {text!r}")
    assert not spelt, "\n".join(spelt)
