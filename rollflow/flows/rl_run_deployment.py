"""The run flow as deployments run it: a config path or dict plus overrides (`rl-run/<config name>`).

A deployment is ``rl-run/<config name>``. Its two parameters are what a user passes with
``prefect deployment run 'rl-run/quickstart' -p overrides='["run.num_steps=10"]'``:

- ``config``: a TOML path, relative to the deployment's working directory (the repository root),
  or a whole config as a dict (what the UI's parameter form edits);
- ``overrides``: ``key.path=value`` strings applied on top, exactly as on ``rollflow run``.

A worker runs the flow in a fresh process; the run flow starts (and stops) its own services there,
as it does under ``rollflow run``. ``rollflow deploy`` registers the deployments (``deploy.py``).
"""

from __future__ import annotations

from prefect import flow

from rollflow.flows.names import FLOW_NAME
from rollflow.flows.preflight import preflight
from rollflow.flows.rl_run import rl_run
from rollflow.infra.config import dump_config, resolve_config
from rollflow.infra.secrets import take_secrets_out


def _flow_run_name() -> str:
    """Name the flow run after the run it trains, as `rollflow run` does."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    try:
        return resolve_config(
            params.get("config", "configs/quickstart.toml"), params.get("overrides") or []
        ).run.name
    except Exception:  # a bad config fails the run itself, with its own message
        return FLOW_NAME


@flow(name=FLOW_NAME, flow_run_name=_flow_run_name, persist_result=False, validate_parameters=False)
def rl_run_config(
    config: str | dict = "configs/quickstart.toml", overrides: list[str] | None = None
) -> dict:
    """Train (or resume) the run that ``config`` with ``overrides`` describes (see ``rl_run``)."""
    cfg = resolve_config(config, overrides or [])
    take_secrets_out(cfg.run)  # out of config.json (the deployment's own parameter has them)
    preflight(cfg, note=print)
    return rl_run.fn(dump_config(cfg))  # this flow run is the run flow's run: no nested rl-run
