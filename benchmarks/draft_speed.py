"""Issue 4's benchmark of a draft for the embedded target, on held-out TEST prompts.

  python benchmarks/draft_speed.py [--draft=FOLDER|self:4] [--num_prompts=8] [--out=FILE]

Measures, in one run:
  cost       draft step / target decoding step, batch 1, one token, in the decoder's
             layouts with donated caches (diversed_jax.speculative.step_costs: each
             call's median sample), best of --repeats; also r, the verify/decode cost
             ratio at K = --accept_k;
  accept     exact SD at temperature 1: mean beta = sum_x min(p, q) over drafted positions
             (GSM8K-test and CNN/DM-test prompts, zero-shot task prompts), and per
             drafting step (step j > 1 drafts from the draft's own earlier features);
  speed      greedy SD tokens/s vs plain greedy decoding at batch 1 (each prompt alone) and
             batch 8, for each K in --num_draft, end to end, each call's best of --repeats
             interleaved runs, with the outputs checked identical (--shrink_tail: the
             batch-8 calls drop finished rows, as spec_speed.py does; --per_prompt:
             each batch-1 prompt's prefill, rounds, and speed-up end to end and in the
             decoding phase).
  goals      issue 4's bars against this run's figures, met or missed (printed last and
             kept in --out as "goals").

  python benchmarks/draft_speed.py --compare=FOLDER[,FOLDER...] [--num_prompts=24]

compares distilled drafts (--draft and the --compare folders) on the SAME tokens: the
target's own T = 1 continuations of the test prompts, teacher forced, acceptance
sum_x min(p, q) at every generated position for drafting steps 1-3 (steps 2-3 read the
draft's own features, as in training's unroll), and the greedy agreement argmax q = argmax p
(`top1`: what a greedy round accepts). The loop's `accept` samples a different path
for every draft, which moves it by a few hundredths between drafts of equal quality; this
paired figure ranks drafts reliably. A folder with a context-copy gate is measured with it
(the lookup reads the teacher-forced tokens); list 'nocopy:FOLDER' to leave it out.
It also runs each draft in the loop, greedy, each prompt alone, and prints the tokens a
round commits at each K in --num_draft (`metrics.greedy_tokens_per_round`): deterministic,
so free of the timing noise, and what the batch-1 speed-up follows (a round's cost is the
same for drafts of one architecture).
"""

from __future__ import annotations

import functools
import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from diversed_jax.speculative import context_copy, metrics  # noqa: E402
from diversed_jax.speculative.decoder import MATMUL_PRECISIONS  # noqa: E402

_DRAFT = flags.DEFINE_string("draft", None, "draft spec (default: the target's default)")
_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct", "target model")
_NUM = flags.DEFINE_integer("num_prompts", 8, "prompts per task")
_NEW = flags.DEFINE_integer("max_new_tokens", 64, "generated tokens per prompt")
_KS = flags.DEFINE_list("num_draft", ["2", "3", "4"], "drafts per round to try (greedy)")
_ACCEPT_K = flags.DEFINE_integer("accept_k", 3, "drafts per round for the T=1 acceptance")
_MAX_CHARS = flags.DEFINE_integer("max_chars", 1800, "CNN/DM article character budget")
_OUT = flags.DEFINE_string("out", "", "JSON file for the results")
_SKIP_B1 = flags.DEFINE_bool("skip_batch1", False, "skip the batch-1 comparison")
_SKIP_B8 = flags.DEFINE_bool("skip_batch8", False, "skip the batch-8 comparison")
_SPEED = flags.DEFINE_bool("speed", True, "run the greedy speed comparisons")
_ACCEPT = flags.DEFINE_bool("accept", True, "measure the T=1 acceptance")
_REPEATS = flags.DEFINE_integer("repeats", 3, "interleaved timing repeats (best kept)")
_PRECISION = flags.DEFINE_enum("matmul_precision", "highest", MATMUL_PRECISIONS,
                               "float32 product precision off the CPU "
                               "(SpeculativeDecoder's matmul_precision)")
