import subprocess
import sys

import pytest

from rollflow.infra.config import ConfigError, load_config

from run_support import ROOT

QUICKSTART = "configs/quickstart.toml"
# The figures below count groups of a 128-group step with one optimizer step, whatever batch
# the quickstart itself runs.
STEP_128 = ["train.train_batch_size=128", "train.mini_batch_size=128"]


def test_quickstart_config_loads():
    cfg = load_config(QUICKSTART)
    assert cfg.model.tiny is not None and cfg.envs


def test_overrides_parse_toml_values_and_strings():
    cfg = load_config(
        QUICKSTART,
        ["train.lr=2e-4", "run.name=other", "sampling.group_size=4", "train.normalize_std=true"],
    )
    assert cfg.train.lr == 2e-4 and cfg.run.name == "other"
    assert cfg.sampling.group_size == 4 and cfg.train.normalize_std is True


def test_overrides_unset_a_section_or_key(tmp_path):
    # The quickstart builds a tiny model; unsetting [model.tiny] switches it to model.path.
    for unset in ("~model.tiny", "model.tiny=none", "model.tiny=null", "model.tiny=None"):
        cfg = load_config(QUICKSTART, [unset, "model.path=/some/model"])
        assert cfg.model.tiny is None and cfg.model.path == "/some/model", unset
    # A removed key takes its default; one in a list's entry too.
    path = tmp_path / "c.toml"
    path.write_text('[model.tiny]\n[[envs]]\nname = "add"\nweight = 2.0\n')
    assert load_config(path, ["~envs.0.weight"]).envs[0].weight == 1.0
    assert load_config(QUICKSTART, ["~train.lr"]).train.lr == 1e-4
    # Removing a key that is absent is a no-op; a quoted "none" is the string.
    assert load_config(QUICKSTART, ["~model.path"]).model.tiny is not None
    assert load_config(QUICKSTART, ["run.name='none'"]).run.name == "none"


def test_unset_of_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown key 'model.tinny'; did you mean 'model.tiny'"):
        load_config(QUICKSTART, ["~model.tinny"])
    with pytest.raises(ConfigError, match="takes no value"):
        load_config(QUICKSTART, ["~model.tiny=3"])
    # Unsetting the only model source is a config error that says what to set.
    with pytest.raises(ConfigError, match="exactly one of model.path"):
        load_config(QUICKSTART, ["~model.tiny"])


def test_misspelt_key_is_named_with_suggestion():
    with pytest.raises(ConfigError) as exc:
        load_config(QUICKSTART, ["train.lrr=1e-4"])
    assert "'train.lrr'" in str(exc.value) and "did you mean 'train.lr'" in str(exc.value)


def test_misspelt_key_in_list_section(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model.tiny]\n[[envs]]\nname = "add"\nwieght = 2\n')
    with pytest.raises(
        ConfigError, match=r"unknown key 'envs.0.wieght'; did you mean 'envs.0.weight'"
    ):
        load_config(path)


@pytest.mark.parametrize(
    "B,S,K,keys",
    [
        (4, 1, 3, ["train.train_batch_size", "train.max_in_flight_groups (3)", "(8)"]),
        (4, 1, 9, ["train.max_staleness + 1) (8)"]),
        (4, 0, 5, ["train.max_in_flight_groups (5)", "(4)"]),
        (0, 0, 1, ["train.train_batch_size"]),
        (2, -1, 2, ["train.max_staleness"]),
    ],
)
def test_in_flight_range_errors_name_the_keys(B, S, K, keys):
    """The in-flight range is checked once, by the config (the producer trusts it)."""
    overrides = [f"train.train_batch_size={B}", f"train.mini_batch_size={max(B, 1)}"]
    overrides += [f"train.max_staleness={S}", f"train.max_in_flight_groups={K}"]
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, overrides)
    assert all(k in str(err.value) for k in keys), str(err.value)


def test_a_tiny_alphabet_gives_each_character_once():
    with pytest.raises(ConfigError, match="model.tiny.alphabet repeats 'a'"):
        load_config(QUICKSTART, ['model.tiny.alphabet="abca"'])


