"""A tiny variant of distill_smollm2.py for tests and smoke runs (random tiny target)."""

import importlib.util
import os


def _base():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distill_smollm2.py")
  spec = importlib.util.spec_from_file_location("distill_smollm2", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config():
  c = _base()
  c.workdir = "runs/distill_tiny"  # checkpoints of the smoke run
  c.data.dir = "runs/distill_tiny_data"  # shards of the smoke run
  c.data.batch = 4  # prompts per shard
  c.data.num_shards = 3  # shards to write
  c.data.max_new_tokens = 16  # continuation length
  c.data.max_new_tokens_cnndm = 16  # continuation length
  c.data.top_k = 8  # stored target probabilities per position
  c.draft.num_layers = 1  # draft layers
  c.draft.hidden_size = 32  # independent draft width
  c.draft.num_heads = 4  # query heads
  c.draft.num_kv_heads = 2  # key/value heads
  c.draft.intermediate_size = 48  # MLP width
  c.draft.vocab_keep = 40  # kept vocabulary
  c.train.steps = 40  # optimiser steps
  c.train.batch = 4  # windows per step
  c.train.window = 16  # tokens per window
  c.train.lr = 3e-3  # peak learning rate
  c.train.warmup = 5  # warm-up steps
  c.train.decay_steps = 100  # cosine decay length
  c.train.checkpoint_every = 5  # steps between checkpoints
  c.train.log_every = 5  # steps between progress lines
  c.train.eval_every = 10  # steps between evaluations
  c.train.eval_shards = (0,)  # held-out shard indices
  c.train.min_shards = 1  # shards needed to start
  c.train.rescan_every = 10  # steps between shard rescans
  return c
