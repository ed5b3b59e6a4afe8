"""Distillation data: target distributions over continuations of train-split prompts.

A shard is one batch of prompts from one source. The continuation is either the target's
own (the speculative loop with method 'ar', greedy or sampled: DistillSpec's on-policy-ish
data) or the dataset's reference answer (teacher forcing only, EAGLE-style fixed data, ~20x
cheaper on a CPU). One teacher-forced target pass over prompt + continuation records, at
every position t,
  hidden_nld   the target's last hidden state f_t (post final norm; float16),
  topk_ids_nlk / topk_logp_nlk  its top-k next-token ids (uint16) and log-probs (float16).
Shards are `shard_NNNNN.npz` files in the data folder, written atomically; generation
resumes by skipping the shards already there. The target's generated ids can also be kept
in a small committed folder (`continuations.py`) from which lost shards are rebuilt.

Shape legend: N sequences in a shard, L padded length, D target width, K top-k.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import random
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax import atomic_files
from diversed_jax.distill import continuations
from diversed_jax.models import transformer
from diversed_jax.models.kv_cache import bucket_length

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")

# How a record of each source becomes a user turn: the formats of
# diversed_jax.tasks.prompts (zero-shot), so the draft learns the target's behaviour on the
# prompts it will serve. CNN/DM articles are cut to a character budget.
TEMPLATES = {
    "gsm8k": ("Solve the following math problem. Let's think step by step, then end your "
              "answer with \"The answer is N\", where N is the final number.\n\n"
              "Question: {question}\nAnswer:", "question"),
    "cnndm": ("Summarize the following news article in three sentences.\n\n"
              "Article: {article}\nSummary:", "article"),
}


def resolve_path(path: str) -> str:
  """A path as given, or relative to the package's data folder."""
  if os.path.exists(path):
    return path
  return os.path.join(DATA_DIR, path)


def _reference(source: str, record: dict) -> str:
  """The reference continuation in the answer format the prompt asks for."""
  if source == "gsm8k":
    solution = re.sub(r"<<[^>]*>>", "", record.get("answer", ""))
    body, _, final = solution.rpartition("####")
    return f"{body.strip()}\nThe answer is {final.strip()}." if body else solution
  lines = [ln.strip().rstrip(" .") + "." for ln in record.get("highlights", "").splitlines()
           if ln.strip()]
  return " ".join(lines)


# A sentence's end and the spaces after it, before a capital, quote or bracket; or a line
# break. The window starts where the match ends.
_SENTENCE_START = re.compile(r"[.!?][\"')]? +(?=[A-Z\"'(])|\n+")


def text_window(body: str, window: int, max_chars: int) -> str | None:
  """Window `window` of a text cut to `max_chars` characters: window 0 is its start (as
  every evaluation prompt is), window w >= 1 starts at the first sentence beginning at or
  after character w * max_chars. " ..." marks a cut end. None when window w >= 1 would
  hold less than half the budget (the text is too short for it)."""
  start = 0
  if window > 0:
    found = _SENTENCE_START.search(body, window * max_chars)
    if found is None:
      return None
    start = found.end()
    if len(body) - start < max_chars // 2:
      return None
  text = body[start:]
  return text[:max_chars].rstrip() + " ..." if len(text) > max_chars else text


def load_prompts(source: str, paths, limit: int = 0, max_chars: int = 2500,
                 windows: tuple[int, ...] = (0,)):
  """(user-turn text, reference continuation) pairs of one source ('gsm8k' or 'cnndm') from
  JSONL files (one path or a sequence of paths, read in order). `windows`: which
  `max_chars` windows of each record's text become prompts (`text_window`; windows past
  0 are new prompts from long articles, whose reference no longer fits them)."""
  template, field = TEMPLATES[source]
  pairs = []
  for path in ([paths] if isinstance(paths, str) else paths):
    with open(resolve_path(path)) as f:
      for line in f:
        record = json.loads(line)
        for window in windows:
          body = text_window(record[field], window, max_chars)
          if body is None:
            continue
          pairs.append((template.format(**{field: body}), _reference(source, record)))
          if limit and len(pairs) >= limit:
            return pairs
  return pairs


def shard_plan(sources: dict, pattern: tuple[str, ...], batch: int, seed: int):
  """Per shard i: (source, prompt texts). Prompts are shuffled once per source with `seed`;
  shards cycle through `pattern` (e.g. ('gsm8k', 'cnndm', 'gsm8k')), skipping a source once
  it has fewer than `batch` prompts left, until all have: past that point shard i's source
  is no longer pattern[i % len(pattern)], so read it from the plan."""
  pools = {}
  for name, texts in sources.items():
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    pools[name] = [texts[i] for i in order]
  used = {name: 0 for name in pools}
  plan = []
  while True:
    progressed = False
    for name in pattern:
      start = used[name]
      if start + batch <= len(pools[name]):
        plan.append((name, pools[name][start:start + batch]))
        used[name] += batch
        progressed = True
    if not progressed:
      return plan


