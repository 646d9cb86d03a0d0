"""Scale-out on CPU with the GPU path's code: a fleet of vLLM servers that grows and shrinks, a
2-rank trainer, one weight group.

The run's own ``RunServices`` places everything by the placement plan; the weights change by
real training steps (``forward_backward`` + ``optim_step`` on committed batches) and reach every
server through one broadcast. After every sync each server's greedy completions must equal
transformers' on the trainer's exported weights: after a server joins, after one is killed and
restarted (the group forms anew with both), after one is preempted and leaves.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest

from rollflow.infra.config import LossConfig, load_config
from rollflow.infra.faults import FAULT_ENV
from rollflow.infra.placement import Machine
from rollflow.infra.prefect_server import server_command
from rollflow.infra.prefect_ui import server_env
from rollflow.infra.processes import free_port
from rollflow.infra.storage import RunStorage
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.infra.vllm_fleet.fleet import ask_for_servers
from rollflow.services.run_services import RunServices
from rollflow.tasks.sync import weights
from rollflow.trainer.protocol import RANK_MAIN_MODULE, WEIGHTS_METADATA, SentReply

from chaos_support import SEED
from conftest import PROMPT_IDS, greedy_reference
from deployed_run import flow_run_log, prefect_api
from host_support import object_storage, two_hosts
from run_support import ROOT, assert_documented_layout, env_for, write_config
from trainer_support import make_rows, write_batch

pytestmark = pytest.mark.slow
KEY = "scale-out-test-key"


def greedy(url: str) -> list[int]:
    async def go():
        async with InferenceClient(url, timeout_s=60) as client:
            return (await client.complete(PROMPT_IDS, max_tokens=16, temperature=0.0))[0].token_ids

    return asyncio.run(go())


def test_a_fleet_grown_to_two_servers_and_a_two_rank_trainer_serve_the_trainers_weights(
    vllm_model_dirs, tmp_path
):
    """The fleet grows as a run's health loop makes it (``check_alive``, asked by
    ``rollflow scale``'s control file): one server, then two (the joined one serves the trainer's
    current weights at once), one of them killed and restarted. After every sync each server's
    greedy completions equal transformers' on the trainer's exported weights.
    Also the check of inference.cpus / trainer.cpus on real services: each server pinned to a
    core of its own (its engine core with it), the trainer's ranks to theirs."""
    model = vllm_model_dirs[0]
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        pytest.skip(f"two servers on cores of their own need 2 cores, this process has {cores}")
    cfg = load_config(
        None,
        [
            f"model.path='{model}'",
            "envs=[{name='sort_letters'}]",
            f"run.storage='{tmp_path / 'runs'}'",
            "run.name='scale'",
            "inference.num_servers=1",
            "inference.max_servers=2",
            "inference.max_restarts=1",
            "trainer.num_ranks=2",
            "trainer.weight_bucket_mb=0.0625",  # 64 KiB: every sync spans many buckets
            "train.lr=0.05",  # large steps, so that greedy outputs change
            f"inference.cpus={cores}",
            f"trainer.cpus={cores[::-1]}",
        ],
    )
    storage = RunStorage(cfg.run.storage, cfg.run.name)
    services = RunServices(cfg, model, None, tmp_path / "logs", machine=Machine(gpus=0))
    assert services.plan.weight_world_size == 3 and services.plan.wire.backend == "gloo"
    outputs = []

    def pinned(sup) -> set[tuple[int, ...]]:
        return {tuple(psutil.Process(pid).cpu_affinity()) for pid in sup.server.pids()}

    def fleet_becomes(servers: int) -> None:
        deadline = time.monotonic() + 300
        while len(services.supervisors) != servers or services.servers._joining is not None:
            assert time.monotonic() < deadline, f"the fleet did not reach {servers} in 300 s"
            services.check_alive()  # what the run's step loop calls every 5 s
            time.sleep(1)
        assert services.fleet.urls() == services.inference_urls
        assert services.weights.spec_for(services.servers.num_workers()).world_size == 1 + servers

    def train_and_sync(step: int) -> None:
        urls = services.inference_urls
        write_batch(storage, step, make_rows(16, seed=step, step=step, max_prompt=6))
        t.forward_backward(step, loss=LossConfig())
        t.optim_step()
        t.end_step(step)
        stats = weights.publish(t, urls, step, cfg.trainer.weight_sync_timeout_s)
        assert stats["version"] == step
        expected = exported_greedy(step)
        got = [greedy(url) for url in urls]
        assert got == [expected] * len(urls), f"step {step}: {got} != {expected}"
        outputs.append(expected)

    def exported_greedy(step: int) -> list[int]:
        exported = tmp_path / f"export-{step}"
        t.export_hf(str(exported))
        return greedy_reference(exported, PROMPT_IDS, 16)[1]

    with services:
        t = services.trainer
        assert (
            len(services.inference_urls) == 1
            and services.weights.spec_for(services.servers.num_workers()).world_size == 2
        )
        assert pinned(services.supervisors[0]) == {(cores[0],)}
        ranks = [psutil.Process(r.pid) for r in services.life.proc.ranks]
        assert len(ranks) == 2 and all(r.cpu_affinity() == cores for r in ranks), ranks
        before = greedy(services.inference_urls[0])
        train_and_sync(1)
        assert outputs[0] != before, "training did not change the greedy completion"

        # Grow: server 1 starts in the background, joins the group, serves step 1's weights.
        ask_for_servers(storage, 2, by="test")
        fleet_becomes(2)
        urls = services.inference_urls
        assert len(set(urls)) == 2 and pinned(services.supervisors[1]) == {(cores[1],)}
        assert [greedy(url) for url in urls] == [outputs[-1]] * 2
        joined = [e for e in storage.read_events() if e["event"] == "fleet_changed"]
        assert [(e["servers"], e["joined"], e["version"]) for e in joined] == [(2, 1, 1)]
        train_and_sync(2)  # one broadcast reaches both

        # Kill server 1: the fleet keeps its size, so its supervisor restarts it.
        victim = psutil.Process(services.supervisors[1].server.pids()[0])
        victim.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 300
        while services.supervisors[1].restarts == 0:
            assert time.monotonic() < deadline, "server 1 was not restarted within 300 s"
            services.check_alive()
            time.sleep(1)
        assert services.supervisors[0].restarts == 0
        assert pinned(services.supervisors[1]) == {(cores[1],)}
        assert [greedy(url) for url in urls] == [outputs[-1]] * 2
        train_and_sync(3)  # and the re-formed group syncs both
    # (A shrink by preemption, server 1 asked to go and killed at once, is the chaos campaign's:
    # test_chaos_run.py's fleet test, in a whole run.)
    assert all(not s.server.is_alive() for s in services.supervisors)