_SHRINK_TAIL = flags.DEFINE_bool(
    "shrink_tail", False, "batch 8: once rows finish, continue with the unfinished ones only "
    "(SpeculativeDecoder's shrink_tail, as spec_speed.py; more compile time, not timed)")
_PER_PROMPT = flags.DEFINE_bool(
    "per_prompt", False, "batch 1: also split each prompt's time into its prefill and "
    "decoding phase (one more timed call per prompt: a one-token plain call)")
_COMPARE = flags.DEFINE_list("compare", [], "distilled draft folders to compare with --draft "
                             "on the same teacher-forced tokens (then exit)")


def _prompts(tokenizer, task: str, n: int) -> list[list[int]]:
  from diversed_jax import tokenizer as tokenizer_lib
  from diversed_jax.tasks import datasets, prompts
  examples = datasets.load_examples(task, split="test", limit=n)
  kwargs = {"max_source_chars": _MAX_CHARS.value} if task == "cnndm" else {}
  return [tokenizer_lib.encode_prompt(tokenizer, prompts.build_prompt(e, **kwargs), chat=True)
          for e in examples]


def step_cost(dec, k: int, repeats: int, cache_len: int = 512) -> dict:
  """Draft step / target decoding step at batch 1 in the decoder's layouts, caches donated
  (`step_costs.measure`, each call's median sample), the best of `repeats` measurements;
  also the verify/decode ratio r at K = k."""
  from diversed_jax.speculative import step_costs
  costs = step_costs.StepCosts.best(
      [step_costs.measure(dec, 1, k, cache_len, greedy=True) for _ in range(repeats)])
  return {"target_ms": 1e3 * costs.decode_s, "draft_ms": 1e3 * costs.draft_s,
          "verify_ms": 1e3 * costs.verify_s, "cost": costs.c, "r": costs.r, "k": k}


def acceptance(dec, prompt_lists, k: int):
  from diversed_jax.speculative.types import VerifyParams
  betas, accepted = [], []
  for i, prompts in enumerate(prompt_lists):
    gen = dec.generate(prompts, VerifyParams(method="sd", temperature=1.0), num_draft=k,
                       max_new_tokens=_NEW.value, seed=i)
    s = gen.stats
    betas.append(s.beta_rbk[s.active_rb])
    accepted.append(s.num_accepted_rb[s.active_rb])
  betas = np.concatenate(betas)  # [rounds, K]
  accepted = np.concatenate(accepted)
  return {"accept": float(betas.mean()),
          "accept_by_position": [round(float(b), 4) for b in betas.mean(axis=0)],
          "accepted_per_round": float(accepted.mean()),
          "tokens_per_round": float(accepted.mean() + 1)}


