"""The speculative loop end to end on tiny random models, plus the real SmolLM2 (slow)."""

import gc
import math
import os
import re
import weakref
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax.models import ModelConfig, cpu_kernels, init_params, loading, transformer
from diversed_jax.speculative import decoder as decoder_lib
from diversed_jax.speculative import build, drafts, loop, programs
from diversed_jax.speculative.types import VerifyParams
from tests import padded_forward

VOCAB = 11


def _tiny(seed, layers=2, std=0.5):
  config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=layers,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48)
  # A large init std gives peaked, distinct distributions, so rules differ visibly.
  return config, init_params(config, jax.random.PRNGKey(seed), std=std)


@pytest.fixture(scope="module")
def pair():
  target_config, target_params = _tiny(0)
  draft_config, draft_params = _tiny(1, layers=1)
  target = decoder_lib.ModelHandle(target_config, target_params)
  return target, drafts.LMDraft(draft_config), draft_params


@pytest.fixture(scope="module")
def two_layer_pair(pair):
  """`pair` with a two-layer draft: with a one-layer, one-row stacked cache XLA:CPU copies
  the draft's cache every round (a degenerate layout that no shipped draft has)."""
  draft_config, draft_params = _tiny(1, layers=2)
  return pair[0], drafts.LMDraft(draft_config), draft_params


def _fixed_weight_fn(w):
  def weight_fn(head_params, h_q, h_p):
    del head_params, h_p
    return jnp.full(h_q.shape[:-1], w, jnp.float32)
  return weight_fn


def _greedy_reference(target, prompt, steps):
  return padded_forward.greedy_continuations(target.params, target.config, [prompt], steps)[0]


PROMPTS = [[1, 2, 3, 4, 5], [7, 3], [2, 9, 9, 1, 4, 4, 8, 10, 3], [5, 6, 7]]


@pytest.mark.parametrize("num_draft,method", [(1, "sd"), (3, "sd"), (4, "static"),
                                              (3, "lossy"), (2, "diversed")])
def test_greedy_speculative_equals_greedy_autoregressive(pair, num_draft, method):
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params,
                                       weight_fn=_fixed_weight_fn(1.0), head_params={})
  greedy = VerifyParams(method=method, temperature=0.0, weight=1.0, lenience=1.0)
  expected = [_greedy_reference(target, p, 12) for p in PROMPTS]
  for batch in ([PROMPTS[0]], PROMPTS):
    got = dec.generate(batch, greedy, num_draft=num_draft, max_new_tokens=12,
                       eos_token_ids=())
    assert got.token_ids == expected[:len(batch)]
  ar = dec.generate(PROMPTS, VerifyParams(method="ar", temperature=0.0), max_new_tokens=12,
                    eos_token_ids=())
  assert ar.token_ids == expected


def test_a_sweep_of_rule_values_compiles_one_program_per_method(pair):
  """The decoder passes a rule's numbers (static weight, lenience) to its program as
  arguments: one program per method, whose second value decodes as the program compiled
  with that value as a constant does."""
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  tokens, lengths = decoder_lib.pad_prompts(PROMPTS, 0)
  cache_len = decoder_lib.bucket_length(tokens.shape[1] + 12 + 3 + 2)
  for method, field, values in (("static", "weight", (0.2, 0.7)),
                                ("lossy", "lenience", (0.3, 0.9))):
    before, outputs = len(dec.programs), []
    for value in values:
      verify = VerifyParams(method=method, temperature=1.0, **{field: value})
      got = dec.generate(PROMPTS, verify, num_draft=3, max_new_tokens=12, seed=4,
                         eos_token_ids=())
      outputs.append(got.token_ids)
    constant = loop.decode(
        dec.target_params(), draft_params, None, jnp.asarray(tokens), jnp.asarray(lengths),
        jax.random.PRNGKey(4), spec=loop.LoopSpec(verify=verify, num_draft=3,
                                                  max_new_tokens=12),
        target_config=target.config, draft=draft, cache_len=cache_len,
        prefill_chunk=dec.prefill_chunk)
    assert outputs[-1] == [row[:n].tolist() for row, n in
                           zip(np.asarray(constant.tokens_qn),
                               np.asarray(constant.num_generated_q))], method
    assert len(dec.programs) == before + 1, method
    assert outputs[0] != outputs[1], method  # the values reach the rule


