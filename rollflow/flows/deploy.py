"""Registration of the run flow's deployments on a Prefect server (``rollflow deploy``).

``prefect.yaml`` lists the deployments (``rl-run/<config name>``) and, under
``definitions.work_pools``, the pools they run on. Registering needs no import of the flow (nor of
torch): the parameter schema is read from the entrypoint's source, as ``prefect deploy`` does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from rollflow.flows.names import ENTRYPOINT, FLOW_NAME, FLOWS, HEAL_ENTRYPOINT, HEAL_FLOW_NAME
from rollflow.flows.run_form import form_parameters, form_schema
from rollflow.infra.config import resolve_config
from rollflow.infra.errors import ConfigError, InputError

DEFAULT_POOL = "rollflow-cpu"


def plan_deployments(
    prefect_file: Path, configs: Sequence[str] = (), pool: str | None = None
) -> list[dict]:
    """The deployments to register, as prefect.yaml entries with their work pool resolved.

    No ``configs``: every deployment of the file. Otherwise one per config: the file's entry for
    that config if it has one, else ``rl-run/<file stem>`` on the default pool; and the file's
    deployments of rollflow's other flows (the fleet's ``rollflow-scale``), which serve every
    run. ``pool`` moves them all to another pool of the file's ``definitions.work_pools``.
    """
    root = prefect_file.resolve().parent  # the pull step needs an absolute directory
    doc = _read_prefect_file(prefect_file)
    pools = {
        p["name"]: p for p in ((doc.get("definitions") or {}).get("work_pools") or {}).values()
    }
    listed = doc.get("deployments") or []
    if pool is not None and pool not in pools:
        raise InputError(
            f"unknown work pool {pool!r}; {prefect_file} defines {', '.join(sorted(pools))}"
        )
    for entry in listed:
        entrypoint = entry.get("entrypoint", ENTRYPOINT)
        if entrypoint not in FLOWS:
            raise InputError(
                f"{prefect_file}: deployment {entry.get('name')!r} has entrypoint {entrypoint!r}, "
                f"not one of rollflow's flows ({', '.join(sorted(FLOWS))})"
            )
    chosen = [copy.deepcopy(d) for d in listed if not configs or not _is_run(d)]
    for path in configs:
        rel = _config_parameter(Path(path), root)
        entry = next((d for d in listed if (d.get("parameters") or {}).get("config") == rel), None)
        chosen.append(
            copy.deepcopy(entry)
            if entry
            else {
                "name": Path(path).stem,
                "description": f"rollflow run {rel}",
                "entrypoint": ENTRYPOINT,
                "parameters": {"config": rel, "overrides": []},
                "tags": ["rollflow"],
                "work_pool": pools.get(DEFAULT_POOL, {"name": DEFAULT_POOL}),
            }
        )
    for entry in chosen:
        if pool is not None:
            entry["work_pool"] = pools[pool]
        name = entry["work_pool"].get("name")
        entry["work_pool"] = {**pools.get(name, {}), **entry["work_pool"]}
        entry["pull"] = (
            entry.get("pull")
            or doc.get("pull")
            or [
                {
                    "prefect.deployments.steps.set_working_directory": {
                        "directory": entry["work_pool"].get("working_dir") or str(root)
                    }
                }
            ]
        )
        if _is_run(entry):
            _check_config(entry, root)
    if not chosen:
        raise InputError(
            f"{prefect_file} lists no deployments; name a config: rollflow deploy configs/quickstart.toml"
        )
    return chosen


def deploy(
    prefect_file: Path,
    configs: Sequence[str] = (),
    pool: str | None = None,
    out: Callable[[str], None] = print,
) -> list[str]:
    """Create the work pools the deployments use (when missing), then register the deployments
    on the server of PREFECT_API_URL; returns their full names."""
    from prefect.client.orchestration import get_client
    from prefect.utilities.callables import parameter_schema_from_entrypoint

    from rollflow.infra.prefect_api import require_prefect_server
    from rollflow.infra.work_pools import ensure_work_pool

    entries = plan_deployments(prefect_file, configs, pool)  # bad input fails before any call
    url = require_prefect_server()
    root = prefect_file.resolve().parent
    schemas, flow_ids = {}, {}  # per entrypoint
    names = []
    with get_client(sync_client=True) as client:
        for pool_def in {e["work_pool"]["name"]: e["work_pool"] for e in entries}.values():
            out(ensure_work_pool(client, pool_def, root))
        for entry in entries:
            work_pool = entry["work_pool"]
            entrypoint = entry.get("entrypoint", ENTRYPOINT)
            flow_name = FLOWS[entrypoint]
            if entrypoint not in schemas:
                flow_ids[entrypoint] = client.create_flow_from_name(flow_name)
                path, _, name = entrypoint.partition(":")
                schemas[entrypoint] = (
                    form_schema()  # the run configuration's own sections, typed
                    if entrypoint == ENTRYPOINT
                    else parameter_schema_from_entrypoint(f"{root / path}:{name}").model_dump(
                        exclude_unset=True
                    )
                )
            parameters = entry.get("parameters") or {}
            client.create_deployment(  # creates, or updates the deployment of that name
                flow_id=flow_ids[entrypoint],
                name=entry["name"],
                entrypoint=entrypoint,
                parameters=parameters,
                parameter_openapi_schema=schemas[entrypoint],
                description=entry.get("description"),
                tags=entry.get("tags") or [],
                work_pool_name=work_pool["name"],
                work_queue_name=work_pool.get("work_queue_name"),
                job_variables=work_pool.get("job_variables") or {},
                pull_steps=entry["pull"],
                # Prefect checks a run's form against the config's types before the flow run
                # is created; the tools' parameters are checked by their flows.
                enforce_parameter_schema=entrypoint == ENTRYPOINT,
            )
            names.append(f"{flow_name}/{entry['name']}")
            what = f"config {entry.get('source')!r}" if flow_name == FLOW_NAME else "a tool"
            out(f"deployment {names[-1]} on pool {work_pool['name']} ({what}) registered at {url}")
        healers = [
            e for e in entries if e.get("entrypoint") == HEAL_ENTRYPOINT
        ]  # the heal automations run the heal deployment: made for it, and kept current
        if healers:
            heal = client.read_deployment_by_name(f"{HEAL_FLOW_NAME}/{healers[0]['name']}")
            for line in ensure_heal_automations(client, heal.id):
                out(line)
    runs = [e for e in entries if _is_run(e)]
    if runs:
        out(
            f"next: start a worker with `prefect worker start --pool {runs[0]['work_pool']['name']}`, "
            f"then run `prefect deployment run '{FLOW_NAME}/{runs[0]['name']}' "
            f"-p overrides='[\"run.num_steps=10\"]'`"
        )
    return names


def ensure_heal_automations(client: Any, heal_deployment_id: Any) -> list[str]:
    """Create the heal automations (``heal.py``) for the heal deployment, replacing any of the
    same name (the deployment's id, the heartbeat interval may have changed); returns what was
    done. The silent-run one waits ``heal.SILENT_HEARTBEATS`` × the heartbeat interval this
    process's Prefect settings give (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, which the workers'
    flow runs must share)."""
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import get_current_settings

    from rollflow.flows.heal import heal_automations

    heartbeat_s = get_current_settings().flows.heartbeat_frequency or 180
    lines = []
    for automation in heal_automations(heal_deployment_id, heartbeat_s):
        for old in client.read_automations_by_name(automation.name):
            try:
                client.delete_automation(old.id)
            except PrefectHTTPStatusError as err:
                # Gone already: the client's retry of a delete the server had done (a busy
                # SQLite writer answers late), or another deploy's. What was asked is done.
                if err.response.status_code != 404:
                    raise
        client.create_automation(automation)
        lines.append(f"automation {automation.name!r} registered")
    return lines


def _is_run(entry: dict) -> bool:
    """Whether a prefect.yaml entry deploys the run flow (not one of rollflow's tools)."""
    return entry.get("entrypoint", ENTRYPOINT) == ENTRYPOINT


def _read_prefect_file(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise InputError(
            f"{path} not found; run rollflow deploy from the repository root, "
            "or pass --prefect-file PATH"
        ) from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path}: expected a mapping with a `deployments` list")
    return doc


def _config_parameter(path: Path, root: Path) -> str:
    """The config as a deployment parameter: relative to the repository root when inside it."""
    resolved = path.resolve()
    if not resolved.is_file():
        raise InputError(f"config file not found: {path}")
    try:
        return resolved.relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(resolved)


def _check_config(entry: dict, root: Path) -> None:
    """Validate a deployment's config now, not when a worker first runs it, and make its
    parameters the typed form's: the config's sections (``run_form.form_parameters``; a config
    given as a dict stays one). The config it came from is kept as ``entry["source"]``."""
    params = entry.get("parameters") or {}
    config = params.get("config", "configs/quickstart.toml")
    entry["source"] = config
    if isinstance(config, str) and not Path(config).is_absolute():
        config = str(root / config)
    try:
        if isinstance(config, str):
            entry["parameters"] = form_parameters(Path(config), params.get("overrides") or [])
        else:
            resolve_config(config, params.get("overrides") or [])
    except ConfigError as exc:
        raise InputError(f"deployment {FLOW_NAME}/{entry.get('name')}: {exc}") from None
