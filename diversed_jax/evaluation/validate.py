"""`validate(config)`: every check that needs no model, run before anything is loaded.

Each failure is a ValueError that starts with the dotted field name and its bad value,
e.g. "decode.temperature=-1.0: must be >= 0 (0 = greedy)".
"""

from __future__ import annotations

import filecmp
import math
import os

from diversed_jax.evaluation import methods as methods_lib
from diversed_jax.models import loading, registry
from diversed_jax.speculative import build
from diversed_jax.speculative.decoder import MATMUL_PRECISIONS
from diversed_jax.speculative.types import CASCADE_RULES, DIVERGENCES
from diversed_jax.tasks import datasets, prompts
from diversed_jax.tasks.datasets import TASKS, is_local

MODES = ("eval", "train", "train_and_eval", "distill", "bench")
# Which `task.fields` entries a task's loader reads.
TASK_FIELDS = {
    "gsm8k": ("id", "source_text", "reference"),
    "cnndm": ("id", "source_text", "reference"),
    "xsum": ("id", "source_text", "reference"),
    "mbpp": ("id", "source_text", "test_list"),
    "humaneval": ("id", "source_text", "reference", "entry_point"),
}
SHIPPED_SPLITS = {"gsm8k": ("test", "train"), "cnndm": ("test", "train", "train_more"),
                  "xsum": (), "mbpp": ("prompt", "test", "validation", "train", "all"),
                  "humaneval": ("test",)}


def _fail(field: str, value, why: str):
  raise ValueError(f"{field}={value!r}: {why}")


def check_model(field: str, spec: str, allow_self: bool = False) -> None:
  """Raises ValueError unless `spec` names a model: a registry name, an existing file or
  folder, or a hub id; with `allow_self` (a draft) also 'self:L' and 'nocopy:FOLDER'."""
  if not isinstance(spec, str):
    _fail(field, spec, "must be a string")
  if allow_self and spec.startswith("self:"):
    if not spec[5:].isdigit() or int(spec[5:]) < 1:
      _fail(field, spec, "a self-draft is 'self:L' with L >= 1 target layers")
    return
  if allow_self and spec.startswith(build.NO_COPY):
    marker = os.path.join(os.path.expanduser(spec.removeprefix(build.NO_COPY)),
                          build.DRAFT_KIND_FILE)
    if not os.path.isfile(marker):
      _fail(field, spec, f"{build.NO_COPY!r} needs a distilled draft folder (one with "
            f"{build.DRAFT_KIND_FILE})")
    return
  if (registry.is_registered(spec) or os.path.exists(os.path.expanduser(spec))
      or (loading.looks_like_hub_id(spec) and not is_local(spec))):
    return
  _fail(field, spec, "not a registered model name "
        f"({', '.join(sorted(registry.REGISTRY))}), an existing file or folder, or a hub "
        "id like 'org/name'")


def _check_number(field, value, low=None, high=None, low_open=False, integer=False):
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    _fail(field, value, "must be a finite number")
  if integer and int(value) != value:
    _fail(field, value, "must be an integer")
  if low is not None and (value <= low if low_open else value < low):
    _fail(field, value, f"must be {'>' if low_open else '>='} {low}")
  if high is not None and value > high:
    _fail(field, value, f"must be <= {high}")


def _check_grid(field, values, low, high, low_open, integer=False):
  if isinstance(values, (int, float)):
    values = (values,)
  if not values:
    _fail(field, tuple(values), "needs at least one value for the selected method")
  if len(set(values)) != len(values):
    _fail(field, tuple(values), "repeats a value (one setting, run and reported twice)")
  for v in values:
    try:
      _check_number(field, v, low, high, low_open, integer)
    except ValueError as err:
      _fail(field, tuple(values), f"value {v!r}: {str(err).split(': ', 1)[1]}")


def _check_task(config) -> None:
  t = config.task
  if t.name not in TASKS:
    _fail("task.name", t.name, f"must be one of {list(TASKS)}")
  source = t.source
  if source and is_local(source) and not os.path.isfile(os.path.expanduser(source)):
    _fail("task.source", source, "no such file (a local .jsonl/.json file or a hub name)")
  if t.name == "mbpp" and source == "sanitized" and t.split not in SHIPPED_SPLITS["mbpp"]:
    _fail("task.split", t.split, f"the shipped sanitized mbpp set has splits "
          f"{list(SHIPPED_SPLITS['mbpp'])}")
  if not source:
    if not SHIPPED_SPLITS[t.name]:
      _fail("task.source", source, f"no sample of {t.name} is shipped: give a hub name or a "
            "local .jsonl file")
    if t.split not in SHIPPED_SPLITS[t.name]:
      _fail("task.split", t.split, f"the shipped {t.name} sample has splits "
            f"{list(SHIPPED_SPLITS[t.name])}")
  _check_number("task.offset", t.offset, 0, integer=True)
  _check_number("task.limit", t.limit, 0, integer=True)
  _check_number("task.num_shots", t.num_shots, 0, integer=True)
  if t.name == "humaneval" and t.num_shots:
    _fail("task.num_shots", t.num_shots, "humaneval has no train split for few-shot examples")
  if t.num_shots and (not source or is_local(source)) and not (
      set(SHIPPED_SPLITS[t.name]) & {"train", "prompt"}):
    _fail("task.num_shots", t.num_shots, f"few-shot examples come from a train split: none "
          f"ships for {t.name}; use a hub source")
  check_shots_apart(t)
  _check_number("task.max_prompt_tokens", t.max_prompt_tokens, 2, integer=True)
  for key, value in t.fields.items():
    if value and key not in TASK_FIELDS[t.name]:
      _fail(f"task.fields.{key}", value, f"{t.name} reads only the fields "
            f"{list(TASK_FIELDS[t.name])}")
  for field in ("head.task", "train.task"):
    section, key = field.split(".")
    value = config[section][key]
    if value and value not in TASKS:
      _fail(field, value, f"must be '' or one of {list(TASKS)}")