def test_decoders_of_one_target_share_its_decoding_layout(pair):
  # The evaluation builds up to three decoders for one target: one copy of its decoding
  # layout between them, not one each.
  target, draft, draft_params = pair
  plain = decoder_lib.SpeculativeDecoder(target)
  speculative = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  assert plain.target_params() is speculative.target_params()
  loaded = loading.LoadedModel(target.config, target.params, "tiny", "")
  handle = build.model_handle(loaded)
  assert build.model_handle(loaded) is handle
  assert build.model_handle(loading.LoadedModel(target.config, target.params, "tiny", "")) \
      is not handle
  # The registry keeps no loaded model alive.
  alive = weakref.ref(loaded)
  del loaded
  gc.collect()
  assert alive() is None


def test_unstacked_decoding_layout_gives_the_same_results(pair):
  target, draft, draft_params = pair
  fast = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  plain = decoder_lib.SpeculativeDecoder(target, draft, draft_params, unstack=False)
  # The fast layout: unrolled draft and target, matrices stored [out, in].
  assert isinstance(fast.draft_params["layers"], tuple)
  assert isinstance(fast.target_params()["layers"], tuple)
  assert "gate_up_oi" in fast.target_params()["layers"][0]
  assert isinstance(plain.target_params()["layers"], dict)
  for method, k, rows in (("sd", 3, None), ("sd", 3, 1), ("ar", 0, None)):
    vp = VerifyParams(method=method, temperature=1.0)
    a, b = (d.generate(PROMPTS, vp, num_draft=k, max_new_tokens=12, seed=3, eos_token_ids=(),
                       batch_size=rows) for d in (fast, plain))
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.stats.accept_prob_rbk, b.stats.accept_prob_rbk, atol=1e-5)


def test_draft_equal_to_target_accepts_everything(pair):
  target, _, _ = pair
  dec = decoder_lib.SpeculativeDecoder(target, drafts.LMDraft(target.config), target.params)
  out = dec.generate(PROMPTS, VerifyParams(method="sd", temperature=1.0), num_draft=3,
                     max_new_tokens=16, eos_token_ids=())
  assert all(n == 3 for row in out.accepted_per_round for n in row[:-1])
  np.testing.assert_allclose(out.stats.accept_prob_rbk[out.stats.active_rb], 1.0, atol=1e-5)


def test_eos_and_max_new_tokens_stop_rows(pair):
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  greedy = VerifyParams(method="sd", temperature=0.0)
  free = dec.generate(PROMPTS, greedy, num_draft=3, max_new_tokens=10, eos_token_ids=())
  assert [len(t) for t in free.token_ids] == [10] * len(PROMPTS)
  eos = free.token_ids[0][4]
  stopped = dec.generate(PROMPTS, greedy, num_draft=3, max_new_tokens=10, eos_token_ids=[eos])
  for row_free, row in zip(free.token_ids, stopped.token_ids):
    cut = row_free.index(eos) + 1 if eos in row_free else len(row_free)
    assert row == row_free[:cut]


QUEUE = PROMPTS + [[3, 3, 4], [9, 8, 7, 6, 5, 4], [1, 1]]


def _stopped_at_eos(tokens, eos_ids):
  """`tokens` up to and with the first of `eos_ids` (greedy decoding stops there)."""
  for i, token in enumerate(tokens):
    if token in eos_ids:
      return tokens[:i + 1]
  return tokens


# A prefill chunk of 2 makes several passes per prompt, 64 one; the prefill is the same for
# every method, so one method runs it both ways. 'sd' with chunk 64 and 'ar' run the whole
# grid (all prompts at once and queued on 1 or 3 rows, with and without EOS); the other two
# cases (each a method or chunk size of its own: 'static' drafts q_{K+1} too) run only its
# most demanding cell, 3 rows with EOS (rows free up at different rounds and take queued
# prompts, prefilled in the loop), against the reference: each grid cell is a compile.
@pytest.mark.parametrize("method,num_draft,prefill_chunk,whole_grid",
                         [("ar", 0, 64, True), ("sd", 3, 2, False), ("sd", 3, 64, True),
                          ("static", 2, 64, False)],
                         ids=["ar-0-64", "sd-3-2", "sd-3-64", "static-2-64"])
