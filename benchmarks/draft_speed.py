"""Issue 4's benchmark of a draft for the embedded target, on held-out TEST prompts.

  python benchmarks/draft_speed.py [--draft=FOLDER|self:4] [--num_prompts=8] [--out=FILE]

Measures, in one run:
  cost       draft step / target step, batch 1, one token, same cache length (medians of
             interleaved timings);
  accept     exact SD at temperature 1: mean beta = sum_x min(p, q) over drafted positions
             (GSM8K-test and CNN/DM-test prompts, zero-shot task prompts);
  speed      greedy SD tokens/s vs plain greedy decoding at batch 1 (each prompt alone) and
             batch 8, with the outputs checked identical.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

_DRAFT = flags.DEFINE_string("draft", None, "draft spec (default: the target's default)")
_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "target model")
_NUM = flags.DEFINE_integer("num_prompts", 8, "prompts per task")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "generated tokens per prompt")
_KS = flags.DEFINE_list("num_draft", ["2", "3", "4"], "drafts per round to try (greedy)")
_ACCEPT_K = flags.DEFINE_integer("accept_k", 3, "drafts per round for the T=1 acceptance")
_MAX_CHARS = flags.DEFINE_integer("max_chars", 1800, "CNN/DM article character budget")
_OUT = flags.DEFINE_string("out", "", "JSON file for the results")
_SKIP_B8 = flags.DEFINE_bool("skip_batch8", False, "skip the batch-8 comparison")
_SPEED = flags.DEFINE_bool("speed", True, "run the greedy speed comparisons")
_ACCEPT = flags.DEFINE_bool("accept", True, "measure the T=1 acceptance")


def _prompts(tokenizer, task: str, n: int) -> list[list[int]]:
  from diversed_jax.tasks import datasets, prompts
  examples = datasets.load_examples(task, split="test", limit=n)
  kwargs = {"max_source_chars": _MAX_CHARS.value} if task == "cnndm" else {}
  return [prompts.encode_prompt(prompts.build_prompt(e, **kwargs), tokenizer, chat=True)
          for e in examples]


def _time(fn, repeats=30):
  fn()
  out = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - start)
  return out


def step_cost(target, draft, draft_params, cache_len=512, rounds=5):
  """(draft ms, target ms, ratio): medians over interleaved rounds of 30 single steps."""
  from diversed_jax.models import transformer
  from diversed_jax.models.kv_cache import KVCache
  tok = jnp.asarray([[17]], jnp.int32)
  t_cache = KVCache.create(target.config, 1, cache_len).with_lengths(jnp.asarray([300]))
  d_cache = draft.init_cache(1, cache_len, jnp.float32).with_lengths(jnp.asarray([300]))
  feat = jnp.zeros((1, 1, target.config.hidden_size))
  t_step = jax.jit(lambda p, c: transformer.forward(p, target.config, tok, c)[0])
  d_step = jax.jit(lambda p, c: draft.forward(p, tok, c, None)[0])
  d_first = jax.jit(lambda p, c: draft.forward(p, jnp.concatenate([tok, tok], 1), c,
                                               jnp.concatenate([feat, feat], 1))[0])
  t_ms, d_ms, d2_ms = [], [], []
  for _ in range(rounds):
    t_ms += _time(lambda: t_step(target.params, t_cache))
    d_ms += _time(lambda: d_step(draft_params, d_cache))
    d2_ms += _time(lambda: d_first(draft_params, d_cache))
  t, d, d2 = (1e3 * float(np.median(x)) for x in (t_ms, d_ms, d2_ms))
  return {"target_ms": t, "draft_ms": d, "draft_first_ms": d2, "cost": d / t}


def acceptance(dec, prompt_lists, k: int):
  from diversed_jax.speculative.types import VerifyParams
  betas, accepted = [], []
  for i, prompts in enumerate(prompt_lists):
    gen = dec.generate(prompts, VerifyParams(method="sd", temperature=1.0), num_draft=k,
                       max_new_tokens=_NEW.value, seed=i)
    s = gen.stats
    betas.append(s.beta_rbk[s.active_rb])
    accepted.append(s.num_accepted_rb[s.active_rb])
  betas = np.concatenate(betas)
  accepted = np.concatenate(accepted)
  return {"accept": float(betas.mean()), "accepted_per_round": float(accepted.mean()),
          "tokens_per_round": float(accepted.mean() + 1)}


def greedy_speed(dec, prompts, batch: int, k: int, ar_cache: dict):
  """tokens/s of plain greedy and greedy SD over `prompts` in batches; identical check."""
  from diversed_jax.speculative.types import VerifyParams
  groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]

  def run(method, num_draft):
    vp = VerifyParams(method=method, temperature=0.0)
    dec.generate(groups[0], vp, num_draft=num_draft, max_new_tokens=_NEW.value)  # compile
    tokens, seconds, rows = 0, 0.0, []
    for g in groups:
      out = dec.generate(g, vp, num_draft=num_draft, max_new_tokens=_NEW.value)
      tokens += out.num_tokens
      seconds += out.seconds
      rows += out.token_ids
    return tokens / seconds, rows

  key = (batch, tuple(map(tuple, prompts)))
  if key not in ar_cache:
    ar_cache[key] = run("ar", 0)
  ar_rate, ar_rows = ar_cache[key]
  sd_rate, sd_rows = run("sd", k)
  return {"batch": batch, "k": k, "ar_tokens_per_s": ar_rate, "sd_tokens_per_s": sd_rate,
          "speedup": sd_rate / ar_rate, "identical": sd_rows == ar_rows}


def main(argv):
  del argv
  from diversed_jax.models.loading import load_model
  from diversed_jax.speculative import build
  from diversed_jax.speculative.decoder import ModelHandle, SpeculativeDecoder
  from diversed_jax.tokenizer import load_tokenizer
  target = load_model(_TARGET.value)
  draft, draft_params, spec = build.load_draft(_DRAFT.value, target)
  tokenizer = load_tokenizer(_TARGET.value)
  dec = SpeculativeDecoder(ModelHandle(target.config, target.params), draft, draft_params)
  n = _NUM.value
  gsm = _prompts(tokenizer, "gsm8k", n)
  cnn = _prompts(tokenizer, "cnndm", n)
  results = {"draft": spec, "target": target.name, "num_prompts": n,
             "max_new_tokens": _NEW.value}
  results["cost"] = step_cost(target, draft, draft_params)
  print(json.dumps(results), flush=True)
  if _ACCEPT.value:
    results["gsm8k"] = acceptance(dec, [gsm], _ACCEPT_K.value)
    results["cnndm"] = acceptance(dec, [cnn], _ACCEPT_K.value)
  print(json.dumps(results), flush=True)
  ar_cache: dict = {}
  results["greedy_batch1"] = []
  mixed = [p for pair in zip(gsm[:n // 2], cnn[:n // 2]) for p in pair]
  for k in (list(map(int, _KS.value)) if _SPEED.value else []):
    results["greedy_batch1"].append(greedy_speed(dec, mixed, 1, k, ar_cache))
    print(json.dumps(results["greedy_batch1"][-1]), flush=True)
  if _SPEED.value and not _SKIP_B8.value:
    best_k = max(results["greedy_batch1"], key=lambda r: r["speedup"])["k"]
    results["greedy_batch8"] = greedy_speed(dec, gsm[:8], 8, best_k, ar_cache)
  print(json.dumps(results, indent=1), flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
