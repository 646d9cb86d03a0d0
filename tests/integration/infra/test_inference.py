"""The inference deployment against a real vLLM (CPU build) server, and the weight group.

One server is started for the module (the slow part, tens of seconds on 2 cores); the tests
then check sampling, pause/resume, error paths, and that stopping the server leaves no process
behind. The weight sync's orchestration against the server is in tests/integration/tasks/sync.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import httpx
import psutil
import pytest

from rollflow.infra.errors import InferenceError, InferenceUnavailable
from rollflow.infra.processes import free_port
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.infra.vllm_fleet.keys import auth_headers
from rollflow.infra.vllm_fleet.workers import WeightWorkers
from rollflow.services.vllm_server import InferenceServer, omp_threads

from conftest import PROMPT_IDS, VLLM_MAX_LEN

MAX_LEN = VLLM_MAX_LEN


def test_unreachable_server_raises_unavailable():
    async def go():
        async with InferenceClient(f"http://127.0.0.1:{free_port()}", timeout_s=5) as client:
            assert not await client.health()
            with pytest.raises(InferenceUnavailable):
                await client.complete([1, 2], max_tokens=2, temperature=0.0)

    asyncio.run(go())


# ------------------------------------------------------------------------ a real server


@pytest.fixture(scope="module")
def server(vllm_server):
    return vllm_server


def run(coro_fn, server):
    """Run ``coro_fn(client)`` with a fresh client on the module's server."""

    async def go():
        async with InferenceClient(server.url, timeout_s=60) as client:
            return await coro_fn(client)

    return asyncio.run(go())


@pytest.mark.slow
def test_completions_return_token_ids_and_finite_logprobs(server):
    async def go(client):
        return await client.complete(PROMPT_IDS, n=4, max_tokens=12, temperature=1.0, seed=0)

    completions = run(go, server)
    assert len(completions) == 4
    for c in completions:
        assert c.finish_reason in ("stop", "length")
        assert 0 < len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in c.logprobs)
    assert len({tuple(c.token_ids) for c in completions}) > 1  # n samples, not n copies


@pytest.mark.slow
def test_the_runs_request_is_answered_without_text_and_samples_the_same(server):
    """The run's request (``completion_request``) asks for token ids only: vLLM's API server
    then detokenizes nothing (inference/plugin.py): no text, log-probs named by token id. The
    same request asking for text, with the same seed, samples the same tokens and log-probs, and
    ends them alike."""
    from rollflow.infra.vllm_fleet.client import completion_request

    ids_only = completion_request("policy", PROMPT_IDS, 4, MAX_LEN - len(PROMPT_IDS), 1.0, seed=3)
    with_text = {k: v for k, v in ids_only.items() if k != "vllm_xargs"}
    with_text["return_tokens_as_token_ids"] = False
    answers = []
    with httpx.Client(base_url=server.url, timeout=60, headers=auth_headers(server.url)) as http:
        for body in (ids_only, with_text):
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            answers.append(sorted(response.json()["choices"], key=lambda c: c["index"]))
    plain, texted = answers
    for a, b in zip(plain, texted, strict=True):
        assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == b["finish_reason"]
        assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]
        assert a["text"] == "" and b["text"]
        assert a["logprobs"]["tokens"] == [f"token_id:{t}" for t in a["token_ids"]]


@pytest.mark.slow
def test_bad_request_carries_the_servers_message(server):
    async def go(client):
        with pytest.raises(InferenceError, match="max_model_len") as err:
            await client.complete(PROMPT_IDS, max_tokens=10 * MAX_LEN, temperature=1.0)
        assert err.value.status == 400

    run(go, server)


@pytest.mark.slow
def test_pause_keep_freezes_a_streaming_request_until_resume(server):
    body = {
        "model": "policy",
        "prompt": PROMPT_IDS,
        "max_tokens": MAX_LEN - len(PROMPT_IDS),
        "min_tokens": MAX_LEN - len(PROMPT_IDS),
        "temperature": 1.0,
        "n": 16,
        "stream": True,
    }

    # Many streams at once: the tiny model is fast enough to finish one before pause lands.
    streams: list[list[str]] = [[] for _ in range(32)]
    started = asyncio.Event()

    async def consume(http, lines):
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line:
                    lines.append(line)
                    started.set()

    async def go(client):
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=server.url, timeout=60, limits=limits, headers=auth_headers(server.url)
        ) as http:
            tasks = [asyncio.create_task(consume(http, lines)) for lines in streams]
            await asyncio.wait_for(started.wait(), 30)
            await client.pause(mode="keep")
            try:
                await asyncio.sleep(0.3)  # chunks already produced may still be in transit
                frozen = {
                    i: len(lines) for i, lines in enumerate(streams) if "data: [DONE]" not in lines
                }
                assert frozen, "every stream finished before the pause: nothing to check"
                await asyncio.sleep(1.0)
                for i, count in frozen.items():
                    assert len(streams[i]) == count, "tokens arrived while paused"
                    assert "data: [DONE]" not in streams[i]
            finally:
                await client.resume()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for i, count in frozen.items():
            lines = streams[i]
            assert lines[-1] == "data: [DONE]"
            events = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
            reasons = {c["finish_reason"] for e in events for c in e["choices"]} - {None}
            assert reasons == {"length"}
            assert len(events) > count - 1

    run(go, server)