@functools.partial(jax.jit, static_argnames=("config", "top_k", "chunk"))
def teacher_forced(params, config, tokens_bl, *, top_k: int, chunk: int = 128):
  """Target hidden states [B, L, D] and top-k (ids, log-probs) [B, L, K] at every position."""
  b, l = tokens_bl.shape
  hidden, _ = transformer.forward_hidden(params, config, tokens_bl)

  def one_chunk(h_bcd):
    logp = jax.nn.log_softmax(transformer.logits_from_hidden(params, config, h_bcd), axis=-1)
    vals, ids = jax.lax.top_k(logp, top_k)
    return ids, vals

  chunks = hidden.reshape(b, l // chunk, chunk, -1).swapaxes(0, 1)
  ids, vals = jax.lax.map(one_chunk, chunks)
  ids = ids.swapaxes(0, 1).reshape(b, l, top_k)
  vals = vals.swapaxes(0, 1).reshape(b, l, top_k)
  return hidden, ids, vals


def reference_continuations(tokenizer, pairs, eos_token_ids, max_new_tokens: int):
  """The dataset's answers in the requested format, cut to `max_new_tokens`, then the
  first EOS id (if any)."""
  eos = list(eos_token_ids[:1])
  return [list(tokenizer(ref, add_special_tokens=False)["input_ids"])[:max_new_tokens] + eos
          for _, ref in pairs]


def target_continuations(decoder, prompts, *, temperature: float, max_new_tokens: int,
                         seed: int, eos_token_ids=None) -> list[list[int]]:
  """The target's own continuations of token-id prompts (the loop's method 'ar')."""
  from diversed_jax.speculative.types import VerifyParams
  gen = decoder.generate(prompts, VerifyParams(method="ar", temperature=temperature),
                         max_new_tokens=max_new_tokens, seed=seed,
                         eos_token_ids=eos_token_ids)
  return gen.token_ids


def shard_from_prompts(decoder, prompts, *, temperature: float, max_new_tokens: int,
                       top_k: int, seed: int, eos_token_ids=None) -> dict:
  """One shard's arrays for prompts given as token-id lists (generation, then teacher
  forcing)."""
  conts = target_continuations(decoder, prompts, temperature=temperature,
                               max_new_tokens=max_new_tokens, seed=seed,
                               eos_token_ids=eos_token_ids)
  return shard_from_sequences(decoder.target, prompts, conts, top_k=top_k,
                              temperature=temperature)


def shard_from_sequences(target, prompts, continuations, *, top_k: int,
                         temperature: float) -> dict:
  """Teacher-forced target pass over prompt + continuation token lists."""
  seqs = [p + c for p, c in zip(prompts, continuations)]
  width = bucket_length(max(len(s) for s in seqs), (128, 256, 384, 512, 640, 768, 1024))
  tokens = np.zeros((len(seqs), width), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  config = target.config
  hidden, ids, logp = teacher_forced(target.params, config, jnp.asarray(tokens), top_k=top_k)
  return {
      "tokens": tokens,
      "lengths": np.asarray([len(s) for s in seqs], np.int32),
      "prompt_lengths": np.asarray([len(p) for p in prompts], np.int32),
      "hidden": np.asarray(hidden, np.float16),
      "topk_ids": np.asarray(ids).astype(np.uint16 if config.vocab_size <= 65536 else np.int32),
      "topk_logp": np.asarray(logp, np.float16),
      "temperature": np.float32(temperature),  # -1: reference continuation
  }


def shard_path(folder: str, index: int) -> str:
  return os.path.join(folder, f"shard_{index:05d}.npz")


def save_shard(folder: str, index: int, arrays: dict) -> None:
  os.makedirs(folder, exist_ok=True)
  atomic_files.save_npz(shard_path(folder, index), arrays)


def list_shards(folder: str) -> list[str]:
  return sorted(glob.glob(os.path.join(folder, "shard_[0-9][0-9][0-9][0-9][0-9].npz")))


def continuations_folder(spec: str) -> str:
  """data.continuations_dir: absolute, or relative to the package's data folder (the ids
  are small and meant to be committed with it)."""
  return spec if os.path.isabs(spec) else os.path.join(DATA_DIR, spec)


def data_plan(data_cfg):
  """The shard plan of a data config: per shard, (source, [(prompt text, reference)])."""
  sources = {"gsm8k": load_prompts("gsm8k", data_cfg.gsm8k_path, max_chars=10_000),
             "cnndm": load_prompts("cnndm", data_cfg.cnndm_path, max_chars=data_cfg.max_chars,
                                   windows=tuple(data_cfg.cnndm_windows))}
  return shard_plan(sources, tuple(data_cfg.pattern), data_cfg.batch, data_cfg.seed)


def shard_temperature(data_cfg, index: int) -> float:
  """Generation temperature of shard `index`: data.temperatures alternate per pattern cycle."""
  temps = tuple(data_cfg.temperatures)
  return temps[(index // len(data_cfg.pattern)) % len(temps)]


def kept_records(data_cfg, tokenizer, indices):
  """Per shard index with kept ids (data.continuations_dir): (source, temperature, prompt
  token lists, continuation token lists), read back without generating anything."""
  from diversed_jax.tokenizer import encode_prompt
  plan = data_plan(data_cfg)
  folder = continuations_folder(data_cfg.continuations_dir)
  records = []
  for index in indices:
    if index >= len(plan):
      raise ValueError(f"shard {index} is past the data plan's {len(plan)} shards")
    source, pairs = plan[index]
    temperature = shard_temperature(data_cfg, index)
    prompts = [encode_prompt(tokenizer, t, chat=True) for t, _ in pairs]
    records.append((source, temperature, prompts,
                    continuations.load(folder, index, prompts, temperature)))
  return records


def generate(data_cfg, target, out_dir: str, log=print, tokenizer=None) -> int:
  """Writes missing shards up to data_cfg.num_shards; returns the shard count on disk.

  With `data_cfg.continuations_dir` (continuation='target'), each shard's generated ids are
  kept there (`continuations.py`): a missing shard whose ids exist is rebuilt by teacher
  forcing alone, and existing shards get their ids written. With
  `data_cfg.continuations_only`, only the ids are written (about half the cost of a shard;
  a later run builds the shards from them).
  """
  from diversed_jax.speculative.decoder import ModelHandle, SpeculativeDecoder
  from diversed_jax.tokenizer import encode_prompt, load_tokenizer
  plan = data_plan(data_cfg)
  tokenizer = tokenizer or load_tokenizer(data_cfg.tokenizer or target.name)
  decoder = SpeculativeDecoder(ModelHandle(target.config, target.params))
  keep = continuations_folder(data_cfg.continuations_dir) if data_cfg.continuations_dir else ""
  ids_only = bool(data_cfg.continuations_only)
  eos = target.config.eos_token_ids
  for index, (source, pairs) in enumerate(plan[:data_cfg.num_shards]):
    have_shard = os.path.exists(shard_path(out_dir, index))
    have_ids = bool(keep) and os.path.exists(continuations.path(keep, index))
    if (have_shard or ids_only) and (have_ids or not keep):
      continue
    start = time.time()
    temperature = shard_temperature(data_cfg, index)
    if have_shard:  # ids of a shard written before they were kept: read them back
      with np.load(shard_path(out_dir, index)) as arrays:
        prompts, conts = continuations.from_shard(arrays)
      continuations.save(keep, index, prompts, conts, temperature)
      log(f"shard {index}: ids kept in {keep}")
      continue
    prompts = [encode_prompt(tokenizer, t, chat=True) for t, _ in pairs]
    max_new = data_cfg.max_new_tokens_cnndm if source == "cnndm" else data_cfg.max_new_tokens
    if data_cfg.continuation == "reference":
      conts = reference_continuations(tokenizer, pairs, eos, max_new)
      temperature, how = -1.0, "reference"
    elif have_ids:
      conts = continuations.load(keep, index, prompts, temperature)
      how = "kept ids"
    else:
      conts = target_continuations(decoder, prompts, temperature=temperature,
                                   max_new_tokens=max_new,
                                   seed=data_cfg.seed * 100_003 + index)
      how = "generated"
      if keep:
        continuations.save(keep, index, prompts, conts, temperature)
    new_tokens = sum(len(c) for c in conts)
    if not ids_only:
      arrays = shard_from_sequences(target, prompts, conts, top_k=data_cfg.top_k,
                                    temperature=temperature)
      save_shard(out_dir, index, arrays)
    log(f"shard {index} {source} {how} T={temperature} continuation tokens={new_tokens}"
        f"{' (ids only)' if ids_only else ''} in {time.time() - start:.1f}s")
  if keep:
    log(f"{continuations.count(keep)} continuation files in {keep}")
  return len(list_shards(out_dir))
