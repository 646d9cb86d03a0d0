"""model.revision and model.trust_remote_code reach every side that loads the policy: the
vLLM server's command line, the trainer's start arguments and the run's tokenizer. (The
trainer's own loaders: tests/unit/trainer/test_real_model_training.py.)"""

from __future__ import annotations

import pytest

from rollflow.infra.config import RunConfig
from rollflow.services.trainer_life import trainer_args
from rollflow.services.vllm_supervisor import InferenceSupervisor
from rollflow.tasks.generate import generate_task


def _cfg(model_dir, **model) -> RunConfig:
    return RunConfig.model_validate(
        {"model": {"path": str(model_dir), **model}, "envs": [{"name": "math"}]}
    )


@pytest.mark.parametrize(
    ("model", "flags"),
    [
        ({}, []),
        (
            {"revision": "v2", "trust_remote_code": True},
            ["--revision", "v2", "--trust-remote-code"],
        ),
    ],
)
def test_vllm_serves_the_revision_with_remote_code_as_asked(tiny_model_dir, tmp_path, model, flags):
    cfg = _cfg(tiny_model_dir, **model)
    cmd = InferenceSupervisor(cfg, tiny_model_dir, tmp_path).server.command()
    assert [a for a in cmd if a in ("--revision", "v2", "--trust-remote-code")] == flags


def test_the_trainer_and_the_tokenizer_get_them(tiny_model_dir, monkeypatch):
    cfg = _cfg(tiny_model_dir, revision="v2", trust_remote_code=True)
    args = trainer_args(cfg, str(tiny_model_dir), None)
    assert (args.model_revision, args.trust_remote_code) == ("v2", True)
    seen = {}

    class Tokenizers:
        @staticmethod
        def from_pretrained(path, **kwargs):
            seen.update(kwargs)
            raise RuntimeError("stop here")

    monkeypatch.setattr(generate_task, "AutoTokenizer", Tokenizers)
    generate_task._tokenizer.cache_clear()
    with pytest.raises(RuntimeError, match="stop here"):
        generate_task.make_rollout_context(cfg, str(tiny_model_dir), None, None, temperature=1.0)
    assert seen == {"revision": "v2", "trust_remote_code": True}
