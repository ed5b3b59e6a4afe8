"""Assembles a SpeculativeDecoder from user-facing names: target, draft, head.

Draft specs: 'self:L' (the target's first L layers), a model name/folder/GGUF sharing the
target's vocabulary, a draft checkpoint folder written by `diversed_jax.distill` (with its
context-copy gate when the folder has one; 'nocopy:FOLDER' leaves the gate out), or None
for the target's default draft (the shipped distilled draft when there is one, else
'self:4'). Head specs: a head checkpoint folder, or None for the pair's shipped head for
the task (its GSM8K head when no task is named), else a fixed w = 0.5 (`info['head']` is
then FIXED_HEAD; callers that run 'diversed' should warn, see `fixed_weight_warning`).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Any, Callable

import jax.numpy as jnp

from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.models import loading
from diversed_jax.speculative import drafts
from diversed_jax.speculative.decoder import ModelHandle, SpeculativeDecoder

FALLBACK_DRAFT = "self:4"
NO_COPY = "nocopy:"  # prefix: a distilled draft folder without its context-copy gate
DRAFT_KIND_FILE = "draft_kind.txt"  # marks a distilled draft folder; holds its loader's kind
FALLBACK_WEIGHT = 0.5
FIXED_HEAD = f"fixed w={FALLBACK_WEIGHT}"  # the head description of that fallback
# The task whose shipped head serves when none is named (generate without --task): the
# main job's default task, named here so that the choice does not hang on sort order.
DEFAULT_HEAD_TASK = "gsm8k"

# Hooks filled by the draft-distillation and head-training packages, so that this module
# does not import them: name -> callable.
#   DRAFT_LOADERS[kind](folder, target, copy) -> (draft object, draft params); copy: with the
#       folder's context-copy gate, if it has one
#   DEFAULT_DRAFTS[target name] -> draft spec (a folder)
#   DEFAULT_HEADS[(target name, draft spec, task)] -> head folder
#   HEAD_LOADER(folder) -> (weight_fn, head params)
DRAFT_LOADERS: dict[str, Callable] = {}
DEFAULT_DRAFTS: dict[str, str] = {}
DEFAULT_HEADS: dict[tuple[str, str, str], str] = {}
HEAD_LOADER: list[Callable] = []


def _register_shipped_artifacts():
  # Importing these packages registers their loaders and shipped defaults (if present).
  for module in ("diversed_jax.distill.artifacts", "diversed_jax.training.artifacts"):
    try:
      __import__(module)
    except ModuleNotFoundError as err:
      if err.name is None or not module.startswith(err.name):
        raise


def constant_weight_fn(weight: float):
  """A head that ignores its inputs: w_t = weight everywhere (the static ensemble)."""
  def weight_fn(head_params, h_q, h_p):
    del head_params, h_p
    return jnp.full(h_q.shape[:-1], weight, jnp.float32)
  return weight_fn


@dataclasses.dataclass
class Pair:
  target: loading.LoadedModel
  draft: Any
  draft_params: Any
  draft_spec: str


def load_draft(draft_spec: str | None, target: loading.LoadedModel, dtype=jnp.float32):
  """(draft object, draft params, resolved spec) for a draft spec (see module doc)."""
  _register_shipped_artifacts()
  if draft_spec is None:
    draft_spec = DEFAULT_DRAFTS.get(target.name, FALLBACK_DRAFT)
  num_layers = drafts.parse_self_draft(draft_spec)
  if num_layers is not None:
    draft, params = drafts.self_draft(target.config, target.params, num_layers)
    return draft, params, draft_spec
  folder = draft_spec.removeprefix(NO_COPY)
  marker = os.path.join(folder, DRAFT_KIND_FILE)
  if os.path.isfile(marker):
    kind = open(marker).read().strip()
    if kind not in DRAFT_LOADERS:
      raise ValueError(f"draft folder {folder!r} has kind {kind!r}; known kinds: "
                       f"{sorted(DRAFT_LOADERS)}")
    draft, params = DRAFT_LOADERS[kind](folder, target, copy=folder == draft_spec)
    return draft, params, draft_spec
  if folder != draft_spec:
    raise ValueError(f"draft {draft_spec!r}: {NO_COPY!r} needs a distilled draft folder")
  model = loading.load_model(draft_spec, dtype)
  if model.config.vocab_size != target.config.vocab_size:
    raise ValueError(f"draft {draft_spec!r} has vocabulary size {model.config.vocab_size} "
                     f"but target {target.name!r} has {target.config.vocab_size}")
  _check_tokenizers(draft_spec, target.name)
  return drafts.LMDraft(model.config), model.params, draft_spec


def _check_tokenizers(draft_spec: str, target_spec: str) -> None:
  """Refuses a pair whose tokenizers map tokens to different ids (when both have one)."""
  try:
    draft_tok = tokenizer_lib.load_tokenizer(draft_spec)
    target_tok = tokenizer_lib.load_tokenizer(target_spec)
  except (OSError, ValueError):
    return  # A weights-only folder: the vocabulary-size check above is all we can do.
  tokenizer_lib.check_compatible(draft_tok, target_tok)


def _draft_key(spec: str) -> str:
  """A draft spec as shipped heads are keyed: a folder by its real path, its 'nocopy:'
  form as the folder (the gate changes the law, not the hidden states a head reads)."""
  folder = spec.removeprefix(NO_COPY)
  return os.path.realpath(folder) if os.path.isdir(folder) else spec


def shipped_head(target_name: str, draft_spec: str, task: str | None) -> str | None:
  """The shipped head folder of (target, draft) for `task` (None: DEFAULT_HEAD_TASK); the
  draft may be named by any path to its folder, or in its 'nocopy:' form."""
  _register_shipped_artifacts()
  want = (target_name, _draft_key(draft_spec), task or DEFAULT_HEAD_TASK)
  return next((head for (t, d, k), head in DEFAULT_HEADS.items()
               if (t, _draft_key(d), k) == want), None)


def shipped_head_tasks(target_name: str, draft_spec: str) -> list[str]:
  """The tasks that have a shipped head for (target, draft)."""
  _register_shipped_artifacts()
  return sorted(k for t, d, k in DEFAULT_HEADS
                if (t, _draft_key(d)) == (target_name, _draft_key(draft_spec)))


def fixed_weight_warning(target_name: str, draft_spec: str, task: str | None) -> str:
  """What to tell a user whose 'diversed' runs with FIXED_HEAD: why, and the way out."""
  tasks = shipped_head_tasks(target_name, draft_spec)
  return (f"'diversed' has no head for target {target_name!r}, draft {draft_spec!r}, task "
          f"{task or DEFAULT_HEAD_TASK!r}: it runs with a {FIXED_HEAD} (the static "
          f"ensemble, not DIVERSED). Give a head folder, or the task of a shipped head "
          f"({', '.join(tasks) if tasks else 'none ships for this pair'}).")


def load_head(head_spec: str | None, target_name: str, draft_spec: str, task: str | None):
  """(weight_fn, head params, description) for method 'diversed'; without `head_spec`,
  the shipped head (`shipped_head`, registered for this very pair), else FIXED_HEAD. A
  given `head_spec` must have been trained for `target_name` and `draft_spec`: its w_t
  reads their hidden states, and heads of different drafts can have the same input width
  (ValueError otherwise; another task than `task` only warns)."""
  given = head_spec is not None
  if head_spec is None:
    head_spec = shipped_head(target_name, draft_spec, task)
  if head_spec is None:
    return constant_weight_fn(FALLBACK_WEIGHT), {}, FIXED_HEAD
  _register_shipped_artifacts()
  if not HEAD_LOADER:
    raise ValueError(f"head {head_spec!r} given but the training package is not available")
  if given:
    from diversed_jax.training import head_io  # there: it filled HEAD_LOADER
    head_io.check_pair(head_spec, target_name, draft_spec, task)
  weight_fn, params = HEAD_LOADER[0](head_spec)
  return weight_fn, params, head_spec


# One ModelHandle per loaded target (by identity, while it lives), so that every decoder
# built for it shares one copy of its decoding layout: the evaluation builds up to three.
_HANDLES: dict[int, tuple[weakref.ref, ModelHandle]] = {}


def model_handle(target: loading.LoadedModel) -> ModelHandle:
  """The handle of `target` that the decoders built for it share."""
  key = id(target)
  if key in _HANDLES and _HANDLES[key][0]() is target:
    return _HANDLES[key][1]
  handle = ModelHandle(target.config, target.params)
  _HANDLES[key] = (weakref.ref(target, lambda _: _HANDLES.pop(key, None)), handle)
  return handle


def build_decoder(target: loading.LoadedModel, draft_spec: str | None = None,
                  head_spec: str | None = None, task: str | None = None,
                  need_draft: bool = True, shrink_tail: bool = False,
                  matmul_precision: str = "highest", mesh=None
                  ) -> tuple[SpeculativeDecoder, dict]:
  """A decoder for `target` and a dict describing what was resolved (`shrink_tail`,
  `matmul_precision`, `mesh`: see `SpeculativeDecoder`)."""
  info = {"target": target.name}
  handle = model_handle(target)
  options = dict(shrink_tail=shrink_tail, matmul_precision=matmul_precision, mesh=mesh)
  if not need_draft:
    return SpeculativeDecoder(handle, **options), info
  draft, draft_params, resolved = load_draft(draft_spec, target)
  weight_fn, head_params, head_desc = load_head(head_spec, target.name, resolved, task)
  info.update(draft=resolved, head=head_desc)
  return SpeculativeDecoder(handle, draft, draft_params, weight_fn, head_params,
                            **options), info
