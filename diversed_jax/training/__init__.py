"""Training of the DIVERSED ensemble head: config, rollouts from the speculative loop
(with the loop's record of each token's law, for log nu), the RL loop with checkpoints,
head folders and shipped heads."""

from diversed_jax.training.config import HParams, default_config, validate
from diversed_jax.training.head_io import load_head_folder, read_head, save_head
from diversed_jax.training.trainer import TokenTask, text_task, train_head

__all__ = ["HParams", "TokenTask", "default_config", "load_head_folder", "read_head",
           "save_head", "text_task", "train_head", "validate"]