def test_continuous_batching_gives_each_prompt_its_own_decoding(pair, method, num_draft,
                                                                prefill_chunk, whole_grid):
  """With fewer rows than prompts, finished rows take queued prompts; every prompt's tokens
  equal those of decoding it alone by a plain forward (greedy), with and without EOS."""
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params, prefill_chunk=prefill_chunk)
  # weight 1 keeps greedy 'static' deterministic (nu = p) while it still drafts K + 1 steps.
  greedy = VerifyParams(method=method, temperature=0.0, weight=1.0)
  expected = [_greedy_reference(target, p, 10) for p in QUEUE]
  eos = expected[1][2]  # stops some prompts early, so rows free up at different rounds
  for eos_ids in ((), (eos,)) if whole_grid else ((eos,),):
    want = [_stopped_at_eos(t, eos_ids) for t in expected]
    if whole_grid:
      together = dec.generate(QUEUE, greedy, num_draft=num_draft, max_new_tokens=10,
                              eos_token_ids=eos_ids)
      assert together.token_ids == want
    for batch_size in (1, 3) if whole_grid else (3,):
      queued = dec.generate(QUEUE, greedy, num_draft=num_draft, max_new_tokens=10,
                            eos_token_ids=eos_ids, batch_size=batch_size)
      assert queued.token_ids == want, (eos_ids, batch_size)
      # Each prompt's rounds are its own: they commit exactly its tokens.
      for accepted, tokens in zip(queued.accepted_per_round, queued.token_ids):
        assert len(accepted) >= 1
        assert sum(n + 1 for n in accepted[:-1]) < len(tokens) <= sum(n + 1 for n in accepted)
      served = queued.stats.prompt_rb[queued.stats.active_rb]
      assert sorted(set(served.tolist())) == list(range(len(QUEUE)))
      assert queued.stats.active_rb.shape[1] == batch_size
      if batch_size == 1:
        assert queued.rounds == sum(len(a) for a in queued.accepted_per_round)


@pytest.mark.parametrize("batch_size", [None, 3])  # widths 7, 3, 1 / queued: 3, 1
def test_tail_shrinks_the_batch_to_its_unfinished_rows(pair, batch_size):
  """Once no prompt is queued, the batch shrinks to its unfinished rows: the same tokens and
  statistics as keeping every row to the end, with every column still the row that
  started there, and each round as narrow as its unfinished rows allow."""
  target, draft, draft_params = pair
  greedy = VerifyParams(method="sd", temperature=0.0)
  eos = _greedy_reference(target, QUEUE[1], 3)[2]  # rows finish at different rounds
  runs = {shrink: decoder_lib.SpeculativeDecoder(
      target, draft, draft_params, shrink_tail=shrink).generate(
          QUEUE, greedy, num_draft=2, max_new_tokens=10, eos_token_ids=(eos,),
          batch_size=batch_size) for shrink in (False, True)}
  kept, shrunk = runs[False], runs[True]
  rows = batch_size or len(QUEUE)
  assert shrunk.token_ids == kept.token_ids
  assert shrunk.accepted_per_round == kept.accepted_per_round
  assert shrunk.rounds == kept.rounds
  active = kept.stats.active_rb
  np.testing.assert_array_equal(shrunk.stats.active_rb, active)
  for field in ("prompt_rb", "num_accepted_rb", "accept_prob_rbk", "beta_rbk"):
    want, got = getattr(kept.stats, field)[active], getattr(shrunk.stats, field)[active]
    np.testing.assert_allclose(got, want, atol=1e-6, err_msg=field)
  assert np.all(kept.stats.width_r == rows)
  phases = (rows, *loop.default_tail_widths(rows))
  widths = shrunk.stats.width_r.tolist()
  assert set(widths) <= set(phases)
  assert widths == sorted(widths, reverse=True) and widths[-1] < rows
  unfinished = active.sum(axis=1)
  assert np.all(unfinished <= widths)
  # A round runs at a width only while the unfinished rows do not fit the next one.
  next_width = dict(zip(phases, phases[1:] + (0,)))
  assert all(u > next_width[w] for u, w in zip(unfinished, widths))


@pytest.mark.parametrize("tail_widths", [(4,), (2, 2), (2, 0)])
def test_bad_tail_widths_are_refused(pair, tail_widths):
  target, draft, draft_params = pair
  spec = loop.LoopSpec(verify=VerifyParams(method="sd"), num_draft=2, max_new_tokens=4)
  with pytest.raises(ValueError, match=re.escape(f"tail_widths={tail_widths}")):
    loop.decode(target.params, draft_params, None, jnp.ones((4, 32), jnp.int32),
                jnp.full((4,), 3, jnp.int32), jax.random.PRNGKey(0), spec=spec,
                target_config=target.config, draft=draft, cache_len=64,
                tail_widths=tail_widths)


@pytest.mark.parametrize("num_draft,with_draft,cache_len,message", [
    (2, True, 38, "cache_len=38 must be >= the prompt bucket 32 + max_new_tokens 4 + "
                  "num_draft 2 + 1 = 39"),
    (2, False, 64, "num_draft=2 needs a draft"),
])
def test_bad_decode_arguments_are_refused(pair, num_draft, with_draft, cache_len, message):
  target, draft, draft_params = pair
  spec = loop.LoopSpec(verify=VerifyParams(method="sd"), num_draft=num_draft,
                       max_new_tokens=4)
  with pytest.raises(ValueError, match=re.escape(message)):
    loop.decode(target.params, draft_params, None, jnp.ones((4, 32), jnp.int32),
                jnp.full((4,), 3, jnp.int32), jax.random.PRNGKey(0), spec=spec,
                target_config=target.config, draft=draft if with_draft else None,
                cache_len=cache_len)


