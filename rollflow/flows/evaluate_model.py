"""``rollflow eval``: a committed checkpoint or an exported model on the config's held-out prompts.

Owns: where the evaluated model comes from (``--checkpoint STEP``: the run's committed checkpoint,
copied out of its storage as ``rollflow export --merged`` writes it; ``--model PATH``: a Hugging
Face model folder), the vLLM server it is served by for the evaluation (started here, stopped
before returning), and where the results go: ``<run>/evals/<label>/samples.parquet`` and
``summary.parquet`` beside the run, ``label`` naming the model and k (``step=20-k1``,
``model=qwen-k8``). The evaluation itself is the run's own (``generate_task.evaluate_policy``),
so a checkpoint's greedy figures are those its run logged at that step.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rollflow.infra.config import RunConfig
from rollflow.infra.errors import InputError
from rollflow.infra.export import export_checkpoint
from rollflow.infra.storage import RunStorage
from rollflow.infra.storage_access import RunAddress, open_run, storage_errors
from rollflow.infra.vllm_fleet.client import InferenceClient
from rollflow.services.vllm_server import InferenceServer
from rollflow.services.vllm_supervisor import max_model_len
from rollflow.tasks.generate.evaluation import Evaluation, parquet_files
from rollflow.tasks.generate.generate_task import build_envs, evaluate_policy


@dataclass(frozen=True)
class EvalResult:
    """What ``evaluate_model`` measured and where it wrote it."""

    evaluation: Evaluation
    label: str  # what was evaluated, and k: step=N-kK or model=NAME-kK
    written: list[str]  # URIs of the Parquet files


def evaluate_model(
    cfg: RunConfig,
    *,
    step: int | None = None,
    model: str | None = None,
    samples: int | None = None,
    progress=print,
) -> EvalResult:
    """Evaluate checkpoint ``step`` of the config's run, or the model folder ``model``; raises
    ``InputError`` (no such run, checkpoint or folder) or ``StorageError``, one line each."""
    if (step is None) == (model is None):
        raise InputError("give one of --checkpoint STEP or --model PATH")
    k = samples or cfg.sampling.eval_samples
    address = RunAddress(cfg.run.storage, cfg.run.name, dict(cfg.run.storage_options))
    with tempfile.TemporaryDirectory(prefix="rollflow-eval-") as tmp:
        if step is not None:
            storage = open_run(address)  # InputError when the run is not there
            with storage_errors(address):
                model_dir = export_checkpoint(
                    storage, step, Path(tmp) / "model", show_progress=False, merged=True
                )
            label = f"step={step}-k{k}"
        else:
            model_dir = _model_folder(model)
            storage = RunStorage(cfg.run.storage, cfg.run.name, cfg.run.storage_options)
            label = f"model={_slug(model_dir.name)}-k{k}"
        progress(f"evaluating {label} on {cfg.sampling.num_eval_prompts} held-out prompts per env")
        log = storage.log_dir() / f"eval-{label}-vllm.log"
        evaluation = _serve_and_evaluate(cfg, model_dir, k, log)
    about = {
        "run": cfg.run.name,
        "step": step,
        "model": None if model is None else str(Path(model).resolve()),
        "samples": k,
    }
    with storage_errors(address):
        written = [
            storage.write_file(f"evals/{label}/{name}", data)
            for name, data in parquet_files(evaluation, about).items()
        ]
    return EvalResult(evaluation, label, written)


def _serve_and_evaluate(cfg: RunConfig, model_dir: Path, k: int, log: Path) -> Evaluation:
    """One vLLM server of ``model_dir`` (as the run serves its policy) for the evaluation."""
    import torch

    inf = cfg.inference
    args = inf.standalone_vllm_args(on_gpu=torch.cuda.is_available())
    server = InferenceServer(
        model_dir,
        max_model_len=max_model_len(model_dir),
        startup_timeout_s=inf.startup_timeout_s,
        extra_args=[*args, *cfg.vllm_args()],
        log_path=log,
    )

    async def run() -> Evaluation:
        async with InferenceClient(server.url, timeout_s=inf.request_timeout_s) as client:
            envs = build_envs(cfg, str(model_dir))
            return await evaluate_policy(cfg, str(model_dir), envs, client, k)

    log.parent.mkdir(parents=True, exist_ok=True)
    with server:  # started, healthy; stopped (its whole process group) on the way out
        return asyncio.run(run())


def _model_folder(model: str) -> Path:
    path = Path(model).expanduser()
    if not path.is_dir():
        raise InputError(f"--model {model}: no such folder; give an exported model folder")
    if not (path / "config.json").is_file():
        raise InputError(
            f"--model {model}: no config.json in it; give a Hugging Face model folder "
            "(rollflow export writes one)"
        )
    return path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "model"