def test_cross_field_errors_say_what_to_do():
    with pytest.raises(ConfigError, match="mini_batch_size .* must be <= train.train_batch_size"):
        load_config(QUICKSTART, ["train.mini_batch_size=256"])
    with pytest.raises(ConfigError, match="must be divisible"):
        load_config(QUICKSTART, ["train.mini_batch_size=48"])
    with pytest.raises(ConfigError, match="exactly one of model.path"):
        load_config(QUICKSTART, ["model.path=/some/model"])
    # K groups in flight: at least one step's worth, at most what the staleness bound admits.
    with pytest.raises(
        ConfigError, match=r"train.max_in_flight_groups \(64\) must be between .* \(128\)"
    ):
        load_config(QUICKSTART, [*STEP_128, "train.max_in_flight_groups=64"])
    with pytest.raises(
        ConfigError, match=r"\(300\) must be between .*max_staleness \+ 1\) \(256\)"
    ):
        load_config(
            QUICKSTART, [*STEP_128, "train.max_in_flight_groups=300", "train.max_staleness=1"]
        )
    assert (
        load_config(QUICKSTART, [*STEP_128, "train.max_staleness=2"]).train.in_flight_groups()
        == 384
    )
    # The over-request's quantile is a probability short of certainty (1 would ask for every group).
    for bad in ("0", "1"):
        with pytest.raises(ConfigError, match="train.over_request_quantile: Input should be"):
            load_config(QUICKSTART, [f"train.over_request_quantile={bad}"])
    # Between syncs vLLM's weights age: sync_every N needs a staleness bound of N - 1.
    with pytest.raises(ConfigError, match=r"train.sync_every \(2\) needs train.max_staleness >= 1"):
        load_config(QUICKSTART, ["train.sync_every=2"])
    assert (
        load_config(QUICKSTART, ["train.sync_every=2", "train.max_staleness=1"]).train.sync_every
        == 2
    )


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(QUICKSTART, ["train.lr"])