def test_bad_loop_specs_are_refused():
  # EOS ids given as a list still make a hashable spec (a jit static argument).
  listed = loop.LoopSpec(verify=VerifyParams(method="sd"), num_draft=2, eos_token_ids=[3, 4])
  assert hash(listed) == hash(loop.LoopSpec(verify=VerifyParams(method="sd"), num_draft=2,
                                            eos_token_ids=(3, 4)))
  with pytest.raises(ValueError, match=re.escape("method='ar' drafts nothing: num_draft=3")):
    loop.LoopSpec(verify=VerifyParams(method="ar"), num_draft=3)
  with pytest.raises(ValueError, match="record_policy needs a rule .* method='sd'"):
    loop.LoopSpec(verify=VerifyParams(method="sd"), num_draft=3, record_policy=True)
  # 'ar' calls no rule, so its settings are checked by the spec (NaN once gave garbage).
  for bad in (math.nan, math.inf, -1.0):
    with pytest.raises(ValueError, match=re.escape(
        f"LoopSpec.verify.temperature must be finite and >= 0, got {bad!r}")):
      loop.LoopSpec(verify=VerifyParams(method="ar", temperature=bad), num_draft=0)
  with pytest.raises(ValueError, match=re.escape("LoopSpec.verify.top_p must be in (0, 1]")):
    loop.LoopSpec(verify=VerifyParams(method="ar", top_p=0.0), num_draft=0)