@pytest.mark.chaos
def test_a_two_host_run_from_prefect_deployment_run_places_its_processes_and_completes(
    tmp_path, model_cache, monkeypatch
):
    """Two hosts (tests/host_support.py: each its own network, /tmp and HOME, none of the
    other's files), a real ``prefect server`` on host 0 and a process worker on each, its own
    work queue; ``rollflow deploy``, then ``prefect deployment run`` of a run whose trainer has
    two nodes and whose fleet has two vLLM servers, nothing started by hand. The run flow (host
    0's worker) keeps no process of its own: it submits each trainer node as a flow run of
    ``rollflow-trainer-node/default``, node 0 to host 1's queue (so the run drives the trainer's
    API and node 1 meets node 0 across hosts, at the address node 0's flow run found and said)
    and node 1 to host 0's, and each server as a flow run of
    ``rollflow-inference-server/default``, server 0 to host 0's queue and server 1 to host 1's;
    the workers run them, they get their arguments from the flow runs' parameters and the policy
    from the run's storage (S3 on host 0's address, the only thing the hosts share), each server
    serves at its own host's address and joins the weight group on node 0's host, and the run
    completes, each step once, sampled by both servers; every flow run holds its process's log
    lines in the Prefect API. A trainer node is lost mid-run (the seed picks which node, which
    process and when) and the trainer is restarted on both nodes. The run is also
    the suite's check of the documented layout, `rollflow status` and the rerun of a finished
    run (``run_support.assert_documented_layout``)."""
    import fsspec
    import pyarrow.parquet as pq

    from deployed_run import (
        PREFECT,
        Service,
        _deployment_run,
        _healthy,
        rollflow_deploy,
        wait_until,
    )

    with two_hosts() as (host0, host1), object_storage(host0) as endpoint:
        storage = f"s3://rollflow/{tmp_path.name}"
        config = write_config(tmp_path, model_cache, name="twonode", steps=4, storage=storage)
        port = free_port(host0.address)
        api = f"http://{host0.address}:{port}/api"
        env = {
            **env_for(tmp_path, api=False),
            "PREFECT_API_URL": api,
            "PREFECT_WORKER_QUERY_SECONDS": "1",  # each step's flow run waits for a poll
            "PYTHONPATH": str(ROOT),
        }
        services: list[Service] = []
        logs = lambda: "\n".join(s.tail() for s in services)  # noqa: E731
        try:
            server = server_command(host0.address, port, log_level="warning")
            env_of_server = {**env, **server_env(host0.address, port, ui=False)}
            services.append(
                Service("prefect server", server, tmp_path / "server.log", env_of_server)
            )
            wait_until(lambda: _healthy(api), 180, "prefect server healthy", logs)
            rollflow_deploy(env, config)
            # A node lost mid-run, a fault of the chaos campaign (its seed picks which node, when
            # and what): once step 1 or 2 is committed, its rank or its flow run's process
            # SIGKILLed. A tiny step commits in a third of a second, faster than a look from
            # outside, so the lost node's rank hangs itself (a fault point, infra/faults.py) at
            # its first command after that step's checkpoint, and the kill lands there.
            chaos = random.Random(SEED)
            after, victim = chaos.choice((1, 2)), chaos.choice(("rank", "flow run process"))
            lost = chaos.choice((0, 1))
            print(f"chaos seed {SEED}: node {lost}'s {victim} SIGKILLed after step {after}")
            hang = {FAULT_ENV: f"after_checkpoint@{after}:stop"}
            for host, queue in ((host0, "default"), (host1, "host-1")):
                worker = ["worker", "start", "--pool", "rollflow-cpu", "--work-queue", queue]
                runs_lost = host.index == 1 - lost  # node 0 on host 1's queue, node 1 on host 0's
                services.append(
                    Service(
                        f"worker on host {host.index}",
                        host.wrap([*PREFECT, *worker, "--name", f"host-{host.index}"]),
                        host.root / "worker.log",
                        {
                            **env,
                            "PREFECT_HOME": str(host.home / ".prefect"),
                            **(hang if runs_lost else {}),
                        },
                    )
                )
            overrides = [
                "trainer.num_nodes=2",
                "trainer.num_ranks=1",
                "trainer.master_addr=auto",  # node 0's host's own, as a pool's pod learns it
                f"trainer.master_port={free_port(host0.address)}",
                "trainer.node_deployment=rollflow-trainer-node/default",
                "trainer.device=cpu",  # placed from a host without GPUs: named, never auto
                "trainer.node_queues=['host-1', 'default']",  # node 0 on host 1
                "inference.num_servers=2",
                "inference.server_deployment=rollflow-inference-server/default",
                "inference.device=cpu",
                "inference.server_queues=['default', 'host-1']",
                f'run.storage_options={{endpoint_url="{endpoint}"}}',
            ]
            run_id = _deployment_run(env, "rl-run/twonode", f"overrides={json.dumps(overrides)}")

            def ended(flow_run_id: str) -> str | None:
                for service in services:
                    assert service.proc.poll() is None, f"{service.name} exited\n{logs()}"
                state = prefect_api(api, f"/flow_runs/{flow_run_id}")["state"]
                terminal = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
                return state["type"] if state and state["type"] in terminal else None

            fs = fsspec.filesystem(
                "s3", endpoint_url=endpoint, skip_instance_cache=True, use_listings_cache=False
            )
            run_key = f"rollflow/{tmp_path.name}/twonode"

            def committed(step: int) -> bool:
                return fs.exists(f"{run_key}/checkpoints/step={step}/_SUCCESS")

            # Found first: a scan of the processes takes long enough for a tiny step to commit.
            def node_runs(node: int) -> list[dict]:
                runs = _flow_runs(api, "rollflow-trainer-node")
                mine = [r for r in runs if r["name"] == f"twonode: trainer node {node}"]
                return sorted(mine, key=lambda r: r["expected_start_time"])

            wait_until(lambda: node_runs(lost), 300, f"node {lost}'s flow run")
            [lost_node] = node_runs(lost)
            rank = _a_rank_of(lost_node["id"])
            target = rank if victim == "rank" else _flow_run_root(rank)
            wait_until(
                lambda: rank.status() == psutil.STATUS_STOPPED or ended(run_id),
                600,
                f"node {lost}'s rank at its first command after step {after}'s checkpoint",
                logs,
            )
            assert committed(after) and not committed(after + 1), [
                step for step in range(1, 5) if committed(step)
            ]
            target.send_signal(signal.SIGKILL)

            wait_until(lambda: ended(run_id), 600, "the two-host run finished", logs)
            runs0, runs1 = node_runs(0), node_runs(1)
            state = prefect_api(api, f"/flow_runs/{run_id}")["state"]
            assert len(runs0) == len(runs1) == 2, (
                f"the run ended {state['type']} ({state.get('message')}) with node flow runs "
                f"{[(r['name'], r['state_type']) for r in runs0 + runs1]}\n{logs()}"
            )
            (first0, node0), (first1, node) = runs0, runs1
            lost_node = (first0, first1)[lost]
            for run in (node0, node):
                wait_until(lambda: ended(run["id"]), 60, f"{run['name']} ended", logs)  # noqa: B023
            servers = sorted(_flow_runs(api, "rollflow-inference-server"), key=lambda r: r["name"])
            for server in servers:
                wait_until(lambda: ended(server["id"]), 60, f"{server['name']} ended", logs)  # noqa: B023
            out, node0_log = flow_run_log(api, run_id), flow_run_log(api, node0["id"])
            assert ended(run_id) == "COMPLETED", f"{out[-4000:]}\n{logs()}"
            assert ended(node0["id"]) == "COMPLETED", node0_log[-4000:]
            assert ended(node["id"]) == "COMPLETED", flow_run_log(api, node["id"])[-4000:]
            # Host 1's worker ran node 0 and host 0's node 1, children of the run's flow run.
            assert [
                (r["work_queue_name"], r["parent_task_run_id"] is not None) for r in (node0, node)
            ] == [
                ("host-1", True),
                ("default", True),
            ]
            # The lost node's flow run ended with its rank; the run restarted the trainer on both
            # nodes from its last checkpoint (both submitted again) and went on.
            assert ended(lost_node["id"]) in ("FAILED", "CANCELLED", "CRASHED"), lost_node
            # (Noticed by whichever comes first: node 0's rank 0 losing its peer, or the health
            # check reading node 1's flow run ended.)
            assert "trainer lost: " in out and "restarting it from committed step" in out, out
            assert out.count("trainer: node 1 submitted as flow run") == 2, out[-4000:]
            assert out.count("trainer: node 0 submitted as flow run") == 2, out[-4000:]
            print(next(line for line in out.splitlines() if "trainer: restarted in" in line))
            # One server on each host, each a child flow run, stopped with the run (cancelled),
            # its vLLM log in its flow run's log; each served at its own host's address.
            assert [(r["name"], r["work_queue_name"]) for r in servers] == [
                ("twonode: vLLM server 0", "default"),
                ("twonode: vLLM server 1", "host-1"),
            ]
            for server, host in zip(servers, (host0, host1), strict=True):
                server_log = flow_run_log(api, server["id"])
                assert server["parent_task_run_id"] is not None
                assert ended(server["id"]) == "CANCELLED", server_log[-4000:]
                assert f"starting at http://{host.address}:" in server_log, server_log[-4000:]
                assert "copying policy/step=0" in server_log
                # vLLM's own lines: its worker loaded weights the trainer sent over the group
                assert "Reloading weights inplace" in server_log, server_log[-4000:]
            # Each process's lines are in its flow run's log: node 1 had no copy of the policy and
            # loaded the one the run put in its storage.
            assert "1 rank(s) × 2 nodes" in out and "putting the policy in" in out
            # Node 0, on host 1, found its own address and said it; the run met it there.
            said = f"trainer: node 0 serves at http://{host1.address}:"
            assert said in out and f"meets the other nodes at {host1.address}" in out, out[-4000:]
            assert f"serving at http://{host1.address}:" in node0_log, node0_log[-4000:]
            # (the restarted node 0 the checkpoint it resumes from: host 1 has none of the run's
            # files; its first flow run copied the policy)
            assert "is not on this host: copying checkpoints/step=" in node0_log, node0_log[-4000:]
            first0_log = flow_run_log(api, first0["id"])
            assert "is not on this host: copying policy/step=0" in first0_log, first0_log[-4000:]
            run_dir = tmp_path / "copy" / "twonode"
            fs.get(f"rollflow/{tmp_path.name}/twonode/", str(run_dir), recursive=True)
            events = [
                json.loads(line)
                for part in sorted((run_dir / "events").glob("part-*.jsonl"))
                for line in part.read_text().splitlines()
            ]
            [restarted] = [e for e in events if e["event"] == "trainer_restarted"]
            assert restarted["resumed_from"] >= 1, restarted
            committed_steps = [e["step"] for e in events if e["event"] == "step_committed"]
            assert sorted(committed_steps) == [1, 2, 3, 4], committed_steps  # each once
            # Both servers sampled: every step's rollouts came from a fleet of two (a step whose
            # rollouts, committed before the restart, were reused sampled nothing).
            metrics = [
                pq.read_table(run_dir / "metrics" / f"step={step}.parquet").to_pylist()[0]
                for step in range(1, 5)
            ]
            sampled = [m for m in metrics if "inference_servers" in m]
            assert len(sampled) >= 3 and {m["inference_servers"] for m in sampled} == {2}, metrics
            last = sampled[-1]
            assert last["inference/0/requests"] > 0 and last["inference/1/requests"] > 0, last
            # The servers' key left the run's storage with them.
            assert not (run_dir / "control" / "servers" / "key.json").exists()
            # The layout check reads the run's events on S3 in this process (`rollflow status`
            # and the rerun, on host 0 with the server up, get the endpoint through ``env``).
            monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
            assert_documented_layout(
                run_dir,
                out,
                tmp_path,
                [str(config), *overrides],
                storage=storage,
                env={**env, "AWS_ENDPOINT_URL": endpoint},
            )
        finally:
            for service in reversed(services):  # the workers before the server they report to
                service.stop()