def paired_acceptance(target, drafts: dict, prompts, steps: int = 3, seed: int = 0) -> dict:
  """Mean sum_x min(p, q) per drafting step for each of `drafts` ({name: (draft, params)},
  distilled drafts) over the target's T = 1 continuations of `prompts`, teacher forced."""
  import jax
  import jax.numpy as jnp

  from diversed_jax.distill import architectures
  from diversed_jax.models import transformer
  from diversed_jax.speculative.decoder import ModelHandle, SpeculativeDecoder
  from diversed_jax.speculative.types import VerifyParams
  dec = SpeculativeDecoder(ModelHandle(target.config, target.params))
  gen = dec.generate(prompts, VerifyParams(method="ar", temperature=1.0), num_draft=0,
                     max_new_tokens=_NEW.value, seed=seed)
  hidden_fn = jax.jit(lambda t: transformer.forward_hidden(target.params, target.config, t)[0])
  probs_fn = jax.jit(lambda h: jax.nn.softmax(
      transformer.logits_from_hidden(target.params, target.config, h), axis=-1))
  forwards = {name: jax.jit(functools.partial(getattr(d, "inner", d).train_forward,
                                                unroll=steps))
              for name, (d, _) in drafts.items()}
  sums = {name: np.zeros(steps) for name in drafts}
  agree = {name: np.zeros(steps) for name in drafts}
  positions = 0
  for prompt, cont in zip(prompts, gen.token_ids):
    seq = list(prompt) + list(cont)
    tokens = np.zeros((1, -(-len(seq) // 64) * 64), np.int32)  # few distinct shapes
    tokens[0, :len(seq)] = seq
    hidden = hidden_fn(jnp.asarray(tokens))
    # Position t predicts token t + 1: the generated tokens are predicted from
    # len(prompt) - 1 to len(seq) - 2.
    span = slice(len(prompt) - 1, len(seq) - 1)
    p = probs_fn(hidden[:, span])[0]
    features = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))  # f_{t-1} at t
    for name, (draft, params) in drafts.items():
      logits, hidden_j = forwards[name](params, jnp.asarray(tokens), features)  # kept vocab
      ids = params["frozen"]["vocab_ids"]
      if isinstance(draft, context_copy.ContextCopyDraft):  # the blend needs every id
        logits = architectures.to_full_vocab(logits[:, :, span], ids, p.shape[-1])
        at_bt = jnp.arange(span.start, span.stop)[None]
        q = jax.nn.softmax(jnp.stack([context_copy.copy_logits(
            draft.gate, logits[j], hidden_j[j, :, span], jnp.asarray(tokens), at_bt,
            proposing=j > 0) for j in range(logits.shape[0])]), axis=-1)
        sums[name] += np.asarray(jnp.sum(jnp.minimum(p[None], q[:, 0]), axis=(-1, -2)))
        agree[name] += np.asarray(jnp.sum(
            jnp.argmax(q[:, 0], -1) == jnp.argmax(p, -1)[None], axis=-1))
        continue
      q = jax.nn.softmax(logits[:, 0, span], axis=-1)
      sums[name] += np.asarray(jnp.sum(jnp.minimum(p[:, ids][None], q), axis=(-1, -2)))
      agree[name] += np.asarray(jnp.sum(
          ids[jnp.argmax(q, -1)] == jnp.argmax(p, -1)[None], axis=-1))
    positions += len(cont)
  return {name: {"accept": float(s.mean() / positions),
                 "accept_by_step": [round(float(v / positions), 4) for v in s],
                 "top1_by_step": [round(float(v / positions), 4) for v in agree[name]],
                 "positions": positions} for name, s in sums.items()}


def greedy_speed(dec, prompts, batch: int, ks, repeats: int,
                 per_call: list | None = None) -> list[dict]:
  """Plain greedy vs greedy SD with each K in `ks` over `prompts` in batches: tokens/s end
  to end, each call's best of `repeats` interleaved runs (the host's speed drifts), and
  whether SD's output is identical to plain decoding's.

  `per_call`, a list, receives one row per call (batch of prompts) that splits its time:
  the prefill (timed as a call generating one token), each method's rounds, and its
  speed-up end to end and in the decoding phase after the prefill (an SD call's prefill
  also runs the draft over the prompt, which this split counts as SD's decoding)."""
  from diversed_jax.speculative.types import VerifyParams
  groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
  runs = [("ar", 0)] + [("sd", k) for k in ks]
  if per_call is not None:
    runs.append(("prefill", 0))  # a plain call generating one token

  def call(group, method, k):
    prefill = method == "prefill"
    return dec.generate(group, VerifyParams(method="ar" if prefill else method,
                                            temperature=0.0),
                        num_draft=k, max_new_tokens=1 if prefill else _NEW.value)

  for method, k in runs:  # compile
    call(groups[0], method, k)
  best = {run: np.full(len(groups), np.inf) for run in runs}
  rows, tokens, rounds = {}, {}, {}
  for _ in range(repeats):
    for method, k in runs:
      outs = [call(g, method, k) for g in groups]
      best[method, k] = np.minimum(best[method, k], [o.seconds for o in outs])
      rows[method, k] = [r for o in outs for r in o.token_ids]
      tokens[method, k] = sum(o.num_tokens for o in outs)
      rounds[method, k] = [o.rounds for o in outs]
  if per_call is not None:
    prefill = best["prefill", 0]
    decoding_ar = best["ar", 0] - prefill
    for i, group in enumerate(groups):
      row = {"batch": batch, "prompt_tokens": [len(p) for p in group],
             "prefill_s": float(prefill[i]), "ar_s": float(best["ar", 0][i])}
      for k in ks:
        row[f"k{k}"] = {"rounds": rounds["sd", k][i],
                        "end_to_end": float(best["ar", 0][i] / best["sd", k][i]),
                        "decoding": float(decoding_ar[i] / (best["sd", k][i] - prefill[i]))}
      per_call.append(row)
  rate = {run: tokens[run] / best[run].sum() for run in runs}
  return [{"batch": batch, "k": k, "ar_tokens_per_s": rate["ar", 0],
           "sd_tokens_per_s": rate["sd", k], "speedup": rate["sd", k] / rate["ar", 0],
           "identical": rows["sd", k] == rows["ar", 0]} for k in ks]


# Issue 4's bars: draft cost, T = 1 acceptance per task, greedy speed-up per batch size.
MAX_COST = 0.12
MIN_ACCEPT = {"gsm8k": 0.55, "cnndm": 0.40}
# batch: (bar, strict); batch 8 must beat plain decoding, batch 1 reach 1.4x.
MIN_SPEEDUP = {1: (1.4, False), 8: (1.0, True)}


def goals(results: dict) -> list[str]:
  """One line per issue-4 goal that `results` measured: the figure, the bar, met or not.
  A speed-up counts only with outputs identical to plain decoding's."""
  lines = []
  if "cost" in results:
    cost = results["cost"]["cost"]
    lines.append(f"cost {cost:.3f} <= {MAX_COST}: {'met' if cost <= MAX_COST else 'missed'}")
  for task, bar in MIN_ACCEPT.items():
    if task in results:
      accept = results[task]["accept"]
      lines.append(f"{task} acceptance {accept:.3f} >= {bar}: "
                   f"{'met' if accept >= bar else 'missed'} (this run's sampled path; "
                   "--compare gives the paired figure)")
  for batch, (bar, strict) in MIN_SPEEDUP.items():
    rows = [r for r in results.get(f"greedy_batch{batch}", []) if r["identical"]]
    if not rows:
      continue
    best = max(rows, key=lambda r: r["speedup"])
    met = best["speedup"] > bar if strict else best["speedup"] >= bar
    lines.append(f"batch {batch} speed-up {best['speedup']:.3f} (K = {best['k']}) "
                 f"{'>' if strict else '>='} {bar}: {'met' if met else 'missed'}")
  return lines


def check_flags():
  """Usage errors for values that would fail, or silently shrink a comparison, only after
  the models load: batch 1 decodes num_prompts/2 prompts of each task, batch 8 eight
  GSM8K ones."""
  n = _NUM.value
  if n < 2 or n % 2:
    raise app.UsageError(f"--num_prompts must be even and >= 2 (batch 1 takes half of each "
                         f"task's), got {n}")
  if _SPEED.value and not _SKIP_B8.value and n < 8:
    raise app.UsageError(f"--num_prompts must be >= 8 for the batch-8 comparison (or "
                         f"--skip_batch8), got {n}")
  for flag, low in ((_NEW, 1), (_REPEATS, 1), (_ACCEPT_K, 1)):
    if flag.value < low:
      raise app.UsageError(f"--{flag.name} must be >= {low}, got {flag.value}")
  if any(int(k) < 1 for k in _KS.value):
    raise app.UsageError(f"--num_draft values must be >= 1, got {','.join(_KS.value)}")


def main(argv):
  del argv
  check_flags()
  from bench_setup import host_info  # benchmarks/, beside this script
  from diversed_jax.models.loading import load_model
  from diversed_jax.speculative import build
  from diversed_jax.speculative.decoder import ModelHandle, SpeculativeDecoder
  from diversed_jax.tokenizer import load_tokenizer
  target = load_model(_TARGET.value)
  draft, draft_params, spec = build.load_draft(_DRAFT.value, target)
  tokenizer = load_tokenizer(_TARGET.value)
  dec = SpeculativeDecoder(ModelHandle(target.config, target.params), draft, draft_params,
                           matmul_precision=_PRECISION.value, shrink_tail=_SHRINK_TAIL.value)
  n = _NUM.value
  gsm = _prompts(tokenizer, "gsm8k", n)
  cnn = _prompts(tokenizer, "cnndm", n)
  if _COMPARE.value:
    drafts = {spec: (draft, draft_params)}
    same = os.path.realpath(spec)  # a folder listed twice (as --draft too) is measured once
    drafts.update({folder: build.load_draft(folder, target)[:2] for folder in _COMPARE.value
                   if os.path.realpath(folder) != same})
    for name, (draft_obj, _) in drafts.items():
      if not hasattr(getattr(draft_obj, "inner", draft_obj), "train_forward"):
        raise app.UsageError(f"--compare needs distilled draft folders; {name} is not one")
    ks = list(map(int, _KS.value))
    # One decoder per draft over the run's target handle (one decoding layout), kept for
    # both tasks.
    decoders = {name: SpeculativeDecoder(dec.target, d, p, matmul_precision=_PRECISION.value)
                for name, (d, p) in drafts.items()}
    for task, prompts in (("gsm8k", gsm), ("cnndm", cnn)):
      for name, row in paired_acceptance(target, drafts, prompts).items():
        rounds = {k: round(metrics.greedy_tokens_per_round(decoders[name], prompts, k,
                                                            _NEW.value), 4) for k in ks}
        print(json.dumps({"task": task, "draft": name, **row,
                          "greedy_tokens_per_round": rounds}), flush=True)
    return
  results = {"draft": spec, "target": target.name, "num_prompts": n,
             "max_new_tokens": _NEW.value, "host": host_info(),
             "matmul_precision": _PRECISION.value, "shrink_tail": _SHRINK_TAIL.value}
  results["cost"] = step_cost(dec, _ACCEPT_K.value, _REPEATS.value)
  print(json.dumps(results), flush=True)
  if _ACCEPT.value:
    results["gsm8k"] = acceptance(dec, [gsm], _ACCEPT_K.value)
    results["cnndm"] = acceptance(dec, [cnn], _ACCEPT_K.value)
  print(json.dumps(results), flush=True)
  mixed = [p for pair in zip(gsm[:n // 2], cnn[:n // 2]) for p in pair]
  ks = list(map(int, _KS.value))
  # Each comparison's rows are printed as they finish: a long run keeps what it measured.
  if _SPEED.value and not _SKIP_B1.value:
    per_prompt = [] if _PER_PROMPT.value else None
    results["greedy_batch1"] = greedy_speed(dec, mixed, 1, ks, _REPEATS.value, per_prompt)
    for row in results["greedy_batch1"]:
      print(json.dumps(row), flush=True)
    if per_prompt is not None:
      results["greedy_batch1_per_prompt"] = per_prompt
      for row in per_prompt:
        print(json.dumps(row), flush=True)
  if _SPEED.value and not _SKIP_B8.value:
    results["greedy_batch8"] = greedy_speed(dec, gsm[:8], 8, ks, _REPEATS.value)
    for row in results["greedy_batch8"]:
      print(json.dumps(row), flush=True)
  results["goals"] = goals(results)
  print(json.dumps(results, indent=1), flush=True)
  print("issue 4 goals:\n  " + "\n  ".join(results["goals"]), flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