@pytest.mark.parametrize("chunk", [64, 12, 6])
def test_prefill_passes_cover_the_prompt_and_no_more(chunk):
  """Whole chunks, then up to two quarter-chunk passes for a rest of at most half a chunk
  (less than a quarter to spare); a longer rest takes one more whole chunk."""
  for num_tokens in range(3 * chunk):
    whole, quarters = map(int, loop._pass_counts(jnp.asarray(num_tokens), chunk))
    rest = num_tokens % chunk
    if chunk % 4:  # no quarter passes
      assert (whole, quarters) == (-(-num_tokens // chunk), 0), num_tokens
    elif 0 < rest <= chunk // 2:
      assert whole == num_tokens // chunk and quarters == -(-rest // (chunk // 4)), num_tokens
    else:
      assert (whole, quarters) == (-(-num_tokens // chunk), 0), num_tokens


def test_default_tail_widths_halve_down_to_whole_shards():
  assert loop.default_tail_widths(8) == (4, 2, 1)
  assert loop.default_tail_widths(7) == (3, 1)
  assert loop.default_tail_widths(1) == ()
  assert loop.default_tail_widths(8, multiple_of=2) == (4, 2)
  assert loop.default_tail_widths(6, multiple_of=2) == ()


@pytest.mark.parametrize("prompts,message", [
    ([], "no prompts to decode"),
    ([[1, 2], [3]], "prompt 1 has 1 (1 of 2 too short)"),
    ([[1, 2], [3, VOCAB]], f"prompt 1 has token id {VOCAB} outside the vocabulary [0, {VOCAB})"),
])
def test_bad_prompts_are_refused_before_decoding(pair, prompts, message):
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  with pytest.raises(ValueError, match=re.escape(message)):
    dec.generate(prompts, VerifyParams(method="sd"))


def test_continuous_batching_rejects_a_bad_batch_size(pair):
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  with pytest.raises(ValueError, match="batch_size=5"):
    dec.generate(PROMPTS, VerifyParams(method="sd"), batch_size=5)


def _hlo_computations(text: str) -> dict[str, list[str]]:
  """Optimised HLO text -> {computation name ('ENTRY' for the entry): instruction lines}."""
  comps, name = {}, None
  for line in text.splitlines():
    header = re.match(r"^(ENTRY )?%(\S+) .*\{$", line)
    if header:
      name = "ENTRY" if header.group(1) else header.group(2)
      comps[name] = []
    elif line.startswith("}"):
      name = None
    elif name:
      comps[name].append(line)
  return comps


def _called_from(comps: dict[str, list[str]], roots) -> set[str]:
  seen, todo = set(), list(roots)
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    for line in comps[name]:
      todo += re.findall(r"(?:body|condition|calls|to_apply)=%([\w.\-]+)", line)
      for group in re.findall(r"branch_computations=\{([^}]*)\}", line):
        todo += re.findall(r"%([\w.\-]+)", group)
  return seen


@pytest.mark.parametrize("num_prompts,batch_size,tail_widths",
                         [(4, None, ()), (4, 2, ()), (1, None, ()), (4, None, (2, 1))])
@pytest.mark.parametrize("method,unstack", [("sd", False), ("sd", True), ("ar", True)])
def test_round_loop_updates_the_caches_in_place(two_layer_pair, num_prompts, batch_size,
                                                tail_widths, method, unstack):
  """No cache-sized copy inside the compiled while loops: a copy there would move the whole
  cache every round (at batch 8 on SmolLM2, 189 MB a round). Checked for the stacked
  caches of scanned layers and the per-layer caches of unrolled ones (`unstack`: the
  decoder's layouts), and for the narrower caches of a shrunk tail. Outside the
  loop (the cache's initialisation) the same search finds one, so the search itself
  works."""
  target, draft, draft_params = two_layer_pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params, unstack=unstack)
  k = 3 if method == "sd" else 0
  spec = loop.LoopSpec(verify=VerifyParams(method=method), num_draft=k, max_new_tokens=8)
  prompts = jnp.ones((num_prompts, 32), jnp.int32)
  lengths = jnp.full((num_prompts,), 5, jnp.int32)
  rows = batch_size or num_prompts
  target_params = dec.target_params()
  text = loop.decode.lower(
      target_params, dec.draft_params if k else None, None, prompts, lengths,
      jax.random.PRNGKey(0), spec=spec, target_config=target.config,
      draft=draft if k else None, cache_len=128, batch_size=batch_size,
      tail_widths=tail_widths).compile().as_text()
  comps = _hlo_computations(text)
  loops = [re.search(r"body=%([\w.\-]+)", line).group(1) for line in comps["ENTRY"]
           if " while(" in line and 'op_name="jit(decode)/while"' in line]
  assert loops
  inside = _called_from(comps, loops)
  # (layers, per-layer layout): per-layer buffers for unrolled layers with several rows.
  caches = [(target.config.num_layers,
             isinstance(target_params["layers"], tuple) and rows > 1)]
  if k:
    caches.append((draft.config.num_layers, unstack and rows > 1))
  assert len(loops) >= 1 + len(tail_widths)
  for layers, per_layer in caches:
    for width in (rows, *tail_widths):  # one row: stacked (KVCache.take_rows)
      dims = (width, 128, target.config.num_kv_heads, target.config.head_dim)
      dims = dims if per_layer and width > 1 else (layers, *dims)
      shape = re.escape(f"f32[{','.join(map(str, dims))}]") + r"\{[^}]*\} copy(-start)?\("
      copies = {name for name, lines in comps.items() for line in lines
                if re.search(shape, line)}
      if width == rows:
        assert copies, "the search found no cache copy anywhere: it is broken"
      assert not copies & inside, [line for name in copies & inside for line in comps[name]
                                   if re.search(shape, line)]


@pytest.mark.parametrize("method,temperature", [("sd", 0.0), ("ar", 0.0), ("sd", 1.0)])
def test_greedy_rounds_of_many_rows_take_the_row_independent_products(pair, method,
                                                                      temperature):
  """16 rows verifying K + 1 = 5 tokens make 80 rows, past the kernel's usual limit of
  64. Greedy rounds still take the kernel (no XLA product inside the while loop), so each
  row rounds as in a plain greedy step of 16 rows; sampled rounds keep XLA's faster dot
  (which also shows that the search finds a product inside the loop). Greedy prefill
  passes of 16 x 16 tokens take the kernel too (no XLA product anywhere), so a prompt's
  greedy output does not depend on the prompts prefilled beside it."""
  if not cpu_kernels.available():
    pytest.skip("the few-row kernel cannot be built here")
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  k = 4 if method == "sd" else 0
  spec = loop.LoopSpec(verify=VerifyParams(method=method, temperature=temperature),
                       num_draft=k, max_new_tokens=8)
  text = loop.decode.lower(
      dec.target_params(), dec.draft_params if k else None, None, jnp.ones((16, 16), jnp.int32),
      jnp.full((16,), 5, jnp.int32), jax.random.PRNGKey(0), spec=spec,
      target_config=target.config, draft=draft if k else None, cache_len=64,
      prefill_chunk=16).compile().as_text()
  comps = _hlo_computations(text)
  loops = [re.search(r"body=%([\w.\-]+)", line).group(1) for line in comps["ENTRY"]
           if " while(" in line and 'op_name="jit(decode)/while"' in line]
  inside = _called_from(comps, loops)
  assert loops and inside
  dots = {name for name, lines in comps.items() for line in lines if " dot(" in line}
  assert bool(dots & inside) == (temperature > 0), sorted(dots & inside)
  if temperature == 0:
    assert not dots, sorted(dots)


def test_greedy_speculative_equals_greedy_past_the_kernels_row_limit(pair):
  target, draft, draft_params = pair
  queue = [[(3 * i + j) % (VOCAB - 1) + 1 for j in range(2 + i % 5)] for i in range(16)]
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  greedy = lambda method, k: dec.generate(queue, VerifyParams(method=method, temperature=0.0),
                                          num_draft=k, max_new_tokens=10,
                                          eos_token_ids=()).token_ids
  plain = greedy("ar", 0)
  assert plain == [_greedy_reference(target, p, 10) for p in queue]
  assert greedy("sd", 4) == plain  # 16 x 5 = 80 verified rows a round


def test_compiles_once_per_prompt_bucket(pair):
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  vp = VerifyParams(method="sd", temperature=1.0)
  first = dec.generate([[1, 2, 3], [4, 5]], vp, num_draft=2, max_new_tokens=8)
  second = dec.generate([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 1]], vp, num_draft=2,
                        max_new_tokens=8)
  assert first.compile_seconds > 0 and second.compile_seconds == 0
  assert len(dec.programs) == 1
  assert len(second.token_ids) == 2


# Three programs (a sweep of one method's numbers would share one).
SETTINGS = [VerifyParams(method=method) for method in ("ar", "sd", "lossy")]


def _decode_settings(dec):
  return [dec.generate([[1, 2, 3, 4]], vp, num_draft=2, max_new_tokens=6, seed=1).token_ids
          for vp in SETTINGS]


def test_a_decoder_under_mapping_pressure_keeps_few_programs_and_the_same_results(
    pair, monkeypatch):
  expected = _decode_settings(decoder_lib.SpeculativeDecoder(*pair))
  monkeypatch.setattr(programs, "mapping_limit", lambda: 0)  # every compile releases
  dec = decoder_lib.SpeculativeDecoder(*pair)
  assert _decode_settings(dec) == expected
  assert len(dec.programs) == 2  # the latest before the last compile, and the last
  assert _decode_settings(dec) == expected  # recompiled where dropped


@pytest.mark.skipif(not os.path.exists(programs._MAPS), reason="needs Linux's /proc")
def test_releasing_frees_the_programs_mappings(pair):
  """What the release is for: the mappings of dropped programs go back to the system
  (jax's caches hold every program too, so trimming the decoder's alone frees none)."""
  jax.clear_caches()
  dec = decoder_lib.SpeculativeDecoder(*pair)
  before = programs.mapping_count()
  _decode_settings(dec)
  grown = programs.mapping_count() - before
  assert grown > 100, grown  # three programs of a few dozen kernels each
  assert programs.release_under_pressure(fraction=0.0)
  assert len(dec.programs) == 1
  assert programs.mapping_count() - before < grown / 2


@pytest.mark.parametrize("precision", ["highest", "default"])
def test_matmul_precision_reaches_the_compiled_loop(pair, precision, monkeypatch, request):
  """The decoder's precision is in its compiled program's products (what keeps a GPU's
  verification from rounding in TF32 while a one-token step does not): "highest" marks
  every XLA product, "default" none. With the CPU kernels off, as on a GPU: on CPU they
  take every product and attention of this tiny model."""
  monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
  jax.clear_caches()  # the forms are chosen at trace time
  request.addfinalizer(jax.clear_caches)  # later tests trace with the kernels again
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params, matmul_precision=precision)
  dec.generate([[1, 2, 3]], VerifyParams(method="sd", temperature=0.0), num_draft=2,
               max_new_tokens=4)
  (program,) = dec.programs.values()
  dots = [line for line in program.as_text().splitlines() if " dot(" in line]
  assert dots, "no XLA product in the program: the check below would be empty"
  marked = ["operand_precision={highest,highest}" in line for line in dots]
  assert all(marked) if precision == "highest" else not any(marked)
  dec.matmul_precision = "default" if precision == "highest" else "highest"
  dec.generate([[1, 2, 3]], VerifyParams(method="sd", temperature=0.0), num_draft=2,
               max_new_tokens=4)
  assert len(dec.programs) == 2, "a changed precision reused the old program"


def test_unknown_matmul_precision_is_refused(pair):
  with pytest.raises(ValueError, match="matmul_precision='fast'"):
    decoder_lib.SpeculativeDecoder(pair[0], matmul_precision="fast")


def _exact_two_token_law(target, draft, draft_params, prompt, law, bonus=None):
  """Exact joint law of the first two generated tokens of rounds of K = 1 draft.
  `law(p, q)` -> the rule's emitted law pi; `bonus(p, q)` -> the law of the bonus token
  that follows an accepted draft (default: pi). The first token is the accepted draft with
  probability min(q, pi)(x1) (a = min(1, pi/q), every rule here), then the bonus; else it
  was the residual, and the next round emits the second by pi."""
  joint = np.zeros((VOCAB, VOCAB))
  def dists(tokens):
    p = jax.nn.softmax(padded_forward.last_logits(target.params, target.config, tokens))
    q = jax.nn.softmax(padded_forward.last_logits(draft_params, draft.config, tokens))
    return np.asarray(p, np.float64), np.asarray(q, np.float64)
  p0, q0 = dists(prompt)
  first = law(p0, q0)
  accepted = np.minimum(q0, first)
  for x1 in range(VOCAB):
    p1, q1 = dists(prompt + [x1])
    joint[x1] = accepted[x1] * (bonus or law)(p1, q1) + (first[x1] - accepted[x1]) * law(p1, q1)
  return joint


def _cascade_v1_law(alpha):
  """SpecCascade's token-specific rule V1 at temperature 1 (docs/methods.md): pi(v) =
  q(v) 1[v in A] + (1 - q(A)) p(v), A = {q(v) >= max p - alpha}."""
  def law(p, q):
    kept = np.where(q >= p.max() - alpha, q, 0.0)
    return kept + (1.0 - kept.sum()) * p
  return law


def _mentored_tv_law(eps):
  """Mentored decoding's emitted law, TV budget eps (docs/methods.md), by bisection in
  float64: q a + (1 - sum q a) norm((p - q)+), a = min(1, c p/q), c solving
  sum_{q > p} min(q - p, (c - 1) p) = eps (assumed < TV(p, q), so c is finite)."""
  def law(p, q):
    excess = q > p
    lo, hi = 1.0, 1e9
    for _ in range(200):
      c = 0.5 * (lo + hi)
      lo, hi = (c, hi) if np.minimum(q - p, (c - 1) * p)[excess].sum() < eps else (lo, c)
    kept = np.minimum(q, lo * p)
    deficit = np.maximum(p - q, 0.0)
    return kept + (1.0 - kept.sum()) * deficit / deficit.sum()
  return law


_TARGET_LAW = lambda p, q: p
_V1 = _cascade_v1_law(0.3)
_MENTORED = _mentored_tv_law(0.5)


# (params, emitted law, bonus law (None: the emitted one), a wrong (law, bonus) the loop's
# samples must be far from). The wrong laws of 'cascade' and 'mentored' are the plausible
# loop bugs: a bonus drawn from p instead of the rule's own law at K + 1 (no q_{K+1}), and
# one drawn from the rule's law instead of p. ('cascade' V1 with alpha 0.3 accepts 95% of
# first drafts; 'mentored' with eps 0.5 accepts 55%, so both take both branches.)
@pytest.mark.parametrize("params,law,bonus,wrong", [
    (VerifyParams(method="sd"), _TARGET_LAW, None, (lambda p, q: q, None)),
    (VerifyParams(method="static", weight=0.3), lambda p, q: 0.3 * p + 0.7 * q, None,
     (_TARGET_LAW, None)),
    (VerifyParams(method="diversed", weight=0.3), lambda p, q: 0.3 * p + 0.7 * q, None,
     (_TARGET_LAW, None)),
    (VerifyParams(method="cascade", cascade_rule="v1", cascade_alpha=0.3), _V1, None,
     (_V1, _TARGET_LAW)),
    (VerifyParams(method="mentored", epsilon=0.5), _MENTORED, _TARGET_LAW, (_MENTORED, None)),
], ids=["sd", "static", "diversed", "cascade", "mentored"])
def test_two_token_law_of_the_loop(pair, params, law, bonus, wrong):
  """Sampling many rows through the real loop (drafting, verification, roll-back, bonus
  tokens) reproduces the exact joint law of two tokens. 6,000 rows; TV tolerance 0.04
  (the sampling error of a 121-cell joint at this size is about 0.025)."""
  target, draft, draft_params = pair
  prompt = [1, 2, 3, 4]
  rows = 6000
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params,
                                       weight_fn=_fixed_weight_fn(0.3), head_params={})
  out = dec.generate([prompt] * rows, params, num_draft=1, max_new_tokens=2,
                     eos_token_ids=(), seed=3)
  counts = np.zeros((VOCAB, VOCAB))
  for x1, x2 in (t[:2] for t in out.token_ids):
    counts[x1, x2] += 1
  expected = _exact_two_token_law(target, draft, draft_params, prompt, law, bonus)
  tv = 0.5 * np.abs(counts / rows - expected).sum()
  assert tv < 0.04, tv
  # A wrong law is far away, so the test can fail.
  assert 0.5 * np.abs(counts / rows - _exact_two_token_law(
      target, draft, draft_params, prompt, *wrong)).sum() > 0.1