def _flow_run_root(proc: psutil.Process) -> psutil.Process:
    """The flow run process ``proc`` runs under (the outermost with its flow run id)."""
    flow_run_id = proc.environ().get("PREFECT__FLOW_RUN_ID")
    while (
        proc.parent() is not None
        and proc.parent().environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id
    ):
        proc = proc.parent()
    return proc


def _a_rank_of(flow_run_id: str) -> psutil.Process:
    """A trainer rank under the flow run ``flow_run_id``'s process (a trainer node's), on any
    host: the namespaced hosts share the process table."""

    def of_run(p: psutil.Process) -> bool:
        try:
            return p.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id
        except psutil.Error:
            return False

    deadline = time.monotonic() + 300  # the node's flow run starts, copies the policy, launches
    while time.monotonic() < deadline:
        for proc in psutil.process_iter():
            if of_run(proc) and not of_run(proc.parent()):
                # The rank itself (python [-u] -m <module>): its launcher and guard name the
                # module among their arguments.
                ranks = [p for p in proc.children(recursive=True) if _runs(p, RANK_MAIN_MODULE)]
                if ranks:
                    return ranks[-1]
        time.sleep(0.5)
    raise AssertionError(f"no trainer rank under flow run {flow_run_id} within 300 s")


def _runs(proc: psutil.Process, module: str) -> bool:
    """Whether ``proc`` is a Python interpreter running ``module`` (``python ... -m module``)."""
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return False
    python = bool(argv) and Path(argv[0]).name.startswith("python")  # not the guard's bash
    return python and "-m" in argv and argv[argv.index("-m") + 1 :][:1] == [module]