def check_shots_apart(task_cfg) -> None:
  """Refuses few-shot examples drawn from the data being evaluated (`task` section): a
  test example shown solved in the prompt of the evaluation that scores it."""
  t = task_cfg
  if not t.num_shots:
    return
  shot_source, shot_split = prompts.shot_origin(t.name, t.source or None)
  if t.source and is_local(t.source):
    # Shots come from the shipped file: a copy of it given as the source is the same data
    # (a copy under another name too; an edited copy is left to prompts.check_shots_disjoint,
    # once the examples are loaded).
    shipped = datasets.shipped_split_path(t.name, shot_split)
    source = os.path.expanduser(t.source)
    same = bool(shipped) and (os.path.realpath(source) == os.path.realpath(shipped) or (
        os.path.isfile(source) and filecmp.cmp(source, shipped, shallow=False)))
  else:
    # MBPP's 'all' split holds every other split, the shots' included.
    same = shot_source == (t.source or None) and (
        t.split == shot_split or (t.name == "mbpp" and t.split == "all"))
  if same:
    _fail("task.num_shots", t.num_shots, f"the few-shot examples would come from the "
          f"evaluated data itself (task.source={t.source!r}, task.split={t.split!r}, shots "
          f"from split {shot_split!r}): evaluate another split or set task.num_shots=0")


def _check_methods(config) -> None:
  m = config.methods
  names = methods_lib.method_names(m.run)
  if not names:
    _fail("methods.run", m.run, "name at least one method")
  for name in names:
    if name not in methods_lib.FAMILIES:
      _fail("methods.run", m.run, f"unknown method {name!r}; choose from "
            f"{list(methods_lib.FAMILIES)}")
  if "lossy" in names:
    _check_grid("methods.lenience", m.lenience, 0.0, 1.0, low_open=True)
  if "static" in names:
    _check_grid("methods.static_weights", m.static_weights, 0.0, 1.0, low_open=False)
    if m.static_rule not in ("static", "static_logit"):
      _fail("methods.static_rule", m.static_rule, "must be 'static' or 'static_logit'")
  if "cascade" in names:
    if not m.cascade_rules:
      _fail("methods.cascade_rules", m.cascade_rules, "needs at least one rule")
    for rule in m.cascade_rules:
      if rule not in CASCADE_RULES:
        _fail("methods.cascade_rules", tuple(m.cascade_rules),
              f"unknown rule {rule!r}; choose from {list(CASCADE_RULES)}")
    _check_number("methods.cascade_alpha", m.cascade_alpha, 0.0, 1.0)
  if "mentored" in names:
    if m.mentored_divergence not in DIVERGENCES:
      _fail("methods.mentored_divergence", m.mentored_divergence,
            f"must be one of {list(DIVERGENCES)}")
    # A TV budget above 1 means nothing; KL and chi^2 are unbounded.
    _check_grid("methods.mentored_epsilon", m.mentored_epsilon, 0.0,
                1.0 if m.mentored_divergence == "tv" else None, low_open=False)
  if "typical" in names:
    _check_number("methods.typical_epsilon", m.typical_epsilon, 0.0, 1.0, low_open=True)
    _check_number("methods.typical_delta", m.typical_delta, 0.0, low_open=True)
  if "smc" in names:
    _check_grid("methods.smc_particles", m.smc_particles, 1, None, low_open=False,
                integer=True)
    _check_number("methods.smc_ess_threshold", m.smc_ess_threshold, 0.0, 1.0)
    if config.decode.temperature == 0:
      _fail("decode.temperature", config.decode.temperature,
            "method 'smc' needs temperature > 0 (it weighs drafts by p/q, which greedy "
            "laws make 0 or 1)")
  if "ssd" in names:
    _check_number("methods.ssd_fanout", m.ssd_fanout, 1, None, integer=True)
    _check_number("methods.ssd_guess_budget", m.ssd_guess_budget, 0, None, integer=True)
    guesses = (config.decode.num_draft + 1) * m.ssd_fanout
    if m.ssd_guess_budget > guesses:
      _fail("methods.ssd_guess_budget", m.ssd_guess_budget,
            f"must be at most (decode.num_draft + 1) x methods.ssd_fanout = {guesses}")
    _check_grid("methods.ssd_saguaro_scales", m.ssd_saguaro_scales, 0.0, 1.0, low_open=True)


