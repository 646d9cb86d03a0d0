"""Policy-gradient losses over completion tokens.

Every loss returns the SUM of its per-token terms; the caller divides by the number of loss
tokens of the whole optimizer step (all micro-batches, later all ranks), so that a token counts
the same wherever it lands.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossOutput:
    """Summed loss and summed statistics over the masked tokens of one micro-batch."""

    loss_sum: torch.Tensor
    num_tokens: int
    clipped_tokens: float
    ratio_sum: float
    mismatch_kl_sum: float


def ppo_clip_loss(logprobs_B_T: torch.Tensor, old_logprobs_B_T: torch.Tensor, advantages_B: torch.Tensor,
                  mask_B_T: torch.Tensor, eps_low: float, eps_high: float) -> LossOutput:
    """Token-level PPO clip with the sampler's logprobs as the behaviour policy."""
    log_ratio_B_T = (logprobs_B_T - old_logprobs_B_T) * mask_B_T
    ratio_B_T = torch.exp(log_ratio_B_T)
    adv_B_T = advantages_B[:, None].expand_as(ratio_B_T)
    unclipped = ratio_B_T * adv_B_T
    clipped = torch.clamp(ratio_B_T, 1 - eps_low, 1 + eps_high) * adv_B_T
    per_token = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        was_clipped = (clipped < unclipped).float() * mask_B_T
        # k3 estimator of KL(sampler || trainer): ratio - 1 - log ratio, per token.
        mismatch_kl = (ratio_B_T - 1 - log_ratio_B_T) * mask_B_T
    return LossOutput(
        loss_sum=(per_token * mask_B_T).sum(),
        num_tokens=int(mask_B_T.sum().item()),
        clipped_tokens=float(was_clipped.sum()),
        ratio_sum=float((ratio_B_T.detach() * mask_B_T).sum()),
        mismatch_kl_sum=float(mismatch_kl.sum()),
    )


def sequence_logprobs(model: torch.nn.Module, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor) -> torch.Tensor:
    """Log-prob of each token given its prefix; position t holds log p(x_t | x_<t), t=0 is 0."""
    logits_B_T_V = model(input_ids=input_ids_B_T, attention_mask=attention_mask_B_T).logits.float()
    logp_B_T = torch.log_softmax(logits_B_T_V[:, :-1], dim=-1).gather(-1, input_ids_B_T[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp_B_T, (1, 0))
