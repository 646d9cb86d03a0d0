"""Same batch, same gradient: rollflow's trainer against TRL's ``GRPOTrainer`` (trl 1.16.0).

Both sides get the same weights and the same generation batch (prompts, completions, rewards,
sampler log-probs) and the same split of it into optimizer steps; each computes its advantages,
old log-probs, loss and gradients with its own code:

- TRL: a ``GRPOTrainer`` on the tiny model whose ``rollout_func`` returns our completions, so that
  ``_prepare_inputs`` (the generation step: rewards, advantages, old log-probs, the masks of
  truncated completions, the token count, the shuffle and the split) and ``compute_loss`` are
  TRL's own; one backward per mini-batch.
- rollflow: the advantage stage's ``build_batch`` on the rollouts, the batch in run storage, and
  the trainer service's ``StepOps`` (``forward`` for the old log-probs, then one
  ``forward_backward`` per mini-batch: packing, micro-batches, the packed policy's forward and
  ``compute_loss``) on a one-rank FSDP2 ``Trainer``, with the denominator the train task sends.

Old log-probs are taken at the generation weights; the loss and gradients at weights moved
from them (as after an optimizer step), so that ratios leave 1 and the clip acts. In the
TRL-compatible setting (docs/concepts/trl-compatibility.md) every mini-batch's loss and every
parameter's gradient agree to 1e-5; each rollflow default that differs from TRL is pinned with
its measured effect.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import random
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

# Looked up, not imported, at collection (every pytest-xdist worker collects every file): importing
# TRL changes the process's environment (import_trl_without_vllm).
if importlib.util.find_spec("trl") is None:
    pytest.skip(
        "TRL is not installed: pip install trl==1.16.0 (the dev extra) to compare",
        allow_module_level=True,
    )

from rollflow.infra.config import LossConfig, SamplingSection, TrainSection  # noqa: E402
from rollflow.infra.models.tiny import EOS_ID, PAD_ID, build_char_tokenizer, save_hf_dir  # noqa: E402
from rollflow.infra.schema import rows_to_table  # noqa: E402
from rollflow.infra.storage import RunStorage  # noqa: E402
from rollflow.tasks.advantage.advantages import (  # noqa: E402
    Overlong,
    advantage_fn,
    build_batch,
    num_loss_tokens,
)
from rollflow.tasks.train.train_task import step_denominator  # noqa: E402
from rollflow.trainer.batches import BatchReader  # noqa: E402
from rollflow.trainer.compute import StepOps  # noqa: E402
from rollflow.trainer.control import ControlGroup  # noqa: E402
from rollflow.trainer.protocol import BatchRef, ForwardBackward  # noqa: E402
from rollflow.trainer.rank_trainer import Trainer, TrainerSpec  # noqa: E402

from trainer_support import load, max_abs_diff, one_process_group  # noqa: E402

G, K, T = 4, 2, 8  # samples per group, optimizer steps per generation batch, max completion tokens
NUM_GROUPS = 4
TEMPERATURE = 0.7
TOL = 1e-5
CPU = torch.device("cpu")

# The TRL-compatible setting, both sides (docs/concepts/trl-compatibility.md).
TRL_ARGS = dict(
    loss_type="dapo",
    scale_rewards="none",
    beta=0.0,
    epsilon=0.2,
    mask_truncated_completions=False,
    temperature=TEMPERATURE,
    top_p=1.0,
)
COMPATIBLE = dict(
    advantage="grpo",
    normalize_std=False,
    filter_zero_advantage=False,
    truncated="keep",
    old_logprobs="trainer",
    token_mean="batch",
    loss=LossConfig(kind="ppo", eps_low=0.2, eps_high=0.2),
)


@functools.cache
def import_trl_without_vllm():
    """GRPOConfig and GRPOTrainer, or the test skipped with the import's error. On first use, not
    at collection (every pytest-xdist worker collects every file). TRL imports vLLM at import time
    when it is installed (~10 s, for its vLLM client only): it is told vLLM is absent meanwhile.

    TRL's import also sets ``VLLM_LOGGING_LEVEL=ERROR`` in the process's environment: every vLLM
    server a later test of the same worker started logged errors only (a check of vLLM's log
    then failed). The environment is put back as it was."""
    environment = dict(os.environ)
    try:
        import_utils = importlib.import_module("trl.import_utils")
        real = import_utils.is_vllm_available
        import_utils.is_vllm_available = lambda min_version=None: False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # The modules themselves: trl's lazy top level turns an ImportError into a
                # RuntimeError.
                from trl.trainer.grpo_config import GRPOConfig
                from trl.trainer.grpo_trainer import GRPOTrainer
        except ImportError as err:
            pytest.skip(f"TRL's GRPOTrainer does not import: {err}")
        finally:
            import_utils.is_vllm_available = real
    finally:
        for key in set(os.environ) - set(environment):
            del os.environ[key]
        os.environ.update(environment)
    return GRPOConfig, GRPOTrainer


def test_importing_trl_leaves_the_workers_environment_as_it_was():
    """The suite's workers start vLLM servers after this file's tests; they inherit the worker's
    environment (see import_trl_without_vllm)."""
    before = dict(os.environ)
    import_trl_without_vllm()
    assert dict(os.environ) == before


# ----------------------------------------------------------------------------- the batch


@dataclass
class Sample:
    key: tuple[int, int]  # (group, sample)
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float
    sampler_logprobs: list[float]

    @property
    def truncated(self) -> bool:
        """Cut at T tokens before its <eos> (TRL's test: the last token is not <eos>)."""
        return self.completion_ids[-1] != EOS_ID


def make_samples(seed: int = 0) -> list[Sample]:
    """4 groups of 4: prompts of 3-9 characters, completions of 1-8 tokens (distinct, so that a
    completion names its sample), three cut at T tokens, group 2 with equal rewards. The sampler
    log-probs are set by the ``samples`` fixture."""
    rng = random.Random(seed)
    rewards = [[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.4, 0.7], [0.5] * G, [0.0, 1.0, 1.0, 0.3]]
    truncated = {(0, 1), (1, 2), (3, 0)}
    samples, seen = [], set()
    for g in range(NUM_GROUPS):
        prompt = [1] + [rng.randint(4, 40) for _ in range(rng.randint(3, 9))]
        for s in range(G):
            while True:
                n = T if (g, s) in truncated else rng.randint(1, T)
                body = [rng.randint(4, 40) for _ in range(n if (g, s) in truncated else n - 1)]
                ids = body if (g, s) in truncated else body + [EOS_ID]
                if tuple(ids) not in seen:
                    break
            seen.add(tuple(ids))
            samples.append(Sample((g, s), prompt, ids, rewards[g][s], [0.0] * len(ids)))
    return samples


def rollout_rows(samples: list[Sample]) -> list[dict]:
    """The samples as the generate stage writes them (the rollouts schema; the rest null)."""
    return [
        dict(
            env="sort",
            group_index=s.key[0],
            sample_index=s.key[1],
            prompt_ids=s.prompt_ids,
            completion_ids=s.completion_ids,
            completion_logprobs=s.sampler_logprobs,
            reward=s.reward,
            finish_reason="length" if s.truncated else "stop",
            truncated=s.truncated,
        )
        for s in samples
    ]


def table_keys(table) -> list[tuple[int, int]]:
    """The (group, sample) key of each row of a batch or log-probs table."""
    groups, samples = table["group_index"].to_pylist(), table["sample_index"].to_pylist()
    return list(zip(groups, samples, strict=True))


def moved(model: torch.nn.Module, seed: int = 1, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The weights after a pretend optimizer step: each tensor plus seeded noise at ``scale`` of
    its own std (the clip then acts on 3-36% of a step's tokens)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in sorted(model.state_dict().items()):
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        out[name] = p + scale * float(p.std()) * noise
    return out


# ---------------------------------------------------------------------------- TRL's side


@dataclass
class Step:
    """One optimizer step's loss and gradients (HF parameter names) and its samples."""

    loss: float
    grads: dict[str, torch.Tensor]
    keys: list[tuple[int, int]]
    clip_fraction: float | None = None  # rollflow's metric (TRL's side: None)

    def scaled(self, factor: float) -> Step:
        grads = {n: g * factor for n, g in self.grads.items()}
        return Step(self.loss * factor, grads, self.keys, self.clip_fraction)


def grpo_trainer(model_dir, samples: list[Sample], tmp_path, **trl_args):
    """A ``GRPOTrainer`` on the tiny model whose generation returns ``samples`` (its
    ``rollout_func``) and whose reward function their rewards; and its generation batch (one
    dataset row per sample, each prompt ``G`` times in a row, as TRL's sampler repeats them)."""
    from datasets import Dataset
    from huggingface_hub import constants as hub_constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    GRPOConfig, GRPOTrainer = import_trl_without_vllm()
    rows = [{"prompt": f"p{s.key[0]}", "reward": s.reward} for s in samples]

    def rollout_func(prompts: list[str], trainer) -> dict:
        assert prompts == [r["prompt"] for r in rows]
        return {
            "prompt_ids": [s.prompt_ids for s in samples],
            "completion_ids": [s.completion_ids for s in samples],
            "logprobs": [s.sampler_logprobs for s in samples],
        }

    def reward(prompts, completions, reward, **_):
        return reward

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(samples) // K,
        gradient_accumulation_steps=1,
        steps_per_generation=K,  # K optimizer steps per generation batch
        num_generations=G,
        max_completion_length=T,
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        disable_dropout=True,
        **trl_args,
    )
    # No usage ping to the Hub from the trainer's constructor; rollout_func warns (experimental).
    with (
        mock.patch.object(hub_constants, "HF_HUB_DISABLE_TELEMETRY", True),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_list(rows[::G]),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            rollout_func=rollout_func,
        )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets
    return trainer, rows


def trl_steps(model_dir, moved_state, samples: list[Sample], tmp_path, **trl_args) -> list[Step]:
    """TRL's loss and gradients for each of the K optimizer steps of one generation batch."""
    trainer, rows = grpo_trainer(model_dir, samples, tmp_path, **trl_args)
    torch.manual_seed(0)  # TRL's shuffle of the generation batch
    mini_batches = []
    for k in range(K):
        trainer._step = k  # generates at k = 0, then hands out the buffered mini-batches
        mini_batches.append(trainer._prepare_inputs(rows))
    model = trainer.model
    model.load_state_dict(moved_state)
    key_of = {(tuple(s.prompt_ids), tuple(s.completion_ids)): s.key for s in samples}
    steps = []
    for inputs in mini_batches:
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        ids = zip(inputs["prompt_ids"].tolist(), inputs["completion_ids"].tolist(), strict=True)
        keys = [key_of[(_unpadded(p), _unpadded(c))] for p, c in ids]
        steps.append(Step(float(loss.detach()), grads, keys))
    return steps


def _unpadded(ids: list[int]) -> tuple[int, ...]:
    return tuple(x for x in ids if x != PAD_ID)


# ------------------------------------------------------------------------ rollflow's side


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    yield from one_process_group(tmp_path_factory)


@pytest.fixture(scope="module")
def moved_model(tiny_model_dir, tmp_path_factory) -> SimpleNamespace:
    """The moved weights: ``state`` (for TRL's model) and ``path``, an HF folder (rollflow's)."""
    model = load(tiny_model_dir)
    state = moved(model)
    model.load_state_dict(state)
    path = save_hf_dir(model, build_char_tokenizer(), tmp_path_factory.mktemp("moved") / "m")
    return SimpleNamespace(path=path, state=state)


class RollflowSide:
    """The trainer service's ops on one rank: ``generation`` at the weights that sampled (old
    log-probs), ``policy`` at the moved weights (loss and gradients), one run storage."""

    def __init__(self, model_dir, moved_path, root):
        self.storage = RunStorage(str(root), "t")
        # Small micro-batches and rows: the batch is packed as a long one would be.
        self.reader = BatchReader(self.storage, 0, 1, micro_batch_tokens=48, row_tokens=24)
        with mock.patch.dict("os.environ"):  # ControlGroup names a gloo interface in the env
            control = ControlGroup(timeout_s=60)
        sampling = SamplingSection(temperature=TEMPERATURE)
        self.generation = StepOps(
            Trainer(TrainerSpec(str(model_dir), sampling=sampling), CPU), control, self.reader
        )
        self.policy = StepOps(
            Trainer(TrainerSpec(str(moved_path), sampling=sampling), CPU), control, self.reader
        )
        self.next_step = 1

    def steps(self, samples: list[Sample], split: list[list], train: TrainSection) -> list[Step]:
        """rollflow's loss and gradients for each mini-batch of ``split`` (the keys the batch
        kept), from the rollouts through the advantage stage and the trainer's ops."""
        step, self.next_step = self.next_step, self.next_step + 1
        batch, _ = build_batch(
            rows_to_table(rollout_rows(samples)),
            advantage_fn(train),
            filter_zero_advantage=train.filter_zero_advantage,
            overlong=Overlong(train.truncated, T),
        )
        self.storage.write_step_table("batches", step, batch)
        groups = sorted(set(batch.column("group_index").to_pylist()))
        kept = set(table_keys(batch))
        parts = [[k for k in keys if k in kept] for keys in split]
        parts = [p for p in parts if p]
        if train.old_logprobs == "trainer":
            self.generation.forward(BatchRef(step=step, group_indices=groups))
        denominator = step_denominator(num_loss_tokens(batch), len(parts), train)
        trainer = self.policy.trainer
        out = []
        for keys in parts:
            fb = self.policy.forward_backward(
                ForwardBackward(
                    step=step,
                    group_indices=sorted({g for g, _ in keys}),
                    samples=keys,
                    loss=train.loss,
                    old_logprobs=train.old_logprobs,
                    num_loss_tokens=denominator,
                )
            )
            out.append(Step(fb["loss"], trainer.full_gradients(), keys, fb["clip_fraction"]))
            trainer.backend.optimizer.zero_grad(set_to_none=True)  # a step each, not a sum
        return out


@pytest.fixture(scope="module")
def rollflow(tiny_model_dir, moved_model, tmp_path_factory):
    return RollflowSide(tiny_model_dir, moved_model.path, tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="module")
def samples(rollflow):
    """The batch, with sampler log-probs near the generation weights' own (as vLLM's are)."""
    batch = make_samples()
    step, rollflow.next_step = rollflow.next_step, rollflow.next_step + 1
    rows = [{**r, "advantage": 0.0} for r in rollout_rows(batch)]
    rollflow.storage.write_step_table("batches", step, rows_to_table(rows))
    rollflow.generation.forward(BatchRef(step=step))
    table = rollflow.storage.read_step_table("logprobs", step)
    own = dict(zip(table_keys(table), table["logprobs"].to_pylist(), strict=True))
    rng = random.Random(1)
    for s in batch:
        s.sampler_logprobs = [lp + rng.gauss(0.0, 0.05) for lp in own[s.key]]
    return batch


def compare(trl: list[Step], ours: list[Step]) -> tuple[float, float, float]:
    """Over the optimizer steps, the largest: loss difference, gradient difference (any element),
    and relative difference of the whole gradient, |g_ours - g_trl| / |g_trl| (L2 over every
    parameter). rollflow's steps hold the samples of TRL's that its batch kept."""
    assert len(trl) == len(ours)
    assert all(set(b.keys) <= set(a.keys) for a, b in zip(trl, ours, strict=True))
    loss = max(abs(a.loss - b.loss) for a, b in zip(trl, ours, strict=True))
    grad = max(max_abs_diff(a.grads, b.grads) for a, b in zip(trl, ours, strict=True))
    relative = max(_relative_difference(b, a) for a, b in zip(trl, ours, strict=True))
    return loss, grad, relative


def _relative_difference(ours: Step, trl: Step) -> float:
    names = sorted(trl.grads)
    a = torch.cat([trl.grads[n].flatten() for n in names])
    b = torch.cat([ours.grads[n].flatten() for n in names])
    return float((b - a).norm() / a.norm())


@pytest.fixture
def both(tiny_model_dir, moved_model, rollflow, samples, tmp_path):
    """``both(trl_args, ours)``: TRL's optimizer steps and rollflow's on TRL's split, each side
    in the TRL-compatible setting with these changes."""

    def run(trl_args: dict, ours: dict) -> tuple[list[Step], list[Step]]:
        args = {**TRL_ARGS, **trl_args}
        trl = trl_steps(tiny_model_dir, moved_model.state, samples, tmp_path, **args)
        train = TrainSection(**{**COMPATIBLE, **ours})
        return trl, rollflow.steps(samples, [s.keys for s in trl], train)

    return run


def loss_tokens(samples: list[Sample], keys) -> int:
    by_key = {s.key: s for s in samples}
    return sum(len(by_key[k].completion_ids) for k in keys)


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("trl_args", "ours"),
    [
        ({}, {}),
        # Advantages over the group's std: TRL adds 1e-4 to it, rollflow's grpo 1e-6 by default.
        ({"scale_rewards": "group"}, {"normalize_std": True, "advantage_args": {"eps": 1e-4}}),
        ({"mask_truncated_completions": True}, {"truncated": "mask"}),
    ],
    ids=["dapo", "std", "mask_truncated"],
)
def test_the_trl_compatible_setting_gives_trls_loss_and_gradients(both, trl_args, ours):
    trl, mine = both(trl_args, ours)
    loss, grad, _ = compare(trl, mine)
    assert loss < TOL and grad < TOL  # measured: loss 4e-8, gradients 7.5e-8 at most
    assert all(s.clip_fraction > 0 for s in mine)  # the clip acts in every step (3-23% of tokens)


def test_token_mean_mini_batch_weighs_each_optimizer_step_by_its_own_tokens(both, samples):
    """rollflow's default divides an optimizer step by its own loss tokens N_k, TRL's dapo by the
    generation batch's N over its K steps: TRL's gradient is rollflow's times N_k / (N / K)."""
    ours = {"token_mean": "mini_batch"}
    trl, mine = both({}, ours)
    tokens = [loss_tokens(samples, s.keys) for s in trl]  # 51 and 43 here
    assert compare(trl, mine)[2] > 0.05  # measured: 0.093 (a scale: cosine 1)
    rescaled = [s.scaled(n * K / sum(tokens)) for s, n in zip(mine, tokens, strict=True)]
    assert compare(trl, rescaled)[1] < TOL


def test_filter_zero_advantage_keeps_trls_gradient_under_the_batch_token_mean(both, samples):
    """rollflow's default drops groups whose advantages are all zero (group 2 here); TRL keeps
    them. Their loss is zero either way, and under ``token_mean = "batch"`` their tokens still
    count in every optimizer step's denominator (the batch records how many the filter left out),
    so the gradient is TRL's without their forward and backward passes."""
    trl, mine = both({}, {"filter_zero_advantage": True})
    assert any(g == 2 for s in trl for g, _ in s.keys)
    assert all(g != 2 for s in mine for g, _ in s.keys)
    loss, grad, _ = compare(trl, mine)
    assert loss < TOL and grad < TOL


def test_filter_zero_advantage_under_the_mini_batch_token_mean_scales_the_gradient(both, samples):
    """Under ``token_mean = "mini_batch"`` an optimizer step divides by its own kept tokens N_k:
    the filter then takes the zero-advantage groups' tokens out of the denominator, and TRL's
    gradient is rollflow's times N_k / (N / K), N counting those tokens."""
    trl, mine = both({}, {"filter_zero_advantage": True, "token_mean": "mini_batch"})
    total = loss_tokens(samples, [k for s in trl for k in s.keys])  # 94 here, 68 of them kept
    assert compare(trl, mine)[2] > 0.2  # measured: 0.38 and more (a scale per step: cosine 1)
    rescaled = [s.scaled(loss_tokens(samples, s.keys) * K / total) for s in mine]
    assert compare(trl, rescaled)[1] < TOL


@pytest.mark.parametrize(
    ("trl_args", "ours", "at_least"),
    [
        # The ratio's denominator: the sampler's log-probs (here the trainer's + N(0, 0.05)), not
        # the trainer's own at the weights that sampled, as TRL's (without vLLM). Measured: 0.24.
        ({}, {"old_logprobs": "inference"}, 0.1),
        # std + 1e-6 against TRL's std + 1e-4 (advantage_args.eps = 1e-4 matches). 2.5e-4.
        ({"scale_rewards": "group"}, {"normalize_std": True}, 1e-4),
        # Truncated completions out of their group's baseline too (TRL keeps them in it). 0.41.
        ({"mask_truncated_completions": True}, {"truncated": "drop"}, 0.2),
        # Every rollflow default of the setting at once: since token_mean = "batch" is the default
        # (and the zero-advantage filter leaves the gradient as it is under it), the sampler's
        # log-probs are the one difference left. Measured: 0.24 (1.03 with the old token mean).
        ({}, TrainSection().model_dump(include=set(COMPATIBLE)), 0.1),
    ],
    ids=["old_logprobs_inference", "std_eps", "truncated_drop", "rollflow_defaults"],
)
def test_a_default_that_differs_from_trl_changes_the_gradient(both, trl_args, ours, at_least):
    trl, mine = both(trl_args, ours)
    _, grad, relative = compare(trl, mine)
    assert grad > TOL and relative > at_least