def validate(config) -> None:
  """Raises ValueError naming the first bad field and its value; loads nothing."""
  if config.mode not in MODES:
    _fail("mode", config.mode, f"must be one of {list(MODES)}")
  _check_number("seed", config.seed, 0, integer=True)
  check_model("model.target", config.model.target)
  if config.model.draft:
    check_model("model.draft", config.model.draft, allow_self=True)
  if config.model.finetuned_draft:
    check_model("model.finetuned_draft", config.model.finetuned_draft, allow_self=True)
  if config.model.tokenizer:
    check_model("model.tokenizer", config.model.tokenizer)
  if config.head.path and not os.path.isdir(os.path.expanduser(config.head.path)):
    _fail("head.path", config.head.path, "no such head folder")
  _check_task(config)
  d = config.decode
  _check_number("decode.temperature", d.temperature)
  if d.temperature < 0:
    _fail("decode.temperature", d.temperature, "must be >= 0 (0 = greedy)")
  _check_number("decode.top_p", d.top_p, 0.0, 1.0, low_open=True)
  _check_number("decode.num_draft", d.num_draft, 1, integer=True)
  _check_number("decode.max_new_tokens", d.max_new_tokens, 1, integer=True)
  _check_number("decode.batch_size", d.batch_size, 1, integer=True)
  _check_number("decode.queue", d.queue, 0, integer=True)
  if 0 < d.queue < d.batch_size:
    _fail("decode.queue", d.queue, f"must be 0 or >= decode.batch_size ({d.batch_size})")
  if d.matmul_precision not in MATMUL_PRECISIONS:
    _fail("decode.matmul_precision", d.matmul_precision,
          f"must be one of {list(MATMUL_PRECISIONS)}")
  _check_number("decode.mesh_data", d.mesh_data, integer=True)
  if d.mesh_data != -1 and d.mesh_data < 1:
    _fail("decode.mesh_data", d.mesh_data, "must be -1 (all devices) or >= 1")
  _check_methods(config)
  name = config.eval.results_file
  if not name or os.path.basename(name) != name:
    _fail("eval.results_file", name, "must be a file name (it is written in the workdir)")
  _check_number("eval.score_workers", config.eval.score_workers, 1, integer=True)
  _check_number("bench.num_prompts", config.bench.num_prompts, 1, integer=True)
  _check_number("bench.repeats", config.bench.repeats, 1, integer=True)
  if config.distill.mode == "export":
    # The export needs the distill config's export_dir, which this config cannot set.
    _fail("distill.mode", config.distill.mode, "the main job cannot export a draft; run "
          f"python -m diversed_jax.distill --config={config.distill.config} "
          "--config.mode=export --config.export_dir=FOLDER")
  if config.distill.mode not in ("data", "train"):
    _fail("distill.mode", config.distill.mode, "must be 'data' or 'train'")
  if config.mode == "distill" and not os.path.isfile(config.distill.config):
    _fail("distill.config", config.distill.config, "no such config file")
  _check_number("train.limit", config.train.limit, 0, integer=True)
  if config.mode in ("train", "train_and_eval"):
    train_task = config.train.task or config.task.name
    if train_task == "humaneval" and config.task.num_shots:
      # The head trains on prompts formatted as the evaluation's, shots included.
      _fail("task.num_shots", config.task.num_shots, "the head's humaneval training "
            "prompts cannot have few-shot examples (no train split); set train.task")
    source = config.train.source
    if source and is_local(source) and not os.path.isfile(os.path.expanduser(source)):
      _fail("train.source", source, "no such file (a local .jsonl/.json file or a hub name)")
    if not source and config.train.split not in SHIPPED_SPLITS[train_task]:
      _fail("train.split" if SHIPPED_SPLITS[train_task] else "train.task",
            config.train.split if SHIPPED_SPLITS[train_task] else train_task,
            f"no shipped {train_task} sample has that split (shipped: "
            f"{list(SHIPPED_SPLITS[train_task])}); set train.source, or train.task to "
            "another task (a head trained on one task can be evaluated on another)")
    t = config.task
    if (train_task, source or "", config.train.split) == (t.name, t.source or "", t.split):
      _fail("train.split", config.train.split, f"the head would train on the evaluated "
            f"examples (task.split={t.split!r} of the same {t.name} data); train on another "
            "split")
  from diversed_jax.training import config as train_config
  train_config.validate(config.train)
