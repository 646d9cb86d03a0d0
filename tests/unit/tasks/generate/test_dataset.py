import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollflow.tasks.generate.dataset import InputError, load_prompts

GOOD = [{"q": "1+1=", "a": "2"}, {"q": "2+2=", "a": 4}, {"q": "half?", "a": 0.5}]


def write(tmp_path, fmt, records, name="d"):
    """``records`` in one format: a .jsonl file, a .parquet file, or a save_to_disk folder."""
    if fmt == "jsonl":
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path
    table = pa.Table.from_pylist(records)
    if fmt == "parquet":
        path = tmp_path / f"{name}.parquet"
        pq.write_table(table, path)
        return path
    import datasets

    path = tmp_path / name
    datasets.Dataset(table).save_to_disk(str(path))
    return path


def texts(loaded):
    return [(r.prompt, r.answer) for r in loaded.rows]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_each_format_loads_prompts_and_answers(tmp_path, fmt):
    records = [{"q": "1+1=", "a": "2"}, {"q": "2+2=", "a": "4"}]
    loaded = load_prompts(write(tmp_path, fmt, records), prompt_column="q", answer_column="a")
    assert texts(loaded) == [("1+1=", "2"), ("2+2=", "4")]
    assert loaded.num_skipped == 0 and [r.index for r in loaded.rows] == [0, 1]


def test_jsonl_numbers_are_answers_and_blank_lines_are_not_rows(tmp_path):
    path = write(tmp_path, "jsonl", GOOD)
    path.write_text(path.read_text() + "\n   \n")
    loaded = load_prompts(path, prompt_column="q", answer_column="a")
    assert texts(loaded) == [("1+1=", "2"), ("2+2=", "4"), ("half?", "0.5")]
    assert loaded.num_skipped == 0


def test_malformed_jsonl_rows_are_skipped_counted_and_reported(tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps({"q": "ok1", "a": "1"}),
        "{not json",  # line 2: bad JSON
        json.dumps({"a": "3"}),  # line 3: missing prompt
        json.dumps({"q": 7, "a": "4"}),  # line 4: prompt of the wrong type
        json.dumps({"q": "   ", "a": "5"}),  # line 5: empty prompt
        json.dumps({"q": "x", "a": [1]}),  # line 6: answer of the wrong type
        json.dumps(["q", "a"]),  # line 7: not an object
        json.dumps({"q": "ok2", "a": True}),  # line 8: a bool is not an answer
        json.dumps({"q": "ok3"}),  # line 9: missing answer
        json.dumps({"q": "ok4", "a": "4"}),
    ]
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"q": "\xff"}\n')  # line 11: not UTF-8
    with caplog.at_level(logging.WARNING, logger="rollflow.tasks.generate.dataset"):
        loaded = load_prompts(path, prompt_column="q", answer_column="a")
    assert texts(loaded) == [("ok1", "1"), ("ok4", "4")]
    assert loaded.num_skipped == 9
    assert loaded.first_skipped == (
        "line 2: bad JSON (Expecting property name enclosed in double quotes at column 2)",
        "line 3: missing 'q'",
        "line 4: 'q' is int, not a string or a list of messages",
        "line 5: empty 'q'",
        "line 6: 'a' is list, not a string or number",
    )
    [record] = [r for r in caplog.records if "skipped" in r.getMessage()]
    message = record.getMessage()
    assert str(path) in message and "skipped 9 malformed of 11 rows" in message
    assert "line 2: bad JSON" in message and message.endswith("; ...)")


@pytest.mark.parametrize("fmt", ["parquet", "hf"])
def test_malformed_table_rows_are_skipped_counted_and_reported(tmp_path, fmt, caplog):
    records = [
        {"q": "ok1", "a": "1"},
        {"q": None, "a": "2"},
        {"q": "", "a": "3"},
        {"q": "ok2", "a": None},
        {"q": "ok3", "a": "3"},
    ]
    with caplog.at_level(logging.WARNING, logger="rollflow.tasks.generate.dataset"):
        loaded = load_prompts(write(tmp_path, fmt, records), prompt_column="q", answer_column="a")
    assert texts(loaded) == [("ok1", "1"), ("ok3", "3")]
    assert [r.index for r in loaded.rows] == [0, 4]
    assert loaded.first_skipped == ("row 1: missing 'q'", "row 2: empty 'q'", "row 3: missing 'a'")
    assert "skipped 3 malformed of 5 rows" in caplog.text


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_a_source_with_no_usable_rows_is_an_error_naming_it(tmp_path, fmt):
    path = write(tmp_path, fmt, [{"q": 1, "a": "x"}, {"q": 2, "a": "y"}])
    with pytest.raises(InputError, match=rf"dataset {path}.*no usable rows.*'q' is int"):
        load_prompts(path, prompt_column="q", answer_column="a")


@pytest.mark.parametrize("fmt", ["parquet", "hf"])
def test_a_column_missing_from_a_table_names_the_columns_there(tmp_path, fmt):
    path = write(tmp_path, fmt, [{"question": "a", "a": "1"}])
    with pytest.raises(InputError, match=r"column 'q' is missing \(columns: question, a\)"):
        load_prompts(path, prompt_column="q", answer_column="a")


def test_empty_file_missing_file_and_unknown_suffix(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InputError, match="no usable rows out of 0 .it is empty"):
        load_prompts(empty)
    with pytest.raises(InputError, match="no such file or folder, and not a hub dataset id"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "d.txt").write_text("q,a\n")
    with pytest.raises(InputError, match=r"suffix '.txt'.*set format"):
        load_prompts(tmp_path / "d.txt")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        load_prompts(tmp_path / "bad.parquet")


def test_format_parameter_overrides_the_suffix(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    assert texts(load_prompts(path, format="jsonl")) == [("p", "a")]


def test_folder_of_parquet_files(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    write(folder, "parquet", [{"prompt": "a", "answer": "1"}], name="part-0")
    write(folder, "parquet", [{"prompt": "b", "answer": "2"}], name="part-1")
    assert sorted(texts(load_prompts(folder))) == [("a", "1"), ("b", "2")]


def test_hf_dataset_dict_needs_a_named_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "t", "answer": "1"}]),
            "test": datasets.Dataset.from_list([{"prompt": "e", "answer": "2"}]),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert texts(load_prompts(tmp_path / "dd", split="test")) == [("e", "2")]
    with pytest.raises(InputError, match=r"splits are \['test', 'train'\]; the env names no split"):
        load_prompts(tmp_path / "dd")
    with pytest.raises(InputError, match="has no split 'dev'"):
        load_prompts(tmp_path / "dd", split="dev")


def test_a_load_is_parsed_and_reported_once_until_the_file_changes(tmp_path, caplog):
    path = write(tmp_path, "jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": ""}], name="once")
    with caplog.at_level(logging.WARNING, logger="rollflow.tasks.generate.dataset"):
        first, second = load_prompts(path), load_prompts(path)
    assert first is second and caplog.text.count("skipped 1 malformed") == 1
    path.write_text(json.dumps({"prompt": "b", "answer": "2"}) + "\n")
    assert texts(load_prompts(path)) == [("b", "2")]