def test_cli_fails_fast_on_misspelt_key():
    """Fast because nothing heavy is imported before the config is read: the check is what the
    CLI imported (a time bound on a loaded 2-core machine measured the neighbours)."""
    heavy = ("torch", "transformers", "vllm", "prefect", "pyarrow", "fsspec")
    code = (
        "import sys; from rollflow.cli import main; "
        f"rc = main(['run', {QUICKSTART!r}, 'sampling.temprature=0.5']); "
        f"print(sorted(m for m in {heavy!r} if m in sys.modules)); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    assert proc.returncode == 2
    assert "unknown key 'sampling.temprature'" in proc.stderr
    assert "did you mean 'sampling.temperature'" in proc.stderr
    assert proc.stdout.strip() == "[]", f"imported before the config error: {proc.stdout}"


def test_cli_unsets_with_tilde_and_none():
    for unset in ("~model.tiny", "model.tiny=none"):
        proc = subprocess.run(
            [sys.executable, "-m", "rollflow.cli", "run", QUICKSTART, "--dry-run", unset],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2, proc.stderr
        assert "exactly one of model.path" in proc.stderr


def test_cli_dry_run_prints_resolved_config():
    proc = subprocess.run(
        [sys.executable, "-m", "rollflow.cli", "run", QUICKSTART, "--dry-run", "train.lr=3e-5"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert '"lr": 3e-05' in proc.stdout


def test_trainer_backend_and_loss_choices():
    cfg = load_config(QUICKSTART)
    assert (cfg.trainer.backend, cfg.trainer.num_ranks, cfg.train.loss.kind) == (
        "fsdp2",
        1,
        "ppo",
    )  # the fast default
    cfg = load_config(
        QUICKSTART,
        [
            "trainer.backend=deepspeed",
            "trainer.zero_stage=3",
            "trainer.num_ranks=2",
            "train.loss.kind=gspo",
            "train.old_logprobs=trainer",
            "train.loss.tis_cap=2.0",
        ],
    )
    assert (cfg.trainer.zero_stage, cfg.train.loss.kind, cfg.train.loss.tis_cap) == (3, "gspo", 2.0)
    assert (
        load_config(QUICKSTART, ["train.loss=gspo"]).train.loss.kind == "gspo"
    )  # a string is the kind
    with pytest.raises(ConfigError, match="trainer.backend"):
        load_config(QUICKSTART, ["trainer.backend=megatron"])
    with pytest.raises(ConfigError, match="trainer.zero_stage"):
        load_config(QUICKSTART, ["trainer.backend=deepspeed", "trainer.zero_stage=4"])
    with pytest.raises(
        ConfigError, match="zero_stage applies to trainer.backend = 'deepspeed' only"
    ):
        load_config(QUICKSTART, ["trainer.zero_stage=2"])
    with pytest.raises(ConfigError, match="have no effect with train.old_logprobs = 'inference'"):
        load_config(QUICKSTART, ["train.loss.tis_cap=2.0"])
    with pytest.raises(ConfigError, match="train.loss"):
        load_config(QUICKSTART, ["train.loss=grpo"])
    with pytest.raises(ConfigError, match="train.loss.eps_low"):
        load_config(QUICKSTART, ["train.loss.eps_low=1.5"])
    # A key that moved into a section is found there.
    with pytest.raises(ConfigError, match="did you mean 'train.loss.kl_coef'"):
        load_config(QUICKSTART, ["train.kl_coef=0.1"])


def test_lora_sync_choices():
    assert load_config(QUICKSTART, ["train.lora.rank=8"]).train.lora.sync == "merged"
    cfg = load_config(QUICKSTART, ["train.lora.rank=8", "train.lora.sync=adapter"])
    assert cfg.train.lora.sync == "adapter"
    with pytest.raises(ConfigError, match="train.lora.sync"):
        load_config(QUICKSTART, ["train.lora.sync=lora"])
    with pytest.raises(ConfigError, match="vLLM serves adapters up to rank 512"):
        load_config(QUICKSTART, ["train.lora.rank=1024", "train.lora.sync=adapter"])


def test_sampling_behaviour_is_what_the_trainer_takes_log_probs_at():
    """The trainer reproduces vLLM's processed log-probs: tempered and top-p cut when sampling,
    raw (temperature 1) when greedy, as vLLM returns them then."""
    cfg = load_config(QUICKSTART, ["sampling.temperature=0.7", "sampling.top_p=0.9"])
    assert cfg.sampling.behaviour() == (0.7, 0.9)
    cfg = load_config(QUICKSTART, ["sampling.temperature=0", "sampling.top_p=0.9"])
    assert cfg.sampling.behaviour() == (1.0, 1.0)


def test_logprobs_mode_is_not_a_users_extra_arg():
    with pytest.raises(ConfigError, match="--logprobs-mode"):
        load_config(QUICKSTART, ['inference.extra_args=["--logprobs-mode=raw_logprobs"]'])
    with pytest.raises(ConfigError, match="--logprobs-mode"):
        load_config(QUICKSTART, ['inference.extra_args=["--logprobs-mode", "raw_logprobs"]'])


def test_a_fractional_staleness_counts_optimizer_steps():
    four = [*STEP_128, "train.mini_batch_size=32"]  # 128 groups per step: 4 optimizer steps
    t = load_config(QUICKSTART, [*four, "train.max_staleness=1.25"]).train
    assert (t.optim_steps_per_step(), t.whole_staleness(), t.sync_lag()) == (4, 1, 1)
    assert t.staleness_bound() == 1.25 and t.in_flight_groups() == 256
    t = load_config(QUICKSTART, [*four, "train.num_epochs=3", "train.max_staleness=0.3333"]).train
    assert (t.optim_steps_per_step(), t.sync_lag(), t.in_flight_groups()) == (12, 4, 128)
    assert t.staleness_bound() == pytest.approx(1 / 3, abs=1e-12)  # exact, not the typed 0.3333
    assert load_config(QUICKSTART, ["train.max_staleness=1"]).train.sync_lag() == 0
    with pytest.raises(ConfigError, match=r"max_staleness \(0.3\).*step's 4 .*0.25, 0.5, 0.75"):
        load_config(QUICKSTART, [*four, "train.max_staleness=0.3"])
    with pytest.raises(ConfigError, match=r"max_staleness \(0.5\).*one optimizer step per step"):
        load_config(QUICKSTART, [*STEP_128, "train.max_staleness=0.5"])
    with pytest.raises(ConfigError, match=r"sends weights mid-step.*sync_every = 1 \(it is 2\)"):
        load_config(QUICKSTART, [*four, "train.max_staleness=1.5", "train.sync_every=2"])


def test_defaults_that_depend_on_other_keys_are_the_configs():
    from rollflow.infra.config import TrainSection

    t = TrainSection(train_batch_size=8, mini_batch_size=8)
    assert t.resample_budget() == 8 and TrainSection(max_resampled_groups=0).resample_budget() == 0
    # Dynamic sampling replaces the groups the zero-advantage filter would drop: on with it.
    assert t.resamples() and not TrainSection(filter_zero_advantage=False).resamples()
    assert not TrainSection(dynamic_sampling=False).resamples()
    assert TrainSection(filter_zero_advantage=False, dynamic_sampling=True).resamples()
    assert t.overlong_limit(max_tokens=32) == 32
    assert TrainSection(overlong_max_tokens=10).overlong_limit(max_tokens=32) == 10
