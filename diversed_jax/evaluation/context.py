"""What an evaluation needs, built from a validated config: the task slice, prompt ids,
the target, its tokenizer and one decoder per draft (with the resolved head)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.evaluation import validate as validate_lib
from diversed_jax.models import loading
from diversed_jax.parallel import hosts
from diversed_jax.parallel import mesh as mesh_lib
from diversed_jax.speculative import build
from diversed_jax.speculative.decoder import SpeculativeDecoder
from diversed_jax.tasks import prompts as prompts_lib
from diversed_jax.tasks.registry import Task, get_task

TRAIN_SUBDIR = "train"  # train mode's workdir inside the main workdir (checkpoints, head/)


def field_overrides(fields) -> dict[str, str]:
  """The non-empty `task.fields` entries (canonical name -> name in the file)."""
  return {k: v for k, v in fields.items() if v}


def load_slice(task_cfg, split: str | None = None, offset: int | None = None,
               limit: int | None = None) -> tuple[Task, list]:
  """(Task, examples[offset:offset + limit]) of the `task` config section."""
  task = get_task(task_cfg.name)
  offset = task_cfg.offset if offset is None else offset
  limit = task_cfg.limit if limit is None else limit
  examples = task.load(source=task_cfg.source or None, split=split or task_cfg.split,
                       limit=offset + limit if limit else None,
                       fields=field_overrides(task_cfg.fields) or None)
  return task, examples[offset:]


def prompt_shots(config, task_name: str | None = None) -> list:
  """The few-shot examples of `task_name`'s prompts (default task.name; task.num_shots of
  them) from a train split, never from the evaluated data (validate.check_shots_apart):
  the hub dataset's when task.source is a hub name, else the shipped one. Another task's
  (a head trained on train.task) come from its shipped train split."""
  t = config.task
  task_name = task_name or t.name
  if task_name != t.name:
    return prompts_lib.load_shots(task_name, t.num_shots)
  validate_lib.check_shots_apart(t)
  source, _ = prompts_lib.shot_origin(t.name, t.source or None)
  return prompts_lib.load_shots(t.name, t.num_shots, source=source,
                                fields=field_overrides(t.fields) if source else None)


def encode_prompts(config, task: Task, examples, tokenizer, log=print) -> list[list[int]]:
  """Prompt ids per example, each in task.max_prompt_tokens ids with its chat template
  and instruction whole (Task.prompt_ids shortens the articles, drops shots, at last cuts
  the example's text); how many were shortened is logged. A budget below the template and
  instruction alone keeps the prompt's last ids, with a warning naming the field."""
  shots = prompt_shots(config)
  prompts_lib.check_shots_disjoint(examples, shots)  # a shot must not be an answer key
  cap = config.task.max_prompt_tokens
  out, shortened, headless = [], 0, []
  for example in examples:
    ids, cut = task.prompt_ids(example, shots, tokenizer, cap, chat=config.model.chat)
    if len(ids) > cap:
      headless.append(len(ids))
      ids = ids[-cap:]
    out.append(ids)
    shortened += cut
  if shortened:
    log(f"{shortened} of {len(examples)} prompts shortened to fit "
        f"task.max_prompt_tokens={cap} (fewer article words, shots or words of the "
        "example's text), each with its template and instruction")
  if headless:
    # Only a budget for smoke tests gets here (the tiny preset's, in byte tokens).
    log(f"WARNING: task.max_prompt_tokens={cap} is below the chat template and "
        f"instruction alone: {len(headless)} of {len(examples)} prompts (up to "
        f"{max(headless)} tokens) keep their last {cap} tokens, without the template's "
        "header or the instruction; raise task.max_prompt_tokens")
  return out


@dataclasses.dataclass
class Models:
  """The loaded pair and what was resolved (info: target, draft, head, finetuned_draft).

  decoders: 'default' (the draft; its head is the shipped one or w = 0.5), 'finetuned'
  (the fine-tuned draft) and, once a head folder is attached, 'diversed' (the default
  draft with that head; a decoder of its own keeps the others' compiled programs valid).
  """
  target: Any
  tokenizer: Any
  decoders: dict[str, SpeculativeDecoder]
  info: dict

  def decoder_for(self, setting) -> SpeculativeDecoder:
    if setting.family == "diversed" and "diversed" in self.decoders:
      return self.decoders["diversed"]
    return self.decoders[setting.draft]

  def attach_head(self, folder: str, task: str | None = None) -> None:
    """Uses the head in `folder` (written by training.train_head) for 'diversed', after
    checking that it was trained for this target and the default draft (build.load_head;
    `task`: the task it should have been trained on, a mismatch only warns)."""
    draft = self.info.get("draft") or self.info.get("finetuned_draft")
    weight_fn, params, _ = build.load_head(folder, self.info["target"], draft, task)
    base = self.decoders["default"]
    self.decoders["diversed"] = SpeculativeDecoder(base.target, base.draft, base.draft_params,
                                                   weight_fn, params,
                                                   shrink_tail=base.shrink_tail,
                                                   matmul_precision=base.matmul_precision,
                                                   mesh=base.mesh)
    self.info["head"] = folder


def resolve_head(config, workdir: str | None) -> str | None:
  """head.path, else the head trained in this workdir, else None (shipped / w = 0.5).
  Several processes take process 0's answer, so that all build the same decoders."""
  head = config.head.path or None
  if not head and workdir:
    trained = os.path.join(workdir, TRAIN_SUBDIR, "head")
    if os.path.isfile(os.path.join(trained, "head.json")):
      head = trained
  if jax.process_count() == 1:
    return head
  head = hosts.broadcast_bytes((head or "").encode()).decode() or None
  if head and not os.path.isdir(os.path.expanduser(head)):
    raise ValueError(f"head folder {head!r} (process 0's) is missing on process "
                     f"{jax.process_index()}: give every host the same workdir (a shared "
                     "mount) or head.path")
  return head


def decode_mesh(config, log=None, families=()):
  """The mesh that splits the rows of the job's decoding calls (decode.mesh_data), or None
  on one device, where nothing changes. Rows: bench.num_prompts in mode 'bench', else
  decode.batch_size; with a queue (decode.queue > batch_size) each device runs its own
  over a block of the call's examples (speculative/split_queue.py), so the queue must
  divide over the mesh too. Raises ValueError naming the field that does not divide, or
  decode.mesh_data when the method `families` to run include 'ssd' (a device each for the
  target and the draft, no mesh), before anything is decoded."""
  d = config.decode
  data = d.get("mesh_data", -1)
  queued = config.mode != "bench" and d.queue > d.batch_size
  if config.mode == "bench":
    rows, field = config.bench.num_prompts, "bench.num_prompts"
  else:
    rows, field = d.batch_size, "decode.batch_size"
  mesh = mesh_lib.data_mesh(data, rows, rows_field=field)
  if mesh is None:
    return None
  if "ssd" in families:
    raise ValueError(f"decode.mesh_data={data}: method 'ssd' places the target and the draft "
                     "on a device each and does not run over a mesh; set "
                     "decode.mesh_data=1 to evaluate it")
  size = mesh.shape[mesh_lib.DATA]
  if queued and d.queue % size:
    raise ValueError(f"decode.queue={d.queue}: each of the {size} devices of the mesh "
                     f"(decode.mesh_data={data}) runs its own queue over a block of the "
                     f"call's examples, so it must be a multiple of {size}; or set "
                     "decode.mesh_data=1 to run on one device")
  if log:
    processes = f"{jax.process_count()} process{'es' if jax.process_count() > 1 else ''}"
    if queued:
      log(f"mesh: a queue of {d.queue} examples per call split over data={size} devices, "
          f"{d.queue // size} through {rows // size} rows on each ({processes})")
    else:
      log(f"mesh: {rows} rows per call split over data={size} devices ({processes})")
  return mesh


def load_models(config, settings, workdir: str | None = None, target=None,
                log=print) -> Models:
  """Loads the target (unless given), the tokenizer and the drafts `settings` use."""
  if target is None:
    log(f"loading target {config.model.target}")
    target = loading.load_model(config.model.target)
  tokenizer = tokenizer_lib.load_tokenizer(config.model.tokenizer or config.model.target)
  families = {s.family for s in settings}
  drafts_needed = {s.draft for s in settings if s.family != "ar"}
  head_task = config.head.task or config.task.name
  head_folder = resolve_head(config, workdir)
  decoders, info = {}, {"target": target.name}
  options = dict(shrink_tail=config.decode.shrink_tail,
                 matmul_precision=config.decode.matmul_precision,
                 mesh=decode_mesh(config, log, families))
  if drafts_needed - {"finetuned"} or not drafts_needed:
    decoder, built = build.build_decoder(
        target, config.model.draft or None, None, head_task,
        need_draft=bool(drafts_needed - {"finetuned"}), **options)
    decoders["default"] = decoder
    info.update(built)
  if "finetuned" in drafts_needed:
    decoder, built = build.build_decoder(target, config.model.finetuned_draft, None,
                                         head_task, need_draft=True, **options)
    decoders["finetuned"] = decoder
    info["finetuned_draft"] = built["draft"]
  if "default" not in decoders:
    decoders["default"] = decoders["finetuned"]
  models = Models(target, tokenizer, decoders, info)
  if head_folder and "diversed" in families:
    models.attach_head(head_folder, head_task)
  log("models: " + ", ".join(f"{k}={v}" for k, v in info.items()))
  return models
