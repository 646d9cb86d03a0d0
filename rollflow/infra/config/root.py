"""``RunConfig``: the whole run's config tree, and the checks that span its sections."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from rollflow.infra.config.base import Section
from rollflow.infra.config.inference_section import InferenceSection
from rollflow.infra.config.metrics_section import MetricsSection
from rollflow.infra.config.model_section import ModelSection
from rollflow.infra.config.run_section import RunSection
from rollflow.infra.config.sampling_section import EnvSpec, PromptSection, SamplingSection
from rollflow.infra.config.train_section import TrainSection
from rollflow.infra.config.trainer_section import TrainerServiceSection


class RunConfig(Section):
    """The whole run."""

    run: RunSection = Field(
        default_factory=RunSection,
        description="[run]: the run's name, storage, seed and step counts.",
    )
    model: ModelSection = Field(
        description="[model]: the policy, a Hugging Face model (path) or a tiny one built locally."
    )
    envs: list[EnvSpec] = Field(
        min_length=1, description="[[envs]]: the environment mix, at least one; each name once."
    )
    prompt: PromptSection = Field(
        default_factory=PromptSection,
        description="[prompt]: how prompts become token ids (system prompt, chat template).",
    )
    sampling: SamplingSection = Field(
        default_factory=SamplingSection,
        description="[sampling]: group size, completion length, temperature, evaluation prompts.",
    )
    train: TrainSection = Field(
        default_factory=TrainSection,
        description="[train]: the algorithm: batches, staleness, advantages, loss, optimizer.",
    )
    inference: InferenceSection = Field(
        default_factory=InferenceSection,
        description="[inference]: the vLLM servers: how many, where, their deadlines.",
    )
    trainer: TrainerServiceSection = Field(
        default_factory=TrainerServiceSection,
        description="[trainer]: the trainer service: ranks, backend, devices, weight broadcast.",
    )
    metrics: MetricsSection = Field(
        default_factory=MetricsSection,
        description="[metrics]: where each step's metrics row goes besides storage.",
    )

    def vllm_args(self) -> list[str]:
        """The `vllm serve` flags the config gives every server of the run: the model's
        (``revision``, ``trust_remote_code``), the batch that holds what the run keeps in flight
        (``InferenceSection.batch_args``), then ``inference.extra_args``, which win."""
        inf = self.inference
        batch = inf.batch_args(max(self.sampling.group_size, self.sampling.eval_samples))
        return [*self.model.vllm_args(), *batch, *inf.extra_args]

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        t = self.train
        if t.mini_batch_size > t.train_batch_size:
            raise ValueError(
                f"train.mini_batch_size ({t.mini_batch_size}) must be <= train.train_batch_size "
                f"({t.train_batch_size}): a mini-batch is a slice of one outer batch"
            )
        if t.train_batch_size % t.mini_batch_size:
            raise ValueError(
                f"train.train_batch_size ({t.train_batch_size}) must be divisible by "
                f"train.mini_batch_size ({t.mini_batch_size})"
            )
        n, frac = t.optim_steps_per_step(), t.max_staleness - t.whole_staleness()
        if abs(frac * n - round(frac * n)) > 1e-3 * n or (0 < round(frac * n) >= n):
            raise ValueError(
                f"train.max_staleness ({t.max_staleness:g}): its fraction counts optimizer steps "
                f"out of the step's {n} (train_batch_size / mini_batch_size * num_epochs), so it "
                f"must be a whole number plus one of "
                f"{', '.join(f'{a / n:g}' for a in range(1, n)) or '(none: one optimizer step per step)'}"
            )
        if t.sync_lag() and t.sync_every != 1:
            raise ValueError(
                f"train.max_staleness = {t.max_staleness:g} sends weights mid-step, every step: it "
                f"needs train.sync_every = 1 (it is {t.sync_every})"
            )
        if t.sync_every > t.max_staleness + 1:
            raise ValueError(
                f"train.sync_every ({t.sync_every}) needs train.max_staleness >= {t.sync_every - 1} "
                f"(it is {t.max_staleness:g}): between syncs vLLM samples with weights up to "
                f"sync_every - 1 steps old; raise max_staleness or lower sync_every"
            )
        k, high = t.in_flight_groups(), t.train_batch_size * (t.whole_staleness() + 1)
        if not t.train_batch_size <= k <= high:
            raise ValueError(
                f"train.max_in_flight_groups ({k}) must be between train.train_batch_size "
                f"({t.train_batch_size}) and train.train_batch_size * (whole steps of train.max_staleness + 1) "
                f"({high}): fewer "
                "cannot fill a step, more can never be admitted under the staleness bound"
            )
        if t.loss.corrects and t.old_logprobs == "inference":
            raise ValueError(
                "train.loss.tis_cap / mask_low / mask_high have no effect with train.old_logprobs = "
                "'inference' (the ratio's old log-probs are then the sampler's own, so every "
                "importance ratio is 1): set train.old_logprobs = 'trainer', or leave them unset"
            )
        tr = self.trainer
        if tr.zero_stage is not None and tr.backend != "deepspeed":
            raise ValueError(
                f"trainer.zero_stage applies to trainer.backend = 'deepspeed' only (backend is {tr.backend!r}); "
                "remove it or set trainer.backend = 'deepspeed'"
            )
        inf = self.inference
        placing = (
            "inference.server_deployment" if inf.server_deployment else "trainer.node_deployment"
        )
        if (inf.server_deployment or tr.node_deployment) and t.lora and t.lora.sync == "adapter":
            raise ValueError(
                f"{placing} places the trainer and vLLM on different hosts, which share only the "
                "run's storage; train.lora.sync = 'adapter' is not served there yet (the servers "
                "load adapter files the trainer writes): set train.lora.sync = 'merged', or "
                f"leave {placing} empty"
            )
        if inf.urls and t.lora and t.lora.sync == "adapter":
            raise ValueError(
                "inference.urls names servers started elsewhere, which serve the model they were "
                "started with; train.lora.sync = 'adapter' needs servers started with the run's "
                "adapter: set train.lora.sync = 'merged', or leave inference.urls empty"
            )
        remote = [u for u in inf.urls if not _is_loopback(urlsplit(u).hostname or "")]
        if remote and _is_loopback(tr.master_addr):
            raise ValueError(
                f"inference.urls names servers on other hosts ({', '.join(remote)}), whose "
                f"workers join the weight group at trainer.master_addr = {tr.master_addr!r}, a "
                "loopback address: set it to this host's address as theirs reach it, or to "
                "'auto' (this host's own, found at start)"
            )
        if tr.node_deployment and _is_loopback(tr.master_addr):
            raise ValueError(
                f"trainer.node_deployment places the trainer's nodes on hosts of their own, which "
                f"meet node 0 (and vLLM its weight group) at trainer.master_addr = "
                f"{tr.master_addr!r}, a loopback address: set it to 'auto' (node 0's flow run "
                "finds its host's address) or to node 0's host as the others reach it"
            )
        if inf.server_deployment and _is_loopback(tr.master_addr):
            raise ValueError(
                f"inference.server_deployment places the vLLM servers on other hosts, which join "
                f"the weight group at trainer.master_addr = {tr.master_addr!r}, a loopback "
                "address: set it to this host's address as the servers' hosts reach it, or to "
                "'auto' (this host's own, found at start)"
            )
        names = [e.name for e in self.envs]
        if len(set(names)) != len(names):
            raise ValueError(f"envs names repeat: {names}; give each environment once")
        return self


def _is_loopback(host: str) -> bool:
    """Whether ``host`` names this host only (a literal loopback address, or localhost); a
    name is not resolved here: it is where it is used."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
