"""``[run]``: the run's identity, storage, seed and step counts."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rollflow.infra.config.base import Section


class RunSection(Section):
    """Identity of the run and where its data lands."""

    name: str = Field(
        "quickstart",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Run name; storage sub-folder. Default: the config file's name (my-task.toml: "
        "my-task), so two configs never share a run by accident; 'quickstart' without a file.",
    )
    resume_changed: bool = Field(
        False,
        description="Resume a run whose committed steps were made with another model.path, "
        "model.revision, model.tiny or envs, with the new values; false: such a rerun is refused "
        "before any service starts (give it a new run.name).",
    )
    storage: str = Field("runs", description="Storage root: a local folder or an s3:// URI.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options, e.g. {endpoint_url=...} for S3. Credentials given here "
        "(key, secret, token, ...) are taken out before the config is stored (infra/secrets.py).",
    )
    storage_secret: str | None = Field(
        None,
        description="Name of a Prefect Secret block holding a JSON object of fsspec options "
        "(credentials), merged into storage_options at run time; never stored with the config. "
        "Needs a Prefect server (PREFECT_API_URL). Without it, use the environment "
        "(AWS_ACCESS_KEY_ID, ...).",
    )
    api_outage_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long the run waits for its Prefect API when it stops answering (one "
        "line when it goes, one when it is back; steps wait for it); past it the run stops "
        "cleanly with its resume command.",
    )
    storage_outage_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long the run waits for its object store (run.storage on s3://) when it "
        "stops answering (one line after 10 s, one when it answers again); past it the run stops "
        "cleanly with its resume command (nothing half-written counts: a step commits last).",
    )
    seed: int = Field(0, description="Seed for prompt order and sampling.")
    num_steps: int = Field(40, ge=1, description="Outer training steps (weight syncs).")
    eval_every: int = Field(
        10, ge=0, description="Held-out evaluation every N steps (0: only at start and end)."
    )
    checkpoint_every: int = Field(
        1, ge=1, description="Checkpoint every N steps; resume restarts after the last one."
    )
    keep_checkpoints: int | None = Field(
        None,
        ge=1,
        description="Keep the last N committed checkpoints, removing older ones after each new "
        "one commits (never the latest nor the one the run resumed from); None: keep all.",
    )
    keep_best_checkpoint: bool = Field(
        True,
        description="With keep_checkpoints: keep also the checkpoint of the step with the best "
        "held-out reward so far (evaluated at that step), whatever its age.",
    )
    max_reruns: int = Field(
        2,
        ge=0,
        description="Reruns of a crashed run flow (its process or host lost) that the "
        "`rollflow-heal` automation starts, each resuming from storage (0: none).",
    )
