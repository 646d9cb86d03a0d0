"""Overrides address an item of a list section by its index: ``envs.0.args.path=...``."""

import pytest

from rollflow.infra.config import ConfigError, load_config
from rollflow.infra.config.loading import apply_override

QUICKSTART = "configs/quickstart.toml"


def test_an_override_sets_a_key_of_a_list_item():
    cfg = load_config(QUICKSTART, ["envs.0.args.max_len=6", "envs.0.weight=2"])
    assert cfg.envs[0].args["max_len"] == 6 and cfg.envs[0].weight == 2
    assert cfg.envs[0].args["letters"] == "abcdefgh"  # the item's other keys are kept


def test_an_out_of_range_index_names_the_items_there_are():
    with pytest.raises(ConfigError, match=r"index 3 is out of range: 'envs' has 1 item \(envs.0"):
        load_config(QUICKSTART, ["envs.3.args.path=data.jsonl"])


def test_a_name_where_an_index_goes_is_refused():
    with pytest.raises(ConfigError, match=r"'envs' is a list; address an item by its index"):
        load_config(QUICKSTART, ["envs.first.name=math"])


def test_indexing_a_list_the_config_does_not_set_says_so():
    data: dict = {}
    with pytest.raises(ConfigError, match="sets no 'envs' items"):
        apply_override(data, "envs.0.args.path=x.jsonl")
    assert data == {}


def test_a_whole_item_value_and_nested_lists():
    data = {"envs": [{"name": "add", "rewards": [{"fn": "a:b"}]}]}
    apply_override(data, "envs.0.rewards.0.weight=0.5")
    assert data["envs"][0]["rewards"][0] == {"fn": "a:b", "weight": 0.5}
    apply_override(data, 'envs.0.rewards.0={ fn = "c:d" }')
    assert data["envs"][0]["rewards"][0] == {"fn": "c:d"}
