"""Prefect work pools for rollflow, created from the base job templates in ``workpools/``.

A pool definition (in ``prefect.yaml`` under ``definitions.work_pools``) names the pool, its
worker type (process, docker, kubernetes) and its base job template file. The GPU templates
request GPUs for real: ``nvidia.com/gpu`` limits on Kubernetes, ``device_requests`` on Docker,
``CUDA_VISIBLE_DEVICES`` on a process pool whose worker runs on the GPU host.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollflow.infra.errors import InputError

REQUIRED_KEYS = ("name", "type", "base_job_template")


def load_base_job_template(path: Path) -> dict[str, Any]:
    """A base job template: ``job_configuration`` (with ``{{ variable }}`` placeholders) and the
    JSON schema of its ``variables``."""
    try:
        template = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"base job template not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: not valid JSON: {exc}") from None
    missing = [k for k in ("job_configuration", "variables") if k not in template]
    if missing:
        raise InputError(f"{path}: a base job template needs {' and '.join(missing)}")
    return template


def ensure_work_pool(client, pool: dict[str, Any], base_dir: Path) -> str:
    """Create ``pool`` on the server unless a pool of that name exists (then it is left as it is,
    so edits made in the UI survive); returns what happened, for the user."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    try:
        existing = client.read_work_pool(pool["name"])
        return f"work pool {existing.name} ({existing.type}): exists, left as it is"
    except ObjectNotFound:
        pass
    missing = [k for k in REQUIRED_KEYS if not pool.get(k)]
    if missing:
        raise InputError(
            f"work pool {pool.get('name')!r} does not exist on the server and its definition "
            f"lacks {', '.join(missing)}; define it under definitions.work_pools in prefect.yaml"
        )
    path = base_dir / pool["base_job_template"]
    template = load_base_job_template(path)
    client.create_work_pool(
        WorkPoolCreate(
            name=pool["name"],
            type=pool["type"],
            base_job_template=template,
            description=template["variables"].get("description"),
        )
    )
    return f"work pool {pool['name']} ({pool['type']}): created from {pool['base_job_template']}"
