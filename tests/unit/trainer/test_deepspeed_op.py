"""A DeepSpeed op library that cannot be loaded leaves DeepSpeed to build its own."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("deepspeed")

from deepspeed.ops.op_builder.builder import OpBuilder  # noqa: E402

from rollflow.trainer.deepspeed_op import OP, built_op_path, load_built_op  # noqa: E402


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delitem(OpBuilder._loaded_ops, OP, raising=False)
    built_op_path().parent.mkdir(parents=True)
    return built_op_path()


def test_a_library_cut_short_is_left_to_deepspeed(extensions, caplog):
    extensions.write_bytes(b"\x7fELF cut short")
    with caplog.at_level(logging.WARNING):
        assert load_built_op() is None
    assert OP not in OpBuilder._loaded_ops
    assert f"{extensions} did not load" in caplog.text and "DeepSpeed builds it" in caplog.text


def test_a_build_under_way_is_waited_for_by_deepspeed(extensions):
    """torch's lock file in the op's folder: the library may be half written."""
    extensions.write_bytes(b"\x7fELF half written")
    (extensions.parent / "lock").touch()
    assert load_built_op() is None and OP not in OpBuilder._loaded_ops


def test_no_library_yet_is_built_by_deepspeed(extensions):
    assert load_built_op() is None and OP not in OpBuilder._loaded_ops