def test_step_costs_time_the_decoder_calls_and_predict_the_speedup(pair):
  from diversed_jax.speculative import step_costs
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  samples = step_costs.sample_calls(dec, batch=2, num_draft=3, cache_len=32, repeats=3,
                                   steps_per_call=2)
  assert samples.shape == (3, 4) and np.all(samples > 0)  # repeats x the four calls
  costs = step_costs.measure(dec, batch=2, num_draft=3, cache_len=32, repeats=2)
  assert min(costs.decode_s, costs.verify_s, costs.draft_s, costs.catchup_s) > 0
  assert costs.c == pytest.approx(costs.draft_s / costs.decode_s)
  # measure = each call's median sample, here of fixed samples (an outlier in each column).
  fixed_samples = np.array([[0.02, 0.03, 0.002, 0.003], [0.09, 0.04, 0.001, 0.009],
                            [0.03, 0.05, 0.004, 0.004]])
  with mock.patch.object(step_costs, "sample_calls", return_value=fixed_samples):
    assert step_costs.measure(dec, 2, 3, 32) == step_costs.StepCosts(0.03, 0.04, 0.002,
                                                                      0.004)
  # tokens_per_round / (c2 + (draft_steps - 1) * c + r), hand-computed for fixed costs:
  # c2 = 0.15 (the catch-up call), c = 0.1, r = 1.5.
  fixed = step_costs.StepCosts(decode_s=0.02, verify_s=0.03, draft_s=0.002, catchup_s=0.003)
  assert fixed.round_s(4) == pytest.approx(0.003 + 3 * 0.002 + 0.03)
  assert fixed.predicted_speedup(2.5, 4) == pytest.approx(2.5 / (0.15 + 3 * 0.1 + 1.5))
  best = step_costs.StepCosts.best([fixed, step_costs.StepCosts(0.01, 0.05, 0.003, 0.002)])
  assert best == step_costs.StepCosts(0.01, 0.03, 0.002, 0.002)
  with pytest.raises(ValueError, match="draft"):
    step_costs.measure(decoder_lib.SpeculativeDecoder(target), 1, 3, 32)