def _flow_runs(api: str, flow_name: str) -> list[dict]:
    return prefect_api(api, "/flow_runs/filter", {"flows": {"name": {"any_": [flow_name]}}})


def test_tensor_parallel_workers_are_ranks_of_the_weight_group(vllm_model_dirs, tmp_path):
    """vLLM on CPU with tensor parallelism 2 (the plan's thread binding): both workers join the
    group as ranks 1 and 2. A sync whose trainer side is lost mid-way fails on both workers, and
    the group formed anew afterwards works: every worker answered the failed call (a worker
    that raised left its peer's answer queued in vLLM's executor, which the rejoin then read as
    its own, and failed). After a sync the server serves the trainer's weights; its stop then
    leaves none of its processes behind."""
    from rollflow.infra.placement import make_plan
    from rollflow.infra.weights.group import WeightSender, weight_metadata
    from rollflow.services.vllm_server import InferenceServer

    served, new = vllm_model_dirs
    cfg = load_config(
        None,
        [
            f"model.path='{served}'",
            "envs=[{name='sort_letters'}]",
            "inference.tensor_parallel_size=2",
        ],
    )
    plan = make_plan(cfg, Machine(gpus=0, cpus=2))
    assert plan.weight_world_size == 3 and plan.servers[0].weight_ranks == (1, 2)
    server = InferenceServer(
        served,
        max_model_len=64,
        extra_args=plan.server_args(0),
        extra_env=plan.servers[0].env,
        log_path=tmp_path / "vllm-tp2.log",
        api_key=KEY,  # its workers prove it to join the weight group
    )
    model, expected = greedy_reference(new, PROMPT_IDS, 16)
    named = list(model.state_dict().items())

    class Source:
        sender = None
        lost_mid_sync = False  # the next broadcast: the trainer's side of the group ends instead

        def metadata(self):
            return WEIGHTS_METADATA.parse(weight_metadata(named))

        def weights_port(self):
            return free_port()

        def weights_connect(self, host, port, world_size, timeout_s, wire_device, bucket_bytes):
            self.sender = WeightSender(
                host, port, world_size, timeout_s, wire_device, bucket_bytes, secret=KEY
            )
            self.sender.connect()

        def weights_broadcast(self, version=None, timeout_s=None):
            if self.lost_mid_sync:
                self.lost_mid_sync = False
                self.sender.close()  # the workers' receive fails: their peer left the group
                raise RuntimeError("the trainer was lost mid-sync")
            sent = self.sender.broadcast(named, version)
            return SentReply(version=version, bytes=sent, broadcast_s=0.0)

        def weights_close(self, timeout_s=None):
            self.sender.close()

    source = Source()
    with server:
        spec = weights.GroupSpec.from_plan(plan, cfg.trainer.weight_bucket_mb)
        joined = weights.join(source, [(server.url, 1)], spec, timeout_s=60)
        assert sorted(joined["ranks"]) == [1, 2]
        source.lost_mid_sync = True
        with pytest.raises(Exception) as failed:
            weights.publish(source, [server.url], 1, timeout_s=60)
        print(f"\nthe failed sync: {failed.value!r}")
        joined = weights.join(source, [(server.url, 1)], spec, timeout_s=60)  # the rejoin
        assert sorted(joined["ranks"]) == [1, 2]
        weights.publish(source, [server.url], 1, timeout_s=60)
        assert greedy(server.url) == expected
        weights.leave(source, [server.url], timeout_s=10)
        procs = [psutil.Process(pid) for pid in server.pids()]
        start = time.monotonic()
    # The stop leaves no process behind: the guard, the API server, the engine, both workers.
    print(f"\nstop took {time.monotonic() - start:.1f}s")
    assert len(procs) >= 2 and not server.is_alive()
    assert not [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
