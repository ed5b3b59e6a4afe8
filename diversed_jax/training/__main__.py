"""Trains a DIVERSED head for a target/draft pair on a task; resumable.

  python -m diversed_jax.training --task=gsm8k --workdir=runs/heads/gsm8k \
      --train.total_steps=30 --train.max_new_tokens=64 [--ship_as=smollm2-self4-gsm8k]

--ship_as copies the trained head folder to diversed_jax/assets/heads/<name>, where
training.artifacts registers it as the default head for (target, draft, task); a name
other than that of the folder already shipped for the same triple is refused before
training (use that folder's name to replace its head).
"""

from __future__ import annotations

import dataclasses
import os

from absl import app, flags
from ml_collections import config_flags

from diversed_jax.training.config import default_config

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "target model spec")
_DRAFT = flags.DEFINE_string("draft", None, "draft spec (default: the target's default draft)")
_TASK = flags.DEFINE_string("task", "gsm8k", "task name (diversed_jax.tasks)")
_SPLIT = flags.DEFINE_string("split", "train", "split of the training prompts")
_SOURCE = flags.DEFINE_string("source", None, "dataset source (default: the shipped sample)")
_LIMIT = flags.DEFINE_integer("limit", None, "use the first N examples")
_SHOTS = flags.DEFINE_integer("shots", 0, "few-shot examples in each prompt")
_MAX_WORDS = flags.DEFINE_integer("max_source_words", None,
                                  "article truncation of summarization prompts (task default)")
_WORKDIR = flags.DEFINE_string("workdir", None, "checkpoints, logs and head/", required=True)
_SHIP_AS = flags.DEFINE_string("ship_as", None, "copy the head to assets/heads/<name>")
config_flags.DEFINE_config_dict("train", default_config(), lock_config=True)


def check_flags():
  """The run's task, after checking every flag that needs no model: each bad value is a
  usage error naming the flag (or `--train.<field>`) and the value, before anything loads."""
  from diversed_jax import cli
  from diversed_jax.tasks.registry import get_task
  from diversed_jax.training.config import HParams
  with cli.usage_errors("--"):  # "train.lam=-1.0: ..." names the flag --train.lam
    HParams.from_config(flags.FLAGS.train).mesh()  # validates, and the rows divide
  with cli.usage_errors("--task: "):
    task = get_task(_TASK.value)
  for flag, low in ((_LIMIT, 1), (_SHOTS, 0), (_MAX_WORDS, 1)):
    if flag.value is not None and flag.value < low:
      raise app.UsageError(f"--{flag.name} must be >= {low}, got {flag.value}")
  if _SHOTS.value and task.name == "humaneval":
    raise app.UsageError("--shots: humaneval has no train split to draw few-shot examples "
                         "from")
  from diversed_jax.evaluation import validate
  with cli.usage_errors():  # a typo would fail only after the target loads
    validate.check_model("--target", _TARGET.value)
    if _DRAFT.value is not None:
      validate.check_model("--draft", _DRAFT.value, allow_self=True)
  return task


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from diversed_jax import atomic_files, cli
  from diversed_jax.parallel import hosts
  with cli.usage_errors():
    hosts.initialize_distributed()  # first: before anything touches a device
  task = check_flags()
  from diversed_jax.models import loading
  from diversed_jax.speculative import build
  from diversed_jax.tasks import prompts as prompts_lib
  from diversed_jax.tokenizer import load_tokenizer
  from diversed_jax.training import artifacts
  from diversed_jax.training.trainer import text_task, train_head

  target = loading.load_model(_TARGET.value)
  draft, draft_params, draft_spec = build.load_draft(_DRAFT.value, target)
  if _SHIP_AS.value:  # before training: a head another folder outranks is no default
    with cli.usage_errors():
      artifacts.check_ship_as(_SHIP_AS.value, target.name, draft_spec, task.name)
  if _MAX_WORDS.value is not None:
    task = dataclasses.replace(task, max_source_words=_MAX_WORDS.value)
  examples = task.load(source=_SOURCE.value, split=_SPLIT.value, limit=_LIMIT.value)
  shots = prompts_lib.load_shots(task.name, _SHOTS.value) if _SHOTS.value else ()
  tokenizer = load_tokenizer(_TARGET.value)
  print(f"target {target.name}, draft {draft_spec}, task {task.name}: {len(examples)} "
        f"{_SPLIT.value} examples", flush=True)
  folder = train_head(flags.FLAGS.train, target=target, draft=draft,
                      draft_params=draft_params, task=text_task(task, tokenizer, shots=shots),
                      examples=examples, workdir=_WORKDIR.value, draft_spec=draft_spec,
                      progress=lambda line: print(line, flush=True))
  if not hosts.is_writer():  # process 0 wrote the head
    return
  print(f"head: {folder}", flush=True)
  if _SHIP_AS.value:
    dest = os.path.join(artifacts.ASSETS, _SHIP_AS.value)
    os.makedirs(dest, exist_ok=True)
    for name in ("params.npz", "head.json"):  # head.json last: it makes a head folder
      atomic_files.copy_file(os.path.join(folder, name), os.path.join(dest, name))
    print(f"shipped: {dest}", flush=True)


if __name__ == "__main__":
  app.run(main)