def test_step_costs_time_the_catch_up_call_as_the_loop_makes_it(pair):
  # The loop's first draft call of a round keeps only its last token's logits; timing it
  # with every token's logits overstated c2 and biased the predicted speed-up low.
  from diversed_jax.speculative import step_costs
  target, draft, draft_params = pair
  dec = decoder_lib.SpeculativeDecoder(target, draft, draft_params)
  calls = []
  original = drafts.LMDraft.forward

  def spy(self, params, tokens_bt, cache, target_hidden_btd=None, last_only=False):
    calls.append((tokens_bt.shape[1], target_hidden_btd is not None, last_only))
    return original(self, params, tokens_bt, cache, target_hidden_btd, last_only)

  with mock.patch.object(drafts.LMDraft, "forward", spy):
    step_costs.sample_calls(dec, batch=3, num_draft=2, cache_len=24, repeats=1,
                            steps_per_call=1)
  assert (2, True, True) in calls and (1, False, False) in calls, calls
  assert all(last_only for _, with_features, last_only in calls if with_features), calls


@pytest.mark.parametrize("greedy", [False, True])
def test_greedy_step_costs_take_the_greedy_loops_products(pair, greedy):
  """A verification of 16 x 5 rows: timed for a greedy loop, on the kernel (no XLA dot), as
  the loop runs it; else on XLA's dot."""
  if not cpu_kernels.available():
    pytest.skip("the few-row kernel cannot be built here")
  from diversed_jax.speculative import step_costs
  target, _, _ = pair
  dec = decoder_lib.SpeculativeDecoder(target)
  params = dec.target_params()
  cache = transformer.init_cache(params, target.config, 16, 32)
  text = step_costs._run_steps.lower(params, cache, jnp.ones((16, 5), jnp.int32),
                                     model=target.config, num_steps=1,
                                     greedy=greedy).compile().as_text()
  assert (" dot(" in text) != greedy


@pytest.mark.parametrize("method", ["static", "static_logit"])
def test_static_rules_record_their_weight(pair, method):
  # The reports' mean w reads weights_rbk; it used to be zeros for the static ensembles.
  dec = decoder_lib.SpeculativeDecoder(*pair)
  out = dec.generate(PROMPTS, VerifyParams(method=method, temperature=1.0, weight=0.3),
                     num_draft=2, max_new_tokens=6, eos_token_ids=())
  active = np.asarray(out.stats.active_rb, bool)
  np.testing.assert_allclose(np.asarray(out.stats.weights_rbk)[active], 0.3)
