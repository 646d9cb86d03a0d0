"""Test-wide settings: a project-local Prefect home, no analytics, quiet logs, small thread pools."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PREFECT_HOME", str(ROOT / ".prefect" / "tests"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """An untrained tiny char Llama saved as a HF directory."""
    from rollflow.infra.config import TinyModelSpec
    from rollflow.infra.models.tiny import build_char_tokenizer, build_tiny_llama, save_hf_dir

    tok = build_char_tokenizer()
    model = build_tiny_llama(TinyModelSpec(hidden_size=64, num_heads=2, intermediate_size=64), vocab_size=len(tok))
    return save_hf_dir(model, tok, tmp_path_factory.mktemp("tiny") / "model")
