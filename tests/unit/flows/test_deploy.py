"""prefect.yaml, the work pool templates and `rollflow deploy`'s errors (no server needed)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prefect.client.orchestration import PrefectClient
from prefect.settings import PREFECT_API_URL, temporary_settings

from rollflow.cli import main
from rollflow.flows.deploy import plan_deployments
from rollflow.flows.names import (
    HEAL_ENTRYPOINT,
    NODE_ENTRYPOINT,
    SCALE_ENTRYPOINT,
    SERVER_ENTRYPOINT,
)
from rollflow.infra.config import dump_config, resolve_config
from rollflow.infra.errors import InputError
from rollflow.infra.processes import free_port
from rollflow.infra.work_pools import load_base_job_template

ROOT = Path(__file__).resolve().parents[3]
PREFECT_YAML = ROOT / "prefect.yaml"


# ------------------------------------------------------------------------------ planning


def test_every_deployment_of_prefect_yaml_runs_from_the_repository_root():
    quickstart, fleet, heal, node, server = plan_deployments(PREFECT_YAML)
    assert fleet["entrypoint"] == SCALE_ENTRYPOINT and fleet["pull"] == quickstart["pull"]
    assert heal["entrypoint"] == HEAL_ENTRYPOINT and heal["pull"] == quickstart["pull"]
    assert node["entrypoint"] == NODE_ENTRYPOINT and node["pull"] == quickstart["pull"]
    assert server["entrypoint"] == SERVER_ENTRYPOINT and server["pull"] == quickstart["pull"]
    assert quickstart["name"] == "quickstart"
    # The form's parameters: the config's sections as resolved, no overrides left to apply.
    assert quickstart["source"] == "configs/quickstart.toml"
    assert quickstart["parameters"] == {
        **dump_config(resolve_config(ROOT / "configs/quickstart.toml")),
        "overrides": [],
    }
    assert (
        quickstart["work_pool"]["name"] == "rollflow-cpu"
        and quickstart["work_pool"]["type"] == "process"
    )
    assert quickstart["pull"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}
    ]


def test_a_config_not_in_prefect_yaml_gets_a_deployment_named_after_it(tmp_path):
    config = tmp_path / "math-gpu.toml"
    config.write_text((ROOT / "configs/quickstart.toml").read_text())
    fleet, heal, node, server, entry = plan_deployments(
        PREFECT_YAML, [str(config)], pool="rollflow-gpu-kubernetes"
    )
    # The fleet's action, the heal, the trainer nodes and the servers serve every run: always
    # registered, on the run's pool.
    names = (fleet["name"], heal["name"], node["name"], server["name"])
    assert names == ("fleet", "crashed-run", "default", "default")
    assert node["work_pool"]["type"] == server["work_pool"]["type"] == "kubernetes"
    assert entry["name"] == "math-gpu"
    assert entry["source"] == str(config)  # outside the repository: absolute
    assert entry["parameters"]["run"]["name"] == "quickstart"  # its sections, from that file
    assert entry["work_pool"]["type"] == "kubernetes"
    # Container pools run the code baked into the image, not the deploying machine's folder.
    assert (
        entry["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"]
        == "/opt/rollflow"
    )


def test_a_listed_config_keeps_its_entry_and_moves_to_another_pool():
    *_, entry = plan_deployments(
        PREFECT_YAML, [str(ROOT / "configs/quickstart.toml")], pool="rollflow-gpu"
    )
    assert entry["name"] == "quickstart" and entry["work_pool"]["name"] == "rollflow-gpu"
    assert entry["source"] == "configs/quickstart.toml"


def test_unknown_pool_names_the_pools_there_are():
    with pytest.raises(
        InputError,
        match="unknown work pool 'gpu'.*rollflow-cpu, rollflow-gpu, "
        "rollflow-gpu-docker, rollflow-gpu-kubernetes",
    ):
        plan_deployments(PREFECT_YAML, pool="gpu")


def test_a_bad_config_fails_at_deploy_time_naming_the_deployment_and_key(tmp_path):
    text = PREFECT_YAML.read_text().replace("overrides: []", "overrides: [train.lrr=1e-4]")
    bad = tmp_path / "prefect.yaml"
    bad.write_text(text.replace("configs/quickstart.toml", str(ROOT / "configs/quickstart.toml")))
    with pytest.raises(
        InputError,
        match=r"(?s)rl-run/quickstart: .*unknown key 'train.lrr'; did you mean 'train.lr'",
    ):
        plan_deployments(bad)


def test_an_entrypoint_that_is_not_a_rollflow_flow_is_named(tmp_path):
    bad = tmp_path / "prefect.yaml"
    bad.write_text(PREFECT_YAML.read_text().replace("scale.py:scale_fleet", "scale.py:nope"))
    with pytest.raises(InputError, match=r"deployment 'fleet' has entrypoint .*scale.py:nope"):
        plan_deployments(bad)


def test_the_fleet_action_asks_the_run_as_rollflow_scale_does(tmp_path):
    from rollflow.flows.scale import scale_fleet
    from rollflow.infra.config import dump_config
    from rollflow.infra.storage import RunStorage
    from rollflow.infra.vllm_fleet.fleet import asked_servers

    storage = RunStorage(str(tmp_path), "quickstart")
    cfg = resolve_config("configs/quickstart.toml", ["inference.max_servers=2"])
    storage.write_json("config.json", dump_config(cfg))
    with pytest.raises(InputError, match="has room for 1 to 2 server"):
        scale_fleet.fn("quickstart", 3, str(tmp_path))
    assert asked_servers(storage) is None
    assert "asked run 'quickstart' for 2" in scale_fleet.fn("quickstart", 2, str(tmp_path))
    assert asked_servers(storage) == 2


def test_missing_files_say_what_to_do(tmp_path):
    with pytest.raises(
        InputError, match="run rollflow deploy from the repository root, or pass --prefect-file"
    ):
        plan_deployments(tmp_path / "prefect.yaml")
    with pytest.raises(InputError, match="config file not found: configs/nope.toml"):
        plan_deployments(PREFECT_YAML, ["configs/nope.toml"])


def test_flow_parameters_take_a_path_or_a_dict_plus_overrides():
    from_path = resolve_config("configs/quickstart.toml", ["run.num_steps=3"])
    from_dict = resolve_config(
        json.loads(json.dumps(from_path.model_dump(mode="json"))), ["run.name=other"]
    )
    assert (
        from_path.run.num_steps == 3
        and from_dict.run.num_steps == 3
        and from_dict.run.name == "other"
    )


# ------------------------------------------------------------------------------ templates


def render(job_configuration_class, name: str, values: dict):
    """The job a worker of that type would build for a flow run with these job variables."""
    template = load_base_job_template(ROOT / "workpools" / name)
    # No server call is needed: the templates hold no block or variable references.
    client = PrefectClient(api="http://127.0.0.1:9/api")
    return asyncio.run(
        job_configuration_class.from_template_and_values(template, values, client=client)
    )


def test_kubernetes_pool_requests_gpus_shared_memory_and_gpu_nodes():
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    job = render(
        KubernetesWorkerJobConfiguration,
        "rollflow-gpu-kubernetes.json",
        {
            "gpus": 4,
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "image": "registry.example/rollflow:1",
        },
    )
    pod = job.job_manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert container["image"] == "registry.example/rollflow:1"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    ]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    default = render(KubernetesWorkerJobConfiguration, "rollflow-gpu-kubernetes.json", {})
    default_pod = default.job_manifest["spec"]["template"]["spec"]
    assert default_pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert "nodeSelector" not in default_pod  # unset: any node with a free GPU


def test_docker_pool_requests_gpus_as_docker_run_gpus_does():
    import docker.types
    from prefect_docker.worker import DockerWorkerJobConfiguration

    job = render(DockerWorkerJobConfiguration, "rollflow-gpu-docker.json", {"gpus": 2})
    kwargs = job.container_create_kwargs
    assert job.image == "rollflow:latest" and kwargs["shm_size"] == "16g"
    # docker-py turns the worker's kwargs into the Engine API's HostConfig.
    host = docker.types.HostConfig(
        version="1.44", device_requests=kwargs["device_requests"], shm_size=kwargs["shm_size"]
    )
    assert host["DeviceRequests"] == [
        {"Driver": "nvidia", "Count": 2, "DeviceIDs": [], "Capabilities": [["gpu"]], "Options": {}}
    ]
    # Placed processes advertise their address to other hosts: the host's own, not a bridge's
    # 172.17.x that no other host reaches.
    assert job.network_mode == "host" and not job.networks


def test_process_pools_pass_gpus_and_keep_deployment_env():
    from prefect.workers.process import ProcessJobConfiguration

    gpu = render(
        ProcessJobConfiguration,
        "rollflow-gpu.json",
        {"cuda_visible_devices": "0,1", "env": {"X": "1"}},
    )
    assert gpu.env["CUDA_VISIBLE_DEVICES"] == "0,1" and gpu.env["X"] == "1"
    assert (
        "CUDA_VISIBLE_DEVICES" not in render(ProcessJobConfiguration, "rollflow-gpu.json", {}).env
    )
    cpu = render(ProcessJobConfiguration, "rollflow-cpu.json", {})
    assert cpu.env == {"TOKENIZERS_PARALLELISM": "false"}


def test_a_broken_template_names_the_file(tmp_path):
    (tmp_path / "bad.json").write_text('{"variables": {}}')
    with pytest.raises(InputError, match="bad.json: a base job template needs job_configuration"):
        load_base_job_template(tmp_path / "bad.json")


# ------------------------------------------------------------------------------ no server


def test_deploy_without_a_server_says_how_to_start_one(capsys):
    url = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    with temporary_settings(updates={PREFECT_API_URL: url}):
        assert main(["deploy", "--prefect-file", str(PREFECT_YAML)]) == 2
    err = capsys.readouterr().err
    assert f"no Prefect server answers at PREFECT_API_URL={url}" in err
    assert "rollflow ui" in err and "Connection refused" in err


def test_deploy_without_an_api_url_says_how_to_set_one(capsys):
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert main(["deploy", "--prefect-file", str(PREFECT_YAML)]) == 2
    err = capsys.readouterr().err
    assert "PREFECT_API_URL is not set" in err
    assert "prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api" in err
