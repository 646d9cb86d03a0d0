"""Sources through Hugging Face ``datasets``: a hub id from the local cache offline, .json, .csv,
a dataset-repository folder; and prompts given as chat messages (TRL's conversational format)."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollflow.tasks.generate.dataset import InputError, load_prompts

ROWS = [{"question": f"q{i}", "solution": str(i)} for i in range(4)]


def hub_cache(hf_home, repo_id, rows_by_split):
    """The datasets cache ``load_dataset(repo_id)`` leaves behind, made from local files: the
    packaged json builder writes ``<namespace>___<name>/default/0.0.0/<hash>/`` under
    ``$HF_HOME/datasets``, which offline ``load_dataset(repo_id)`` reads back."""
    from datasets.packaged_modules.json.json import Json

    cache = hf_home / "datasets"
    files = {}
    for split, rows in rows_by_split.items():
        files[split] = hf_home / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    namespace, name = repo_id.split("/")
    builder = Json(
        cache_dir=str(cache),
        dataset_name=name,
        config_id="default",
        hash="0123abcd",
        data_files={k: str(v) for k, v in files.items()},
    )
    builder.download_and_prepare()
    (cache / name).rename(cache / f"{namespace}___{name}")


def load_offline(hf_home, code, offline="HF_HUB_OFFLINE"):
    """``code`` in a fresh process whose environment is offline (``offline=1``) with ``hf_home``
    as HF_HOME (the datasets library reads both when it is imported)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= {"HF_HOME": str(hf_home), offline: "1"}
    prelude = "import json; from rollflow.tasks.generate.dataset import load_prompts, InputError\n"
    proc = subprocess.run(
        [sys.executable, "-c", prelude + code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_a_hub_id_is_read_from_the_local_hub_cache_offline(tmp_path):
    hub_cache(tmp_path, "someone/tiny-math", {"train": ROWS[:3], "test": ROWS[3:]})
    out = load_offline(
        tmp_path,
        "kw = dict(prompt_column='question', answer_column='solution')\n"
        "train = load_prompts('someone/tiny-math', **kw)\n"
        "test = load_prompts('someone/tiny-math', split='test', **kw)\n"
        "try:\n"
        "    load_prompts('someone/not-cached', **kw); missing = ''\n"
        "except InputError as exc:\n"
        "    missing = str(exc)\n"
        "print(json.dumps([[(r.prompt, r.answer) for r in d.rows] for d in (train, test)]"
        " + [train.source, missing]))",
    )
    train, test, source, missing = json.loads(out)
    assert train == [["q0", "0"], ["q1", "1"], ["q2", "2"]] and test == [["q3", "3"]]
    assert source == "someone/tiny-math (split train)"
    assert missing.startswith("dataset someone/not-cached: datasets cannot load it")
    assert "offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" in missing


def test_a_hub_dataset_without_the_split_names_its_splits(tmp_path):
    hub_cache(tmp_path, "someone/only-test", {"test": ROWS})
    out = load_offline(
        tmp_path,
        "try:\n"
        "    load_prompts('someone/only-test', prompt_column='question', answer_column=None)\n"
        "except InputError as exc:\n"
        "    print(exc)",
        offline="HF_DATASETS_OFFLINE",  # datasets' own switch works as well
    )
    assert "its splits are ['test']; there is no split 'train'" in out


def test_json_csv_and_a_dataset_repository_folder(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps(ROWS))  # a JSON array, not JSON lines
    (tmp_path / "d.csv").write_text("question,solution\nq0,0\nq1,1\n")
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    for split, rows in {"train": ROWS[:2], "test": ROWS[2:]}.items():
        pq.write_table(pa.Table.from_pylist(rows), repo / "data" / f"{split}-00000.parquet")
    (repo / "README.md").write_text("# a dataset\n")
    kw = {"prompt_column": "question", "answer_column": "solution"}
    pairs = lambda d: [(r.prompt, r.answer) for r in d.rows]  # noqa: E731
    assert pairs(load_prompts(tmp_path / "d.json", **kw))[:2] == [("q0", "0"), ("q1", "1")]
    assert pairs(load_prompts(tmp_path / "d.csv", **kw)) == [("q0", "0"), ("q1", "1")]
    assert pairs(load_prompts(repo, **kw)) == [("q0", "0"), ("q1", "1")]
    assert pairs(load_prompts(repo, split="test", **kw)) == [("q2", "2"), ("q3", "3")]
    with pytest.raises(InputError, match="has none: remove subset"):
        load_prompts(tmp_path / "d.csv", subset="main", **kw)


CHAT = [
    {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"},
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "3+3?"},
        ],
        "answer": "6",
    },
]
BAD_CHAT = [
    {"prompt": [], "answer": "1"},
    {"prompt": [{"role": "user"}], "answer": "1"},
    {"prompt": [{"role": "wizard", "content": "x"}], "answer": "1"},
    {"prompt": ["hi"], "answer": "1"},
    {"prompt": [{"role": "user", "content": " "}], "answer": "1"},
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_messages_dataset_gives_chat_rows_and_counts_malformed_messages(tmp_path, fmt):
    path = tmp_path / f"chat.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in CHAT + BAD_CHAT))
    else:  # a table holds only the well-typed rows (one struct type per column)
        pq.write_table(pa.Table.from_pylist(CHAT), path)
    loaded = load_prompts(path)
    assert [r.messages for r in loaded.rows] == [tuple(r["prompt"]) for r in CHAT]
    assert [r.prompt for r in loaded.rows] == ["2+2?", "3+3?"]  # the last user turn's text
    assert loaded.rows[0].key != loaded.rows[0].prompt  # the whole conversation identifies it
    if fmt == "jsonl":
        assert loaded.num_skipped == len(BAD_CHAT)
        assert loaded.first_skipped == (
            "line 3: empty 'prompt' (a list of no messages)",
            "line 4: 'prompt' message 0 has content of type NoneType, not text",
            "line 5: 'prompt' message 0 has role 'wizard', not one of system, user, assistant, "
            "tool, developer",
            "line 6: 'prompt' message 0 is str, not a {role, content} object",
            "line 7: empty 'prompt' (every message's content is empty)",
        )
