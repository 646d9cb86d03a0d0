"""Preflight: what a run needs, checked before the Prefect API or any service starts.

Owns the checks a user's mistake would otherwise meet half a minute into a run, as a
traceback from a service: the model (a folder with a config and weights, or a hub id that is
cached or reachable), the storage (reachable, credentials present, writable: a probe object is
written and removed), the environments (they load, their datasets included), the metric sinks
(their packages are installed), LoRA's target modules (each names a linear layer of the model),
the free disk for checkpoints, and the placement plan on this host.

Invariant: every check runs under a deadline (``PROBE_DEADLINE_S`` for anything that touches the
network), every failure is one line naming the key, its value and what to do, and all failures
are reported together. ``rollflow run --dry-run`` runs the same checks, except that a hub id
that is not cached is only noted (checking it would need the network the run will have).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollflow.infra.config import RunConfig
from rollflow.infra.errors import ConfigError
from rollflow.infra.secrets import load_storage_secret, merge, secret_storage_options
from rollflow.infra.storage_access import fail_fast_fs, failure_kind, within_deadline

PROBE_DEADLINE_S = 4.0
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")
# A checkpoint holds the HF export, fp32 Adam moments and the sharded model state: ~4x the weights.
CHECKPOINT_OVER_WEIGHTS = 4
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


class PreflightError(ConfigError):
    """One or more preflight checks failed; the message has one line per failure."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass
class Preflight:
    """The checks of one config; ``run()`` raises ``PreflightError`` listing every failure."""

    cfg: RunConfig
    dry_run: bool = False
    note: Callable[[str], None] = lambda _: None
    problems: list[str] = field(default_factory=list)
    weight_bytes: int = 0

    def run(self) -> None:
        for check in (
            self.model,
            self.storage,
            self.envs,
            self.advantage,
            self.lora,
            self.sinks,
            self.disk,
            self.placement,
        ):
            check()
        if self.problems:
            raise PreflightError(self.problems)

    def fail(self, key: str, value: Any, what: str) -> None:
        self.problems.append(f"{key} = {_show(value)}: {what}")

    # ------------------------------------------------------------------ model

    def model(self) -> None:
        path = self.cfg.model.path
        if path is None:
            return  # a tiny model is built locally; its envs are checked in envs()
        local = Path(path).expanduser()
        if local.exists() or not _HUB_ID.match(path):
            self._model_folder(path, local)
        else:
            self._hub_model(path)

    def _model_folder(self, path: str, folder: Path) -> None:
        if not folder.is_dir():
            what = "is a file, not a folder" if folder.exists() else "no such folder"
            self.fail(
                "model.path",
                path,
                f"{what}; give a Hugging Face model folder (config.json + *.safetensors) "
                "or a hub id such as Qwen/Qwen2.5-0.5B-Instruct",
            )
            return
        config = folder / "config.json"
        if not config.is_file():
            self.fail(
                "model.path", path, "the folder has no config.json; is it a Hugging Face model?"
            )
        else:
            try:
                parsed = json.loads(config.read_text())
                if not isinstance(parsed, dict) or "model_type" not in parsed:
                    raise ValueError("no model_type")
            except (ValueError, OSError) as exc:
                self.fail(
                    "model.path",
                    path,
                    f"its config.json is not a Hugging Face model config ({exc}); "
                    "re-save the model with save_pretrained()",
                )
        weights = [p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern)]
        if not weights:
            self.fail(
                "model.path",
                path,
                "the folder has no weights (*.safetensors or *.bin); save the model with "
                "save_pretrained() or download it whole",
            )
        self.weight_bytes = sum(p.stat().st_size for p in weights)

    def _hub_model(self, repo: str) -> None:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo, "config.json")
        if isinstance(cached, str):
            snapshot = Path(cached).parent
            weights = [p for pattern in WEIGHT_PATTERNS for p in snapshot.glob(pattern)]
            self.weight_bytes = sum(p.stat().st_size for p in weights)
            if weights:
                return
        if self.dry_run:
            self.note(f"model.path = {repo!r}: not in the Hugging Face cache; the run downloads it")
            return
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
            self.fail(
                "model.path",
                repo,
                "not in the Hugging Face cache and HF_HUB_OFFLINE is set; download it first "
                f"(huggingface-cli download {repo}) or point model.path at a local folder",
            )
            return
        outcome = within_deadline(
            lambda: _hub_lookup(repo),
            PROBE_DEADLINE_S,
            f"not in the Hugging Face cache and the hub gave no answer in {PROBE_DEADLINE_S:.0f} s; "
            "download it first, or point model.path at a local folder",
        )
        if outcome is not None:
            self.fail("model.path", repo, outcome)

    # ---------------------------------------------------------------- storage

    def storage(self) -> None:
        run = self.cfg.run
        if run.storage_secret:
            if not os.environ.get("PREFECT_API_URL"):
                self.fail(
                    "run.storage_secret",
                    run.storage_secret,
                    "a Prefect Secret block needs a Prefect server: set PREFECT_API_URL, "
                    "or give the credentials in the environment (e.g. AWS_ACCESS_KEY_ID)",
                )
                return
            try:
                load_storage_secret(run)
            except Exception as exc:  # not found, not JSON, server down
                self.fail("run.storage_secret", run.storage_secret, f"cannot load it: {exc}")
                return
        outcome = within_deadline(
            lambda: _probe_storage(run.storage, run.name, run.storage_options),
            PROBE_DEADLINE_S,
            (
                "run.storage_options.endpoint_url"
                if run.storage_options.get("endpoint_url")
                else "run.storage",
                f"no answer within {PROBE_DEADLINE_S:.0f} s; "
                "check the address and that the service is up",
            ),
        )
        if outcome is not None:
            key, what = outcome
            value = run.storage_options.get("endpoint_url") if key.endswith("url") else run.storage
            self.fail(key, value, what)
        placing = [
            key
            for key, value in (
                ("trainer.node_deployment", self.cfg.trainer.node_deployment),
                ("inference.server_deployment", self.cfg.inference.server_deployment),
            )
            if value
        ]
        if placing and "://" not in run.storage:
            self.note(
                f"warning: run.storage = {_show(run.storage)} is a folder of this host, and "
                f"{' and '.join(placing)} place processes on other hosts, which get the policy, "
                "the checkpoints and the run's key from it: they find it only if every host "
                "mounts it at that path; use object storage (s3://...) otherwise"
            )

    # ------------------------------------------------------ envs, sinks, disk

    def envs(self) -> None:
        from rollflow.tasks.generate.environments import load_env

        for i, spec in enumerate(self.cfg.envs):
            try:
                env = load_env(
                    spec.name,
                    spec.args,
                    rewards=spec.rewards,
                    reward_timeout_s=spec.reward_timeout_s,
                    key=f"envs[{i}]",
                )
            except (ValueError, OSError) as exc:
                if f"envs[{i}].rewards" in str(exc):  # the message names the key and the file
                    self.problems.append(str(exc))
                else:
                    self.fail(f"envs[{i}].name", spec.name, str(exc))
                continue
            if self.cfg.model.tiny is not None and not hasattr(env, "sft_examples"):
                self.fail(
                    f"envs[{i}].name",
                    spec.name,
                    "[model.tiny] warm-starts on its envs' sft_examples() and this env has none; "
                    "use model.path, or an env with sft_examples()",
                )
                continue
            skipped = env.num_skipped_rows
            self.note(
                f"env {spec.name}: loads"
                + (f", {skipped} malformed dataset rows skipped" if skipped else "")
            )

    def advantage(self) -> None:
        """The estimator train.advantage names loads and takes train.advantage_args."""
        from rollflow.infra.errors import ConfigError
        from rollflow.tasks.advantage.advantages import advantage_fn

        try:
            advantage_fn(self.cfg.train)
        except ConfigError as exc:
            self.fail("train.advantage", self.cfg.train.advantage, str(exc))

    def lora(self) -> None:
        """train.lora: peft is installed, and every target module is a linear layer of the model
        (peft's rule: a module's name equals it or ends with '.' + it). The model is built from its
        config on the meta device: no weights are read."""
        import importlib.util

        lora = self.cfg.train.lora
        if lora is None:
            return
        if importlib.util.find_spec("peft") is None:
            self.fail(
                "train.lora",
                lora.model_dump(),
                "the peft package is not installed: pip install 'rollflow[lora]', or remove "
                "[train.lora]",
            )
            return
        linear = _linear_layer_names(self.cfg)
        if linear is None:
            return  # the model's config is not here (a hub id not cached): the trainer checks it
        unmatched = [
            t for t in lora.target_modules if not any(n == t or n.endswith("." + t) for n in linear)
        ]
        if unmatched:
            kinds = sorted({n.rsplit(".", 1)[-1] for n in linear})
            self.fail(
                "train.lora.target_modules",
                lora.target_modules,
                f"{unmatched} name no linear layer of the model; its linear layers are {kinds}",
            )

    def sinks(self) -> None:
        import importlib.util

        from rollflow.infra.metrics_sinks import PACKAGES

        for sink in self.cfg.metrics.sinks:
            module, install = PACKAGES[sink]
            if importlib.util.find_spec(module) is None:
                self.fail(
                    "metrics.sinks",
                    self.cfg.metrics.sinks,
                    f"the {module} package is not installed: {install}, "
                    f"or remove {sink!r} from metrics.sinks",
                )

    def disk(self) -> None:
        """Room for one checkpoint is required (staged locally, then uploaded); room for every
        checkpoint the run keeps on local storage is advised."""
        if not self.weight_bytes:
            return
        one = self.weight_bytes * CHECKPOINT_OVER_WEIGHTS
        run = self.cfg.run
        import tempfile

        staging = Path(tempfile.gettempdir())
        free = shutil.disk_usage(staging).free
        if free < one:
            self.fail(
                "free disk",
                str(staging),
                f"{_gib(free)} free, a checkpoint needs ~{_gib(one)}; free space or set TMPDIR",
            )
        if "://" in run.storage and not run.storage.startswith("file://"):
            return
        root = _existing_parent(Path(run.storage.removeprefix("file://")).expanduser())
        kept = run.num_steps // run.checkpoint_every
        free = shutil.disk_usage(root).free
        if free < one * kept:
            self.note(
                f"warning: run.storage = {run.storage!r} has {_gib(free)} free; "
                f"{kept} checkpoints need ~{_gib(one * kept)} (raise run.checkpoint_every)"
            )

    # ------------------------------------------------------------------ placement

    def placement(self) -> None:
        """The plan the run's services will be placed by, on this host (``rollflow plan``'s):
        a run that cannot be placed (a device this host lacks, more GPUs or cores than it has)
        fails here, not once its Prefect API is up; a dry run notes it."""
        from rollflow.infra.placement import Machine, PlanError, make_plan

        try:
            make_plan(self.cfg, Machine.here(nodes=self.cfg.trainer.num_nodes))
        except PlanError as exc:
            if not self.dry_run:
                self.problems.append(f"placement: {exc}")
                return
            # A dry run validates a config for where it will run: a GPU config on a laptop.
            self.note(
                f"warning: placement on this host: {exc} (a run started here would stop there; "
                "`rollflow plan` plans for another machine)"
            )