@pytest.mark.slow
def test_requests_aborted_by_a_real_pause_are_retried_and_complete(server):
    """pause(mode="abort") ends in-flight requests with finish_reason "abort"; the sampler
    retries each with backoff once generation resumes, and every request completes."""
    from rollflow.tasks.generate.rollouts import RetryPolicy, Sampler, SamplingStats

    stats = SamplingStats()
    max_tokens = MAX_LEN - len(PROMPT_IDS)

    async def go(client):
        sampler = Sampler(
            client,
            max_tokens=max_tokens,
            temperature=1.0,
            top_p=1.0,
            stats=stats,
            retry=RetryPolicy(initial_s=0.05, max_s=0.5),
            deadline_s=120,
        )
        # ~60k tokens to generate: seconds on 2 cores, so the pause lands mid-generation.
        tasks = [asyncio.create_task(sampler(PROMPT_IDS, n=16)) for _ in range(64)]
        await asyncio.sleep(0.3)
        await client.pause(mode="abort")
        await asyncio.sleep(0.3)
        await client.resume()
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    results = run(go, server)
    assert stats.retry_reasons.get("RequestAborted", 0) >= 1
    assert len(results) == 64 and all(len(group) == 16 for group in results)
    assert all(c.finish_reason in ("stop", "length") and c.token_ids for g in results for c in g)


def _api_server(server) -> psutil.Process:
    """vLLM's API server: the one child of the server's guard (``ManagedProcess``).

    vLLM's processes are found by where they are in the tree, not by their names: vLLM names them
    (``VLLM::EngineCore``) with setproctitle, which finds the command line's memory by walking
    back from the first environment string, and gives up once that string was set anew. bash (the
    guard) passes the environment on in an order of its own; in a clean environment its first
    variable is ``PYTORCH_NVML_BASED_CUDA_CHECK``, which vLLM sets on import, and the engine core
    kept the name ``python``."""
    (api,) = psutil.Process(server.pids()[0]).children()
    assert api.cmdline()[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], api.cmdline()
    return api


def _worker_cpu_s(server) -> float:
    """CPU seconds of the processes that run the model: the engine core, where the worker runs
    for one rank (``--distributed-executor-backend uni``), and worker processes where there are:
    every process under the API server."""
    engine = _api_server(server).children(recursive=True)
    assert engine, "no engine core under vLLM's API server"
    return sum(sum(p.cpu_times()[:2]) for p in engine)


@pytest.mark.slow
def test_worker_sleeps_between_requests_and_wakes_for_each(server):
    """On CPU, vLLM's engine and worker do not spin between requests (inference/plugin.py), and no
    wake-up is lost: a pause, a no-op RPC, a resume and a short completion each answer at once (a lost
    wake-up costs vLLM's 5 s recheck)."""

    async def go(client):
        await client.complete(PROMPT_IDS, max_tokens=4, temperature=1.0)  # the first one warms up
        slowest = 0.0
        for _ in range(8):  # gaps well under vLLM's own 1 s spin window
            await asyncio.sleep(0.25)
            for call in (
                lambda: client.pause(mode="keep"),
                lambda: WeightWorkers(client).close_weight_group(),  # a no-op RPC
                client.resume,
                lambda: client.complete(PROMPT_IDS, max_tokens=4, temperature=1.0),
            ):
                start = time.monotonic()
                await call()
                slowest = max(slowest, time.monotonic() - start)
        return slowest

    cpu0, wall0 = _worker_cpu_s(server), time.monotonic()
    slowest = run(go, server)  # (the warm-up's few ms of CPU are within the bound)
    busy = (_worker_cpu_s(server) - cpu0) / (time.monotonic() - wall0)
    assert slowest < 1.0, f"a call took {slowest:.2f}s: a wake-up was lost"
    # Spinning, the worker is busy ~100% of the wall clock here; generating 8 x 4 tokens is a few %.
    assert busy < 0.5, f"vLLM's engine was busy {busy:.0%} of the time between requests"


@pytest.mark.slow
def test_the_engine_core_is_forked_from_the_api_server_not_spawned(server):
    """On CPU with one rank, vLLM's engine core is forked from its API server (inference/plugin.py):
    it does not import vLLM a second time (~11 s of CPU per start). A forked process keeps its
    parent's auxiliary vector (written by the kernel at exec, with the addresses of that exec's
    randomised stack); a spawned one is exec'd anew and gets a vector of its own."""
    api = _api_server(server)
    (engine,) = api.children()  # one rank: the engine core, its worker inside it
    auxv = [Path(f"/proc/{p.pid}/auxv").read_bytes() for p in (api, engine)]
    assert auxv[0] == auxv[1], "the engine core was exec'd (spawned), not forked"


