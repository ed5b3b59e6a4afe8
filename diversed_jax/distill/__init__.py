"""Draft distillation: trainable draft kinds, target-generated data, the training loop,
and the shipped drafts (`artifacts`). Entry point: `python -m diversed_jax.distill`."""