def preflight(cfg: RunConfig, *, dry_run: bool = False, note=lambda _: None) -> None:
    """Run every check of ``cfg``; raise ``PreflightError`` with one line per failure."""
    Preflight(cfg, dry_run=dry_run, note=note).run()


def _linear_layer_names(cfg: RunConfig) -> list[str] | None:
    """Names of the policy's ``nn.Linear`` modules, built from its config on the meta device;
    None when the config cannot be read here."""
    import torch

    if cfg.model.tiny is not None:
        from rollflow.infra.models.tiny import build_tiny_llama

        with torch.random.fork_rng(), torch.device("meta"):  # it seeds torch's global RNG
            model = build_tiny_llama(cfg.model.tiny, vocab_size=64)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
        except (OSError, ValueError):
            return None  # model() reports a folder without a config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _probe_storage(root: str, run: str, options: dict[str, Any]) -> tuple[str, str] | None:
    """Write and remove a probe object; None if it worked, else (key, what to do)."""
    import fsspec

    protocol = fsspec.core.split_protocol(root)[0] or "file"
    where = "run.storage"
    opts = merge(dict(options), secret_storage_options(root))  # credentials handed over
    if protocol in ("s3", "s3a") and opts.get("endpoint_url"):
        where = "run.storage_options.endpoint_url"
    folder = root
    try:
        fs, base = fail_fast_fs(f"{root.rstrip('/')}/{run}", opts, read_timeout_s=3)
        if protocol == "file":  # probe the folder the run will be created in; create nothing
            base = folder = str(_existing_parent(Path(base)))
            if not Path(base).is_dir():
                raise NotADirectoryError(20, "a file, not a folder")
        probe = f"{base}/.rollflow-preflight-{uuid.uuid4().hex[:8]}"
        fs.pipe_file(probe, b"preflight")
        fs.rm_file(probe)
    except Exception as exc:  # classified below into a line a user can act on
        return _storage_problem(exc, where, protocol, folder)
    return None


def _storage_problem(exc: Exception, where: str, protocol: str, folder: str) -> tuple[str, str]:
    kind, name, text = failure_kind(exc)
    if kind == "no credentials":
        return (
            "run.storage",
            "no S3 credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE) in the environment",
        )
    if protocol == "file":
        reason = getattr(exc, "strerror", None) or text
        return (
            "run.storage",
            f"cannot write in {folder} ({reason}); choose a writable folder",
        )
    if kind == "denied":
        return "run.storage", f"not allowed to write there ({text}); check the credentials' rights"
    if kind == "no bucket" or isinstance(exc, FileNotFoundError):
        return "run.storage", f"the bucket does not exist; create it ({text})"
    if kind == "no answer":
        return where, f"no answer ({text}); check the address and that the service is up"
    if kind == "unreachable":
        return where, f"unreachable ({text}); check the address and that the service is up"
    return where, f"the probe write failed: {name}: {text}"


def _hub_lookup(repo: str) -> str | None:
    from huggingface_hub import HfApi
    from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(repo, timeout=PROBE_DEADLINE_S - 1)
    except GatedRepoError:
        return "a gated model: accept its terms on the hub and log in (huggingface-cli login)"
    except RepositoryNotFoundError:
        return "no such model on the Hugging Face hub (or it is private: huggingface-cli login)"
    except Exception as exc:
        return (
            f"not in the Hugging Face cache and the hub is unreachable ({type(exc).__name__}); "
            "download it where there is a network, or point model.path at a local folder"
        )
    return None


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB"


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