@pytest.mark.slow
def test_a_server_on_a_new_host_inspects_its_model_in_its_own_process(server):
    """The session's server started with an empty vLLM cache, as on a new node or a new user's
    machine: vLLM inspected its model's class at that start (and cached the answer), in the API
    server's own process (inference/plugin.py). vLLM's way imports the class in a fresh interpreter
    that imports vLLM again (~10 s of CPU, 11-14 s of a server's start on 2 cores), a child the API
    server waits for: its CPU is counted in the API server's children's time."""
    cache = Path(server.extra_env["VLLM_CACHE_ROOT"])
    assert list(cache.glob("modelinfos/*LlamaForCausalLM.json")), "nothing inspected at start"
    times = _api_server(server).cpu_times()
    children_s = times.children_user + times.children_system
    assert children_s < 2.0, f"the API server's finished children took {children_s:.1f}s of CPU"


@pytest.mark.slow
def test_the_servers_sockets_and_file_store_are_in_a_folder_of_its_own(server):
    """vLLM's processes meet on IPC sockets and a file store that it names anew (a uuid) at every
    start and never unlinks: in /tmp they outlived every server, 3 sockets and a file per start
    (3,467 sockets on the machine that found it). A server rollflow starts has them in its own
    temporary folder, which its stop removes (test_server_that_cannot_start_fails_with_its_log)."""
    folder = server.runtime_dir
    bound = {c.laddr for c in _api_server(server).net_connections(kind="unix") if c.laddr}
    assert bound and all(Path(path).parent == folder for path in bound), (folder, bound)
    assert list(folder.glob("vllm_dist_*")), sorted(p.name for p in folder.iterdir())


@pytest.mark.slow
def test_the_engine_samples_log_probs_without_building_a_kernel(server):
    """On CPU the server runs eagerly, its sampler too: the run's requests ask the log-prob of
    every token, whose rank vLLM counts in a ``torch.compile``d helper; inductor built it as C++
    with the host's compiler at the first such request (11.5 s on an empty inductor cache, 2.4 s
    with it warm) and the engine loaded the library it built. Nothing built is loaded here."""
    api = _api_server(server)
    (engine,) = api.children()

    async def with_log_probs(client):
        for n in (1, 4):  # two batch sizes: a compiled helper would also be built for the second
            await asyncio.gather(
                *(client.complete(PROMPT_IDS, n=n, max_tokens=4, temperature=1.0) for _ in range(3))
            )

    run(with_log_probs, server)
    built = {
        line.split()[-1]
        for process in (api, engine)
        for line in Path(f"/proc/{process.pid}/maps").read_text().splitlines()
        if "inductor" in line
    }
    assert not built, f"vLLM loaded libraries that torch.compile built: {sorted(built)}"


@pytest.mark.slow
def test_the_engine_computes_on_as_many_threads_as_its_cores(server):
    """A one-rank server's model runs on as many OpenMP threads as the cores it was given
    (``VLLM_CPU_OMP_THREADS_BIND``), no more. vLLM 0.32 binds none in its engine core and its cut
    to one thread is swallowed, so torch kept one per core of the host: on 2 cores the second spun
    at every barrier, ~0.5 of a core while the server generated. While it generates here, the
    threads busy for more than a third of the busiest one's CPU time are counted."""
    api = _api_server(server)
    (engine,) = api.children()  # forked: the API server's environment (setproctitle moved its own)
    cores = omp_threads(api.environ().get("VLLM_CPU_OMP_THREADS_BIND", ""))
    assert cores is not None, "the server was given no cores"

    async def burst(client):
        for _ in range(3):
            await asyncio.gather(
                *(
                    client.complete(PROMPT_IDS, n=8, max_tokens=16, temperature=1.0)
                    for _ in range(32)
                )
            )

    before = {t.id: t.user_time + t.system_time for t in engine.threads()}
    run(burst, server)
    used = sorted(
        (t.user_time + t.system_time - before.get(t.id, 0.0) for t in engine.threads()),
        reverse=True,
    )
    assert used[0] > 0.2, f"the burst kept the engine busy for {used[0]:.2f} s only"
    busy = [round(s, 2) for s in used if s > used[0] / 3]
    assert len(busy) <= cores, (
        f"{len(busy)} threads of the engine core computed ({busy} s of CPU) on {cores} core(s)"
    )


@pytest.mark.slow
def test_collective_rpc_surfaces_worker_errors(server):
    async def go(client):
        with pytest.raises(InferenceError, match="before init_weight_group") as err:
            await WeightWorkers(client).receive_weights(timeout_s=10)
        assert err.value.status >= 500

    run(go, server)


@pytest.mark.slow
def test_server_that_cannot_start_fails_with_its_log(tmp_path):
    log = tmp_path / "bad.log"
    srv = InferenceServer(tmp_path / "no-such-model", log_path=log, startup_timeout_s=120)
    start = time.monotonic()
    srv.spawn()
    folder = srv.runtime_dir  # the server's own temporary folder, gone with it
    with pytest.raises(InferenceError, match="exited with code") as err:
        srv.wait_ready()
    assert str(log) in str(err.value)
    assert "no-such-model" in str(err.value)  # the log's tail is in the message
    assert time.monotonic() - start < 90
    assert not srv.is_alive()
    assert folder is not None and not folder.exists()
