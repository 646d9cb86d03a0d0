"""An adapter sync's files on the vLLM server (``infra/weights/adapter.py``), and the command line
of a server that serves the policy as an adapter."""

import json

import torch
from safetensors.torch import load_file

from rollflow.infra.weights import adapter
from rollflow.services.vllm_server import InferenceServer


def test_each_version_is_a_new_folder_and_the_old_ones_go(tmp_path):
    initial = tmp_path / "v0"
    initial.mkdir()
    (initial / adapter.CONFIG).write_text(json.dumps({"r": 4}))
    root = adapter.prepare_root(tmp_path / "root", initial)
    (root / "stale").mkdir()
    root = adapter.prepare_root(root, initial)  # a restarted server starts empty
    assert sorted(p.name for p in root.iterdir()) == [adapter.CONFIG]
    a = [("base_model.model.x.lora_A.weight", torch.ones(2, 3))]
    first = adapter.write_version(root, 1, 0, a)
    other_worker = adapter.write_version(root, 1, 1, a)
    second = adapter.write_version(root, 2, 0, [(a[0][0], torch.full((2, 3), 2.0))])
    assert sorted(p.name for p in root.iterdir()) == [adapter.CONFIG, "v1-w1", "v2-w0"]
    assert not first.exists() and other_worker.exists()
    assert json.loads((second / adapter.CONFIG).read_text()) == {"r": 4}
    assert torch.equal(load_file(second / adapter.WEIGHTS)[a[0][0]], torch.full((2, 3), 2.0))


def test_a_server_serving_an_adapter_names_the_base_apart(tiny_model_dir, tmp_path):
    (tmp_path / adapter.CONFIG).write_text(json.dumps({"r": 12}))
    server = InferenceServer(tiny_model_dir, lora_adapter=tmp_path)
    cmd = server.command()
    assert cmd[cmd.index("--served-model-name") + 1] == "policy-base"
    assert cmd[cmd.index("--lora-modules") + 1] == f"policy={tmp_path}"
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"  # vLLM's least allowed rank >= 12
    assert "--enable-lora" not in InferenceServer(tiny_model_dir).command()
