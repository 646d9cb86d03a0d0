"""The run flow as deployments run it, from a typed form (`rl-run/<config name>`).

A deployment is ``rl-run/<config name>``. Its parameters are the run configuration's sections
(``run``, ``model``, ``envs``, ``prompt``, ``sampling``, ``train``, ``inference``, ``trainer``,
``metrics``), which the Prefect UI renders as one field per setting (``run_form.py`` owns the
schema), then ``overrides`` and ``config``:

- ``prefect deployment run 'rl-run/quickstart' -p train='{"lr": 1e-4}'``: a section, given in
  part, laid over the deployment's own;
- ``-p overrides='["run.num_steps=10"]'``: ``key.path=value`` strings applied last, as on
  ``rollflow run``;
- ``-p config=configs/other.toml``: that file (or a whole config as a dict) instead of the form.

A worker runs the flow in a fresh process; the run flow starts (and stops) its own services there,
as it does under ``rollflow run``. ``rollflow deploy`` registers the deployments (``deploy.py``).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from rollflow.flows.names import FLOW_NAME
from rollflow.flows.preflight import preflight
from rollflow.flows.rl_run import rl_run
from rollflow.flows.run_form import config_from_parameters
from rollflow.infra.config import dump_config
from rollflow.infra.secrets import take_secrets_out


def _deployment_parameters() -> dict[str, Any]:
    """The parameters of the deployment this flow run came from ({} outside one)."""
    from prefect.runtime import deployment

    try:
        return dict(deployment.parameters or {})
    except Exception:  # noqa: BLE001 - no deployment, or its API gone: the run's own only
        return {}


def _flow_run_name() -> str:
    """Name the flow run after the run it trains, as `rollflow run` does."""
    from prefect.runtime import flow_run

    try:
        return config_from_parameters(flow_run.parameters, _deployment_parameters()).run.name
    except Exception:  # a bad config fails the run itself, with its own message
        return FLOW_NAME


@flow(name=FLOW_NAME, flow_run_name=_flow_run_name, persist_result=False, validate_parameters=False)
def rl_run_config(
    run: dict | None = None,
    model: dict | None = None,
    envs: list[dict] | None = None,
    prompt: dict | None = None,
    sampling: dict | None = None,
    train: dict | None = None,
    inference: dict | None = None,
    trainer: dict | None = None,
    metrics: dict | None = None,
    overrides: list[str] | None = None,
    config: str | dict | None = None,
) -> dict:
    """Train (or resume) the run the form's sections describe (each given in part laid over the
    deployment's own), or ``config`` instead of them; ``overrides`` applied last (see ``rl_run``)."""
    parameters = {k: v for k, v in locals().items() if v is not None}
    cfg = config_from_parameters(parameters, _deployment_parameters())
    take_secrets_out(cfg.run)  # out of config.json (a `config` file may hold some)
    preflight(cfg, note=print)
    return rl_run.fn(dump_config(cfg))  # this flow run is the run flow's run: no nested rl-run
