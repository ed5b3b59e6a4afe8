"""RL for the DIVERSED ensemble head: the head (w_t), the loss (REINFORCE++ plus the acceptance
regulariser lambda sum_t (1 - w_t TV(p_t, q_t))), and the optimiser / train step."""

from diversed_jax.rl.head import HEAD_KINDS, EnsembleHead, init_head, make_head_fn
from diversed_jax.rl.losses import (ADVANTAGES, PPO_CLIP_EPS, acceptance_regulariser,
                                    diversed_loss, get_advantage_fn, grpo_advantages, log_nu,
                                    masked_mean, masked_sum, masked_whiten,
                                    reinforce_advantages, reinforce_pp_advantages)
from diversed_jax.rl.optim import make_optimizer, make_train_step

__all__ = [
    "ADVANTAGES", "HEAD_KINDS", "PPO_CLIP_EPS", "EnsembleHead", "acceptance_regulariser",
    "diversed_loss", "get_advantage_fn", "grpo_advantages", "init_head", "log_nu",
    "make_head_fn", "make_optimizer", "make_train_step", "masked_mean", "masked_sum",
    "masked_whiten", "reinforce_advantages", "reinforce_pp_advantages",
]
