"""A step's metrics from its optimizer steps' typed replies, in the run process (no trainer code)."""

import pytest

from rollflow.infra.moments import PerEnvMoments
from rollflow.tasks.train.train_task import summarize_optimizer_steps
from rollflow.trainer.protocol import FORWARD_BACKWARD

from trainer_support import forward_backward_reply, optim_step_reply


def test_step_summary_is_flat_floats_with_tokens_per_second():
    per_env = PerEnvMoments()
    per_env.add("entropy", "sort", 1.0)
    # As it crosses the wire: the moments as JSON lists, parsed into the reply.
    fb = FORWARD_BACKWARD.parse(
        forward_backward_reply(
            loss=0.5,
            num_loss_tokens=10,
            num_tokens=30,
            forward_backward_s=0.2,
            per_env=per_env.to_json(),
        ).model_dump(mode="json")
    )
    step = optim_step_reply(grad_norm=2.0, optim_step_s=0.1)
    out = summarize_optimizer_steps([(fb, step), (fb.model_copy(update={"loss": 1.5}), step)])
    assert out["loss"] == 1.0 and out["grad_norm"] == 2.0
    assert out["num_optim_steps"] == 2 and out["num_tokens"] == 60
    assert out["tokens_per_s"] == pytest.approx(60 / 0.6)
    assert out["entropy/sort/mean"] == 1.0 and out["entropy/all/max"] == 1.0
    assert all(isinstance(v, (int, float)) for v in out.values())


def test_a_step_without_optimizer_steps_says_so():
    assert summarize_optimizer_steps([]) == {"num_optim_steps": 0, "num_loss_tokens": 0}
