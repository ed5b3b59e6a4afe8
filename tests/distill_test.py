"""Draft distillation on tiny random models: both draft kinds inside the real speculative
loop, a short run lowering the loss, checkpoint resume, and the shipped draft (slow)."""

import dataclasses
import importlib.util
import json
import os
import shutil
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax.distill import (architectures, artifacts, batches, continuations, copy_gate,
                                  data, train)
from diversed_jax.distill import losses as distill_losses
from diversed_jax.models import ModelConfig, cpu_kernels, init_params, products, transformer
from diversed_jax.models.loading import LoadedModel
from diversed_jax.speculative import decoder as decoder_lib
from diversed_jax.speculative import context_copy, drafts, loop, step_costs
from diversed_jax.speculative.types import VerifyParams
from diversed_jax.tokenizer import encode_prompt

from tests import padded_forward
from tests.entry_points import usage_error
from tests.q8 import q8_0_weights

VOCAB = 64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_config():
  path = os.path.join(ROOT, "configs", "distill_tiny.py")
  spec = importlib.util.spec_from_file_location("distill_tiny", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.fixture(scope="module")
def target():
  config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                       eos_token_ids=())
  params = init_params(config, jax.random.PRNGKey(0), std=0.5)
  return LoadedModel(config, params, "tiny", "")


def _draft(kind, target, vocab_keep=40, seed=1):
  cfg = architectures.draft_config(kind, target.config, 1, 16, 2, 1, 24)
  draft = architectures.DistilledDraft(kind, cfg, target.config.hidden_size, VOCAB)
  vocab = np.random.default_rng(seed).choice(VOCAB, vocab_keep, replace=False)
  train_params = architectures.init_train_params(draft, jax.random.PRNGKey(seed),
                                                 target.params, std=0.3)
  return draft, {"train": train_params,
                 "frozen": architectures.frozen_params(target.params, vocab)}


def _greedy_references(target, prompts, steps):
  return padded_forward.greedy_continuations(target.params, target.config, prompts, steps)


PROMPTS = [[1, 2, 3, 4, 5], [7, 3], [2, 9, 9, 1, 4, 4, 8, 10, 3], [5, 6, 7]]


def _eager_gate(target):
  """A gate that copies eagerly, so the copy token often wins the draft's argmax."""
  return context_copy.CopyGate.by_length((0.6, 0.9), hidden_size=target.config.hidden_size)


@pytest.mark.parametrize("kind,copy", [(kind, False) for kind in architectures.KINDS]
                         + [("feature", True)])
def test_draft_kinds_run_in_the_speculative_loop(target, kind, copy):
  """Greedy SD with each draft kind gives plain greedy decoding's tokens: at K = 1 in one
  batch, and at K = 3 with rows refilled from a queue and in a shrunk tail (one compiled
  program per K and batch). (Sampling with a feature draft in the loop: training_test's
  rollout test, whose recorded laws must match a pass over the text.)"""
  draft, params = _draft(kind, target)
  if copy:  # the copying wrapper's cache goes through roll-back, refill and the tail too
    draft = context_copy.ContextCopyDraft(draft, _eager_gate(target))
  dec = decoder_lib.SpeculativeDecoder(decoder_lib.ModelHandle(target.config, target.params),
                                       draft, params)
  greedy = VerifyParams(method="sd", temperature=0.0)
  expected = _greedy_references(target, PROMPTS, 10)
  if not copy:  # the copying draft's inner draft is feature-False's: K = 3 for the wrapper
    got = dec.generate(PROMPTS, greedy, num_draft=1, max_new_tokens=10, eos_token_ids=())
    assert got.token_ids == expected
  queued = dec.generate(PROMPTS, greedy, num_draft=3, max_new_tokens=10, eos_token_ids=(),
                        batch_size=2)
  assert queued.token_ids == expected  # refilled rows get fresh draft caches and features
  shrinking = decoder_lib.SpeculativeDecoder(
      decoder_lib.ModelHandle(target.config, target.params), draft, params, shrink_tail=True)
  # Three prompts over two rows: the last one decodes alone, in a shrunk batch of one.
  shrunk = shrinking.generate(PROMPTS[:3], greedy, num_draft=3, max_new_tokens=10,
                              eos_token_ids=(), batch_size=2)
  assert shrunk.token_ids == expected[:3]  # the tail keeps each row's caches and features
  assert 1 in shrunk.stats.width_r.tolist()  # a round ran with one row
  if kind == "feature" and not copy:
    # step_costs times a feature draft's catch-up call with the target's features (last
    # position only): the check is that it runs; its arithmetic is loop_test's.
    step_costs.measure(dec, batch=2, num_draft=3, cache_len=32, repeats=1, steps_per_call=2)


def _valid_slots(cache, lengths_b):
  """A KV cache's keys and values with the slots past each row's length zeroed (stale)."""
  kv = cache.kv if hasattr(cache, "kv") else cache
  kv = kv.as_layout(per_layer=False)
  keep = (jnp.arange(kv.capacity)[None, :] < lengths_b[:, None])[None, :, :, None, None]
  return np.asarray(jnp.where(keep, kv.k, 0)), np.asarray(jnp.where(keep, kv.v, 0))


def _reference_prefill(target, draft, params, tokens, lengths, cache_len):
  """Both models over each prompt but its last token in one plain forward (caches,
  features [B, 2, D] of the last two prompt tokens)."""
  prefix = tokens[:, :-1]
  hidden, target_cache = transformer.forward_hidden(
      target.params, target.config, prefix,
      transformer.init_cache(target.params, target.config, len(tokens), cache_len))
  features_btd = jnp.pad(hidden, ((0, 0), (1, 0), (0, 0)))  # [:, t]: predicted token t
  _, _, draft_cache = draft.forward(params, prefix, draft.init_cache(params, len(tokens),
                                                                     cache_len),
                                    features_btd[:, :-1])
  last = (lengths[:, None] - 2) + jnp.arange(2)
  return target_cache, draft_cache, features_btd[jnp.arange(len(tokens))[:, None], last]


@pytest.mark.parametrize("kind", architectures.KINDS)
def test_chunked_prefill_equals_one_plain_forward(target, kind):
  """The loop's prefill, `chunk` tokens at a time (rows of different lengths, the longest
  needing several passes) or in one pass, gives both models the caches and the last two
  features of one plain forward over each prompt."""
  draft, params = _draft(kind, target)
  # Width 32, lengths 2..23. The longest row's 22 tokens take 11 passes of chunk 2; with
  # chunk 16, a whole chunk and two quarter passes (4 + 4); with 32, one whole chunk.
  prompts = PROMPTS + [[(5 * i) % VOCAB for i in range(1, 24)]]
  tokens, lengths = decoder_lib.pad_prompts(prompts)
  tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
  want = _reference_prefill(target, draft, params, tokens, lengths, 64)
  for chunk in (2, 16, 32):
    got = jax.jit(loop.prefill, static_argnums=(1, 2, 6, 7))(
        target.params, target.config, draft, params, tokens, lengths, 64, chunk)
    for mine, ref in zip(got[:2], want[:2]):  # target cache, then draft cache
      np.testing.assert_allclose(_valid_slots(mine, lengths - 1), _valid_slots(ref, lengths - 1),
                                 rtol=1e-5, atol=1e-5, err_msg=f"chunk={chunk}")
    np.testing.assert_array_equal(got[0].lengths_b, lengths - 1)
    np.testing.assert_array_equal(got[2], np.asarray(
        [p[-2:] for p in prompts]))  # the last two prompt tokens
    np.testing.assert_allclose(got[3], want[2], rtol=1e-5, atol=1e-5, err_msg=f"chunk={chunk}")
  # And decoding after either prefill drafts the same (the draft caches agree).
  stats = [decoder_lib.SpeculativeDecoder(
      decoder_lib.ModelHandle(target.config, target.params), draft, params,
      prefill_chunk=chunk).generate(PROMPTS, VerifyParams(method="sd", temperature=0.0),
                                    num_draft=3, max_new_tokens=8, eos_token_ids=(),
                                    batch_size=2).stats for chunk in (32, 2)]
  np.testing.assert_allclose(stats[1].accept_prob_rbk, stats[0].accept_prob_rbk, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.runs_here(jnp.float32), reason="no few-row kernel here")
@pytest.mark.parametrize("kind", architectures.KINDS)
def test_decoding_layout_stores_exact_matrices_narrow_with_the_same_outputs(target, kind,
                                                                            monkeypatch):
  """A draft as loaded from its float16 folder, with a head of Q8_0 rows (float16 scales,
  integer multiples in [-127, 127]), decodes with float16 matrices and an int8 head (a
  matrix float16 cannot hold stays float32), and its logits, features and caches keep the
  bits of the all-float32 layout."""
  draft, params = _draft(kind, target)
  params["train"] = jax.tree.map(lambda x: x.astype(jnp.float16).astype(jnp.float32),
                                 params["train"])
  layers = params["train"]["layers"]  # one matrix off float16's grid must stay float32
  params["train"]["layers"] = {**layers, "down": layers["down"] * (1 + 2.0 ** -14)}
  rng = np.random.default_rng(0)
  _, _, head = q8_0_weights(rng, *params["frozen"]["head_embed"].shape, (0.01, 0.1))
  params["frozen"]["head_embed"] = jnp.asarray(head)
  narrow = draft.inference_params(params)
  matrices = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(narrow["train"])
              if str(path[-1]).strip("[]'").endswith("_oi")]
  kept_wide = [m.dtype for m in matrices if m.dtype != jnp.float16]
  assert kept_wide == [jnp.float32] * len(layers["q"])  # each layer's down_oi
  assert isinstance(narrow["frozen"]["head_embed"], products.Int8Rows)
  with monkeypatch.context() as patch:  # the same layout, every matrix float32
    patch.setattr(cpu_kernels, "runs_here", lambda dtype: False)
    wide = draft.inference_params(params)
  tokens = jnp.asarray([[3, 9, 4], [1, 7, 2]])
  features = jnp.asarray(rng.standard_normal((2, 3, target.config.hidden_size)), jnp.float32)
  run = jax.jit(lambda p: draft.forward(p, tokens, draft.init_cache(p, 2, 16), features))
  for got, want in zip(jax.tree.leaves(run(narrow)), jax.tree.leaves(run(wide))):
    np.testing.assert_array_equal(got, want)


def test_feature_draft_incremental_matches_training_pass(target):
  """Drafting step by step (cache, own features) equals the unrolled training pass."""
  draft, params = _draft("feature", target)
  tokens = jnp.asarray([[3, 9, 4, 1, 7, 2]])
  hidden, _ = transformer.forward_hidden(target.params, target.config, tokens)
  feats = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))
  logits_j, _ = draft.train_forward(params, tokens, feats, unroll=3)
  vocab_ids = params["frozen"]["vocab_ids"]
  # Teacher-forced prefix of 3 tokens, then two proposals fed with the draft's own features.
  cache = draft.init_cache(params, 1, 16)
  logits, _, cache = draft.forward(params, tokens[:, :3], cache, feats[:, :3])
  np.testing.assert_allclose(logits[0][:, vocab_ids], logits_j[0, 0, :3], rtol=1e-4, atol=1e-4)
  logits, _, cache = draft.forward(params, tokens[:, 3:4], cache, None)
  np.testing.assert_allclose(logits[0, 0, vocab_ids], logits_j[1, 0, 3], rtol=1e-4, atol=1e-4)
  logits, _, cache = draft.forward(params, tokens[:, 4:5], cache, None)
  np.testing.assert_allclose(logits[0, 0, vocab_ids], logits_j[2, 0, 4], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, target):
  folder = str(tmp_path_factory.mktemp("shards"))
  dec = decoder_lib.SpeculativeDecoder(decoder_lib.ModelHandle(target.config, target.params))
  rng = np.random.default_rng(0)
  for index in range(3):
    prompts = [rng.integers(3, VOCAB, size=int(rng.integers(4, 12))).tolist() for _ in range(6)]
    arrays = data.shard_from_prompts(dec, prompts, temperature=1.0, max_new_tokens=20,
                                     top_k=8, seed=index, eos_token_ids=())
    data.save_shard(folder, index, arrays)
  return folder


def _config(shard_dir, workdir, kind, steps=40):
  c = _tiny_config()
  c.data.dir = shard_dir
  c.workdir = str(workdir)
  c.draft.kind = kind
  c.train.steps = steps
  c.train.eval_every = 0
  c.train.unroll = 2
  return c


def _quiet(msg):
  del msg


@pytest.mark.parametrize("kind", architectures.KINDS)
def test_tiny_distillation_lowers_the_loss(target, shard_dir, tmp_path, kind):
  trainer = train.Trainer(_config(shard_dir, tmp_path, kind, steps=60), target, log=_quiet)
  losses = trainer.train()
  assert len(losses) == 60
  assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.05
  before = trainer.evaluate()
  assert 0.0 <= before["score"] <= 1.0
  trainer.export(str(tmp_path / "draft"))
  draft, params = artifacts.load_draft_folder(str(tmp_path / "draft"), target)
  assert draft == trainer.draft
  dec = decoder_lib.SpeculativeDecoder(decoder_lib.ModelHandle(target.config, target.params),
                                       draft, params)
  out = dec.generate(PROMPTS, VerifyParams(method="sd", temperature=0.0), num_draft=2,
                     max_new_tokens=6, eos_token_ids=())
  assert out.token_ids == _greedy_references(target, PROMPTS, 6)


def test_resume_gives_the_same_losses(target, shard_dir, tmp_path, monkeypatch, capsys):
  whole = train.Trainer(_config(shard_dir, tmp_path / "a", "feature", steps=20), target,
                        log=_quiet).train()
  first = train.Trainer(_config(shard_dir, tmp_path / "b", "feature", steps=20), target,
                        log=_quiet)
  part = first.train(num_steps=10)  # "interrupted" after the step-10 checkpoint
  del first
  other = _config(shard_dir, tmp_path / "b", "feature", steps=20)
  other.train.lr = 0.01
  with pytest.raises(ValueError, match=r"trained with train\.lr=0\.003 \(now 0\.01\)"):
    train.Trainer(other, target, log=_quiet)
  # The command line refuses it as a usage error, before the target loads.
  argv = [f"--config={ROOT}/configs/distill_tiny.py", f"--config.workdir={tmp_path / 'b'}",
          f"--config.data.dir={shard_dir}", "--config.draft.kind=feature",
          "--config.train.steps=20", "--config.train.eval_every=0", "--config.train.unroll=2",
          "--config.train.lr=0.01"]
  assert "train.lr=0.003 (now 0.01)" in usage_error("diversed_jax.distill", argv,
                                                    monkeypatch, capsys)
  c = _config(shard_dir, tmp_path / "b", "feature", steps=20)
  c.train.log_every, c.train.checkpoint_every = 3, 7  # bookkeeping may change
  resumed = train.Trainer(c, target, log=_quiet)
  assert resumed.step == 10
  rest = resumed.train()
  np.testing.assert_allclose(part + rest, whole, rtol=1e-5, atol=1e-6)


def test_run_settings_name_files_absolutely_and_leave_out_bookkeeping(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  os.makedirs("draft")
  c = _tiny_config()
  c.train.init_from, c.data.dir = "draft", "shards"
  settings = train.run_settings(c)
  assert settings["train"]["init_from"] == str(tmp_path / "draft")
  assert settings["data"] == {"dir": str(tmp_path / "shards")}
  assert settings["target"] == c.target  # a registry name stays one
  assert settings["train"]["eval_shards"] == list(c.train.eval_shards)  # JSON: a list
  assert settings["draft"]["vocab_keep"] == 40
  assert not set(train.RESUMABLE_CHANGES) & set(settings["train"])


def test_a_fresh_run_in_a_used_workdir_starts_its_own_vocabulary_and_best(target, shard_dir,
                                                                          tmp_path):
  """An earlier run without checkpoints left a kept vocabulary chosen under other settings
  (here draft.vocab_keep = 5) and a best draft: the next start has nothing to resume, so it
  chooses again instead of training on the stale vocabulary, and its first evaluation
  replaces that best whatever it scored."""
  os.makedirs(tmp_path / "run" / "best")
  np.save(tmp_path / "run" / "vocab_ids.npy", np.arange(5, dtype=np.int32))
  (tmp_path / "run" / "best" / "draft.json").write_text(json.dumps(
      {"recipe": {"select_by": "accept1"}, "eval": {"score": 0.99}}))
  said = []
  trainer = train.Trainer(_config(shard_dir, tmp_path / "run", "feature"), target,
                          log=said.append)
  assert len(trainer.vocab_ids) == 40
  assert len(np.load(tmp_path / "run" / "vocab_ids.npy")) == 40
  assert trainer.best == -1.0 and any("best draft of an earlier run" in s for s in said)


def _toy_shard(folder, index, records):
  """A shard of (prompt ids, continuation ids) records; tiny zero features."""
  width = max(len(p) + len(c) for p, c in records)
  tokens = np.zeros((len(records), width), np.int32)
  for row, (p, c) in enumerate(records):
    tokens[row, :len(p) + len(c)] = p + c
  data.save_shard(str(folder), index, {
      "tokens": tokens, "lengths": np.asarray([len(p) + len(c) for p, c in records], np.int32),
      "prompt_lengths": np.asarray([len(p) for p, _ in records], np.int32),
      "hidden": np.zeros((len(records), width, 4), np.float16),
      "topk_ids": np.zeros((len(records), width, 2), np.uint16),
      "topk_logp": np.zeros((len(records), width, 2), np.float16)})


def _prompts(pool):
  return sorted(s.tokens[:s.prompt_length].tolist() for s in pool.sequences)


def test_held_out_prompts_are_never_drawn_from_other_shards(tmp_path):
  """Another data plan puts a held-out prompt under another index (here in an extra
  folder): its sequence is left out of training, whatever its continuation."""
  _toy_shard(tmp_path / "plan0", 0, [([5, 6, 7], [20, 21]), ([8, 9], [22])])  # held out
  _toy_shard(tmp_path / "plan0", 1, [([10, 11], [23, 24])])
  _toy_shard(tmp_path / "plan1", 0, [([12, 13], [25]), ([8, 9], [30, 31, 32])])
  _toy_shard(tmp_path / "plan1", 1, [([5, 6, 7, 1], [26])])  # a longer prompt is another
  pool = batches.ShardPool(str(tmp_path / "plan0"), (0,), (str(tmp_path / "plan1"),))
  pool.use(pool.available())
  assert _prompts(pool) == [[5, 6, 7, 1], [10, 11], [12, 13]] and pool.num_dropped == 1
  draws = batches.window_batch(pool.sequences, np.random.default_rng(0), 256, 4,
                               np.arange(VOCAB), 1.0)["tokens_bw"]
  assert not np.isin(draws, [30, 31, 32]).any()


def test_pool_order_does_not_depend_on_when_shards_were_loaded(tmp_path):
  """Shards written into both folders while a run trains: the live pool and one loaded at
  once from the recorded paths hold the same sequences in the same order."""
  ref, gen = tmp_path / "ref", tmp_path / "gen"
  for i in range(4):
    _toy_shard(ref, i, [([3, 10 + i], [10 + i])])
  _toy_shard(gen, 0, [([4, 30], [30])])
  live = batches.ShardPool(str(ref), (0,), (str(gen),))
  live.use(live.available())
  _toy_shard(gen, 1, [([4, 31], [31])])  # sorts before ref's shards 1-3
  _toy_shard(ref, 4, [([3, 14], [14])])
  live.use(live.available())
  _toy_shard(gen, 2, [([4, 32], [32])])  # while the run is stopped
  resumed = batches.ShardPool(str(ref), (0,), (str(gen),))
  resumed.use(live.num_shards, live.in_use)
  assert [s.tokens[-1] for s in live.sequences] == [30, 31, 11, 12, 13, 14]
  assert [s.tokens[-1] for s in resumed.sequences] == [s.tokens[-1] for s in live.sequences]
  rows = [batches.window_batch(pool.sequences, np.random.default_rng([0, 7, 6]), 8, 3,
                               np.arange(VOCAB), 1.0)["tokens_bw"] for pool in (live, resumed)]
  np.testing.assert_array_equal(*rows)
  os.remove(data.shard_path(str(gen), 1))
  with pytest.raises(ValueError, match="in use at the checkpoint are gone"):
    batches.ShardPool(str(ref), (0,), (str(gen),)).use(live.num_shards, live.in_use)


def test_resume_after_the_shard_folders_grew(target, shard_dir, tmp_path):
  """A run whose extra folder gets a shard mid-run (picked up at the step-10 rescan) and
  another while it is stopped at step 15 resumes on the same shards and losses; an extra
  shard holding the held-out prompts trains nothing and is logged."""

  def run_dirs(root):
    for index in (1, 2):
      os.makedirs(root / "data", exist_ok=True)
      shutil.copy(data.shard_path(shard_dir, index), data.shard_path(str(root / "data"), index))
    shutil.copy(data.shard_path(shard_dir, 0), data.shard_path(str(root / "data"), 0))
    os.makedirs(root / "extra")  # shard 2: the held-out shard's prompts under another index
    shutil.copy(data.shard_path(shard_dir, 0), data.shard_path(str(root / "extra"), 2))
    c = _config(str(root / "data"), root / "run", "feature", steps=20)
    c.data.extra_train_dirs = (str(root / "extra"),)
    return c

  def grow(c, index, like):
    shutil.copy(data.shard_path(shard_dir, like),
                data.shard_path(c.data.extra_train_dirs[0], index))

  c = run_dirs(tmp_path / "a")
  said = []
  live = train.Trainer(c, target, log=said.append)
  whole = live.train(num_steps=5)
  grow(c, 1, like=2)
  whole += live.train()
  assert int(live.state["num_shards"]) == 4 and live.pool.num_dropped == 6
  assert any(line.startswith("left out 6 training sequences") for line in said)
  c = run_dirs(tmp_path / "b")
  first = train.Trainer(c, target, log=_quiet)
  part = first.train(num_steps=5)
  grow(c, 1, like=2)
  part += first.train(num_steps=10)
  del first
  grow(c, 0, like=1)  # sorts first: a count alone would now name other shards
  resumed = train.Trainer(c, target, log=_quiet)
  assert resumed.step == 15
  np.testing.assert_allclose(part + resumed.train(), whole, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def base_draft(target, shard_dir, tmp_path_factory):
  """(trainer, folder): a feature draft trained 5 steps and exported to a draft folder."""
  root = tmp_path_factory.mktemp("base")
  base = train.Trainer(_config(shard_dir, root / "run", "feature", steps=5), target, log=_quiet)
  base.train()
  base.export(str(root / "draft"))
  return base, str(root / "draft")


def _from_folder(shard_dir, workdir, kind, steps, folder):
  c = _config(shard_dir, workdir, kind, steps=steps)
  c.train.init_from = folder
  return c


def test_fine_tune_starts_from_a_draft_folder(target, shard_dir, tmp_path, base_draft):
  base, folder = base_draft
  c = _from_folder(shard_dir, tmp_path / "ft", "independent", 7, folder)
  tuned = train.Trainer(c, target, log=_quiet)
  assert tuned.draft == base.draft  # the architecture comes from the folder
  # The folder stores float16.
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(
      a, np.asarray(b, np.float32).astype(np.float16).astype(np.float32)),
               tuned.state["params"], base.state["params"])
  np.testing.assert_array_equal(tuned.vocab_ids, base.vocab_ids)
  assert len(tuned.train()) == 7
  tuned.export(str(tmp_path / "tuned"))
  recipe = artifacts.read_draft(str(tmp_path / "tuned"))[3]["recipe"]
  assert recipe["init_from"] == folder and recipe["loss"] == c.train.loss


def test_argmax_weight_adds_the_greedy_cross_entropy(base_draft):
  base, _ = base_draft
  batch = base.batch_for_step(0)
  params = {"train": base.state["params"], "frozen": base.frozen}
  loss_name, feature_weight, unroll, _ = base.hp
  losses_by_weight = [float(train._metrics_and_loss(
      base.state["params"], base.frozen, batch, draft=base.draft,
      hp=(loss_name, feature_weight, unroll, w))[0]) for w in (0.0, 0.5)]
  logits, _ = base.draft.train_forward(params, batch["tokens_bw"], batch["features_bwd"],
                                       unroll=unroll)
  argmax_ce = distill_losses.distill_terms(logits, batch["topk_kept_bwk"],
                                           batch["topk_logp_bwk"])["argmax_ce"]
  mask = jnp.broadcast_to(batch["weight_bw"][None], argmax_ce.shape)
  expected = float(distill_losses.masked_mean(argmax_ce, mask))
  assert expected > 0.1
  np.testing.assert_allclose(losses_by_weight[1] - losses_by_weight[0], 0.5 * expected,
                             rtol=1e-4)
  bad = _tiny_config()
  bad.train.argmax_weight = -0.5
  with pytest.raises(ValueError, match="train.argmax_weight=-0.5"):
    train.validate(bad)


def test_held_out_acceptance_scores_generated_positions_only(base_draft):
  """prompt_weight = 1 weighs prompt positions like generated ones in the loss; accept1 and
  top11, which pick the exported best, still score the generated positions only."""
  base, _ = base_draft
  batch = batches.window_batch(base.pool.sequences, np.random.default_rng(0), 16,
                               base.config.train.window, base.kept_index, 1.0)
  generated = batch["generated_bw"]
  assert ((batch["weight_bw"] == 1.0) & (generated == 0.0)).any()  # prompt positions
  _, metrics = train._metrics_and_loss(base.state["params"], base.frozen, batch,
                                       draft=base.draft, hp=base.hp)
  params = {"train": base.state["params"], "frozen": base.frozen}
  logits, _ = base.draft.train_forward(params, batch["tokens_bw"], batch["features_bwd"],
                                       unroll=base.hp[2])
  terms = distill_losses.distill_terms(logits, batch["topk_kept_bwk"], batch["topk_logp_bwk"])
  for name, term in (("accept1", "accept"), ("top11", "top1")):
    want = distill_losses.masked_mean(terms[term][0], jnp.asarray(generated))
    np.testing.assert_allclose(metrics[name], want, rtol=1e-5)


def test_a_torn_or_half_swapped_best_draft_does_not_stop_a_resume(target, shard_dir,
                                                                   tmp_path):
  c = _config(shard_dir, tmp_path, "feature", steps=2)
  c.train.eval_every = 2
  train.Trainer(c, target, log=_quiet).train()  # exports best at step 2
  best = tmp_path / "best"
  assert not os.path.exists(f"{best}.new") and not os.path.exists(f"{best}.old")
  text = (best / "draft.json").read_text()
  (best / "draft.json").write_text(text[:len(text) // 2])  # a kill mid-write
  said = []
  c.train.steps = 4
  resumed = train.Trainer(c, target, log=said.append)
  assert resumed.best == -1.0 and any("unreadable best draft" in line for line in said)
  resumed.train()  # the step-4 evaluation replaces the torn best
  assert artifacts.read_draft(str(best))[3]["step"] == 4
  # A kill between save_draft_swapped's two renames: readers take the old draft, and the
  # next run puts it back whole.
  os.rename(best, f"{best}.old")
  os.makedirs(f"{best}.new")
  assert artifacts.swapped_folder(str(best)) == f"{best}.old"
  assert train.Trainer(c, target, log=_quiet).best == resumed.best
  assert artifacts.read_draft(str(best))[3]["step"] == 4
  assert not os.path.exists(f"{best}.new") and not os.path.exists(f"{best}.old")


def test_select_by_picks_the_held_out_metric_that_scores(target, shard_dir, tmp_path,
                                                          base_draft):
  """train.select_by: the held-out score (which picks the exported best) is the mean of the
  named metric over the held-out shards; a resumed run keeps a best chosen by its own
  metric only; an unknown name is rejected."""
  base, _ = base_draft
  scores = {}
  for metric in train.SELECT_BY:
    c = base.config.copy_and_resolve_references()
    c.train.select_by = metric
    results = train.evaluate(c, base.draft, base.state["params"], base.frozen,
                             base.kept_index, base.hp)
    per_shard = [r for name, r in results.items() if name != "score"]
    assert len(per_shard) == len(c.train.eval_shards)
    np.testing.assert_allclose(results["score"], np.mean([r[metric] for r in per_shard]),
                               rtol=1e-6)
    scores[metric] = results["score"]
  assert scores["accept1"] != scores["top11"]  # the two metrics differ on these shards
  c = _config(shard_dir, tmp_path / "select", "feature", steps=2)
  c.train.eval_every = 2
  run = train.Trainer(c, target, log=_quiet)
  run.train()  # evaluates at step 2 and exports its best by accept1
  assert run.best == pytest.approx(run.evaluate()["score"])
  c.train.select_by = "top11"
  assert train.Trainer(c, target, log=_quiet).best == -1.0  # replaced at the next evaluation
  c.train.select_by = "accept1"
  assert train.Trainer(c, target, log=_quiet).best == run.best
  bad = _tiny_config()
  bad.train.select_by = "accept"
  with pytest.raises(ValueError, match="train.select_by='accept'.*accept1"):
    train.validate(bad)


def test_fine_tune_can_choose_its_vocabulary_anew(target, shard_dir, tmp_path, base_draft):
  """reselect_vocab: the kept ids come from the training shards, in the configured number."""
  base, folder = base_draft
  c = _from_folder(shard_dir, tmp_path / "revocab", "feature", 3, folder)
  c.train.reselect_vocab = True
  c.draft.vocab_keep = len(base.vocab_ids) + 8
  tuned = train.Trainer(c, target, log=_quiet)
  tuned.pool.use(tuned.pool.available())
  want, _ = batches.choose_vocab(tuned.pool.sequences, c.draft.vocab_keep,
                                 target.config.vocab_size, c.train.prompt_weight)
  np.testing.assert_array_equal(tuned.vocab_ids, want)
  assert len(tuned.vocab_ids) == len(base.vocab_ids) + 8
  np.testing.assert_array_equal(tuned.frozen["head_embed"],
                                np.asarray(target.params["embed"])[want])
  assert len(tuned.train()) == 3
  tuned.export(str(tmp_path / "revocab_draft"))
  _, _, vocab, meta = artifacts.read_draft(str(tmp_path / "revocab_draft"))
  np.testing.assert_array_equal(vocab, want)
  assert meta["recipe"]["reselect_vocab"] is True


def test_shrunk_draft_keeps_its_heaviest_ids(target, shard_dir, tmp_path, base_draft):
  """shrink_vocab: half the draft's ids, those of most target mass on the training shards; the
  trainable parameters are the folder's; bad sizes and a missing folder are named."""
  base, folder = base_draft
  c = _from_folder(shard_dir, tmp_path / "shrink", "feature", 0, folder)
  c.mode, c.export_dir = "shrink_vocab", str(tmp_path / "small")
  c.draft.vocab_keep = len(base.vocab_ids) // 2
  _fake_draft_folder(tmp_path / "small", "old", gate=True)  # a draft it replaces
  results = train.shrink_vocab(c, target, log=_quiet)
  assert not os.path.exists(os.path.join(c.export_dir, copy_gate.GATE_FILE))
  _, params, ids, meta = artifacts.read_draft(c.export_dir)
  assert len(ids) == c.draft.vocab_keep and set(ids.tolist()) <= set(base.vocab_ids.tolist())
  mass = np.zeros(VOCAB)
  pool = batches.ShardPool(shard_dir, tuple(c.train.eval_shards))
  pool.use(pool.available())
  for s in pool.sequences:
    weights = batches.position_weights(s, c.train.prompt_weight)[:, None]
    np.add.at(mass, s.topk_ids.astype(int).ravel(), (np.exp(s.topk_logp) * weights).ravel())
  dropped = sorted(set(base.vocab_ids.tolist()) - set(ids.tolist()))
  ranked = [i for i in ids.tolist() if i > 2]  # 0-2 are always kept
  assert min(mass[ranked]) >= max(mass[dropped])
  _, base_params, _, _ = artifacts.read_draft(folder)
  jax.tree.map(np.testing.assert_array_equal, params, base_params)
  assert meta["recipe"]["mode"] == "shrink_vocab" and meta["eval"]["score"] == results["score"]
  assert 0.0 <= results["score"] <= 1.0
  c.draft.vocab_keep = len(base.vocab_ids) + 1
  with pytest.raises(ValueError, match=f"draft.vocab_keep={c.draft.vocab_keep}"):
    train.shrink_vocab(c, target, log=_quiet)
  c.train.init_from = ""
  with pytest.raises(ValueError, match="train.init_from"):
    train.validate(c)


def test_grown_draft_starts_as_the_trained_one(target, shard_dir, tmp_path, base_draft):
  """grow_layers appends identity layers: same logits and features at step 0, then trains."""
  base, folder = base_draft
  c = _from_folder(shard_dir, tmp_path / "grown", "feature", 4, folder)
  c.train.grow_layers = 2
  grown = train.Trainer(c, target, log=_quiet)
  assert grown.draft.config.num_layers == base.draft.config.num_layers + 2
  folder_draft, folder_params = artifacts.load_draft_folder(folder, target)
  tokens = jnp.asarray([[3, 9, 4, 1, 7, 2]])
  hidden, _ = transformer.forward_hidden(target.params, target.config, tokens)
  feats = jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))
  want = folder_draft.train_forward(folder_params, tokens, feats, unroll=2)
  got = grown.draft.train_forward({"train": grown.state["params"], "frozen": grown.frozen},
                                  tokens, feats, unroll=2)
  for w, g in zip(want, got):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  losses = grown.train()
  assert len(losses) == 4 and np.all(np.isfinite(losses))
  assert np.any(np.asarray(grown.state["params"]["layers"]["o"][-1]) != 0)  # it learns
  grown.export(str(tmp_path / "grown_draft"))
  reloaded, _ = artifacts.load_draft_folder(str(tmp_path / "grown_draft"), target)
  assert reloaded.config.num_layers == base.draft.config.num_layers + 2
  c = _config(shard_dir, tmp_path / "bad", "feature")
  c.train.grow_layers = 1  # without init_from there is nothing to grow
  with pytest.raises(ValueError, match="train.grow_layers=1"):
    train.Trainer(c, target, log=_quiet)


def test_training_waits_for_shards_and_says_how_to_write_them(target, tmp_path, monkeypatch):
  (tmp_path / "shards").mkdir()
  said, sleeps = [], []

  def sleep(seconds):  # the second wait ends the test: no data job is writing
    sleeps.append(seconds)
    if len(sleeps) == 2:
      raise TimeoutError

  monkeypatch.setattr(train.time, "sleep", sleep)
  with pytest.raises(TimeoutError):
    train.Trainer(_config(str(tmp_path / "shards"), tmp_path / "run", "feature"), target,
                  log=said.append)
  waits = [line for line in said if line.startswith("waiting for")]
  assert len(waits) == 2 and "(have 0)" in waits[0]
  assert "--config.mode=data" in waits[0] and "--config.mode=data" not in waits[1]


def test_windows_and_vocab():
  rng = np.random.default_rng(0)
  seq = batches.Sequence(tokens=np.arange(10, dtype=np.int32), prompt_length=4,
                         hidden=rng.normal(size=(10, 3)).astype(np.float16),
                         topk_ids=np.tile(np.arange(2, dtype=np.uint16), (10, 1)),
                         topk_logp=np.log(np.full((10, 2), 0.5)).astype(np.float16), source="")
  ids, coverage = batches.choose_vocab([seq], 3, 12)
  assert coverage == pytest.approx(1.0) and 0 in ids and 1 in ids
  # Prompt positions count prompt_weight times: id 5 fills the prompt, id 7 the continuation.
  ids_57 = np.where(np.arange(10)[:, None] + 1 < 4, 5, 7).astype(np.uint16)
  seq_57 = dataclasses.replace(seq, topk_ids=np.concatenate([ids_57, ids_57], axis=1))
  assert batches.choose_vocab([seq_57], 1, 12, always=())[0].tolist() == [7]
  ids, coverage = batches.choose_vocab([seq_57], 1, 12, prompt_weight=3.0, always=())
  assert ids.tolist() == [5] and coverage == pytest.approx(9 / 16)
  # candidates: the heaviest of the given ids only.
  assert batches.choose_vocab([seq_57], 1, 12, always=(), candidates=[7])[0].tolist() == [7]
  batch = batches.window_batch([seq], rng, 2, 16, batches.kept_index(ids, 12), 0.25)
  row = batch["tokens_bw"][0]
  assert row[:10].tolist() == list(range(10))
  np.testing.assert_allclose(batch["features_bwd"][0, 1:10], seq.hidden[:9].astype(np.float32))
  assert (batch["features_bwd"][0, 0] == 0).all()
  assert batch["weight_bw"][0].tolist() == [0.25] * 3 + [1.0] * 6 + [0.0] * 7
  assert batch["generated_bw"][0].tolist() == [0.0] * 3 + [1.0] * 6 + [0.0] * 7
  batch = batches.window_batch([seq], rng, 2, 16, batches.kept_index(ids, 12), 1.0)
  assert batch["weight_bw"][0].tolist() == [1.0] * 9 + [0.0] * 7
  assert batch["generated_bw"][0].tolist() == [0.0] * 3 + [1.0] * 6 + [0.0] * 7


class _WordTokenizer:
  """Whitespace words hashed into the tiny vocabulary, with a one-line chat template."""
  chat_template = "user-turn"
  name_or_path = "words"

  def apply_chat_template(self, messages, add_generation_prompt, tokenize):
    del add_generation_prompt, tokenize
    return "<user> " + messages[0]["content"] + " <assistant>"

  def encode(self, text, add_special_tokens=True):
    del add_special_tokens
    return [3 + zlib.crc32(w.encode()) % (VOCAB - 3) for w in text.split()]

  def __call__(self, text, add_special_tokens=True):
    return {"input_ids": self.encode(text, add_special_tokens)}


def _data_config(tmp_path, **overrides):
  c = _tiny_config().data
  c.dir = str(tmp_path / "shards")
  c.continuation = "target"
  c.continuations_dir = str(tmp_path / "ids")
  c.max_chars = 300
  c.pattern = ("gsm8k", "cnndm")
  for key, value in overrides.items():
    c[key] = value
  return c


def _no_generation(*args, **kwargs):
  raise AssertionError("the target generated although the ids were kept")


def test_kept_continuations_rebuild_lost_shards(target, tmp_path, monkeypatch):
  tok, lines = _WordTokenizer(), []
  c = _data_config(tmp_path)
  assert data.generate(c, target, c.dir, log=lines.append, tokenizer=tok) == 3
  assert continuations.count(c.continuations_dir) == 3
  first = [dict(np.load(data.shard_path(c.dir, i))) for i in range(3)]
  assert float(first[1]["temperature"]) == 1.0 and float(first[2]["temperature"]) == 0.0
  for i in (1, 2):
    os.remove(data.shard_path(c.dir, i))
  monkeypatch.setattr(data, "target_continuations", _no_generation)
  lines.clear()
  assert data.generate(c, target, c.dir, log=lines.append, tokenizer=tok) == 3
  assert sum("kept ids" in line for line in lines) == 2
  for i in range(3):
    again = np.load(data.shard_path(c.dir, i))
    for key in ("tokens", "lengths", "prompt_lengths", "topk_ids", "temperature"):
      np.testing.assert_array_equal(again[key], first[i][key])
    np.testing.assert_allclose(again["hidden"], first[i]["hidden"], atol=1e-3)
  # The ids continue this plan's prompts only: a changed plan is refused, not mispaired.
  os.remove(data.shard_path(c.dir, 0))
  with pytest.raises(ValueError, match="other prompts than shard 0"):
    data.generate(_data_config(tmp_path, seed=c.seed + 1), target, c.dir, log=_quiet,
                  tokenizer=tok)


def test_ids_only_then_shards_and_backfill(target, tmp_path, monkeypatch):
  tok = _WordTokenizer()
  # Shards written before ids were kept get their ids read back from the shards.
  plain = _data_config(tmp_path, dir=str(tmp_path / "plain"), continuations_dir="",
                       num_shards=2)
  data.generate(plain, target, plain.dir, log=_quiet, tokenizer=tok)
  plain.continuations_dir, lines = str(tmp_path / "backfilled"), []
  data.generate(plain, target, plain.dir, log=lines.append, tokenizer=tok)
  assert sum("ids kept" in line for line in lines) == 2
  prompts, conts = continuations.from_shard(np.load(data.shard_path(plain.dir, 0)))
  assert continuations.load(plain.continuations_dir, 0, prompts, 1.0) == conts
  # Ids only: no shard is written; the same plan and seed give the same continuations.
  c = _data_config(tmp_path, continuations_only=True, num_shards=2)
  assert data.generate(c, target, c.dir, log=_quiet, tokenizer=tok) == 0
  assert continuations.count(c.continuations_dir) == 2
  assert continuations.load(c.continuations_dir, 0, prompts, 1.0) == conts
  assert all(len(k) == c.max_new_tokens for k in conts)  # the tiny target has no EOS
  # Then the shards, from the ids alone.
  monkeypatch.setattr(data, "target_continuations", _no_generation)
  c.continuations_only = False
  assert data.generate(c, target, c.dir, log=_quiet, tokenizer=tok) == 2
  np.testing.assert_array_equal(np.load(data.shard_path(c.dir, 1))["tokens"],
                                np.load(data.shard_path(plain.dir, 1))["tokens"])


def test_reference_shards_teacher_force_the_datasets_answers(target, tmp_path, monkeypatch):
  """continuation='reference' (the shipped recipe's default): nothing is generated; each
  record is its prompt then its reference answer's tokens, cut to its source's
  max_new_tokens, then the target's first EOS id; the shard holds the target's top-k
  log-probs and hidden states of one pass over those tokens, and temperature -1."""
  tok = _WordTokenizer()
  monkeypatch.setattr(data, "target_continuations", _no_generation)
  eos_target = LoadedModel(dataclasses.replace(target.config, eos_token_ids=(61, 62)),
                           target.params, "tiny", "")
  # GSM8K answers whole, CNN/DM highlights cut to 12 words.
  c = _data_config(tmp_path, continuation="reference", continuations_dir="", num_shards=2,
                   max_new_tokens=400, max_new_tokens_cnndm=12)
  assert data.generate(c, eos_target, c.dir, log=_quiet, tokenizer=tok) == 2
  answers = {}
  for path in c.gsm8k_path:
    with open(data.resolve_path(path)) as f:
      answers.update((r["question"], r["answer"]) for r in map(json.loads, f))
  plan = data.data_plan(c)
  for index, source in enumerate(("gsm8k", "cnndm")):
    shard = dict(np.load(data.shard_path(c.dir, index)))
    assert plan[index][0] == source and float(shard["temperature"]) == -1.0
    assert shard["tokens"].shape[0] == len(plan[index][1]) == c.batch
    for row, (text, reference) in enumerate(plan[index][1]):
      prompt = encode_prompt(tok, text, chat=True)
      words = tok.encode(reference)
      if source == "gsm8k":  # the answer format the prompt asks for, whole
        question = text.split("Question: ", 1)[1].rsplit("\nAnswer:", 1)[0]
        final = answers[question].rsplit("####", 1)[1].strip()
        assert words[-4:] == tok.encode(f"The answer is {final}.")
        assert len(words) <= c.max_new_tokens
      else:
        assert len(words) > c.max_new_tokens_cnndm
        words = words[:c.max_new_tokens_cnndm]
      n = int(shard["lengths"][row])
      assert int(shard["prompt_lengths"][row]) == len(prompt)
      assert shard["tokens"][row, :n].tolist() == prompt + words + [61]
      assert not shard["tokens"][row, n:].any()
    # The target's top-k at every position of one causal pass over the records.
    logits, hidden, _ = transformer.forward_jit(target.params, target.config,
                                                jnp.asarray(shard["tokens"]))
    logp_k, ids_k = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), c.top_k)
    valid = np.arange(shard["tokens"].shape[1])[None, :] < shard["lengths"][:, None]
    np.testing.assert_array_equal(shard["topk_ids"][valid], np.asarray(ids_k)[valid])
    np.testing.assert_allclose(shard["topk_logp"][valid].astype(np.float32),
                               np.asarray(logp_k)[valid], atol=1e-2, rtol=1e-3)
    np.testing.assert_allclose(shard["hidden"][valid].astype(np.float32),
                               np.asarray(hidden)[valid], atol=1e-2, rtol=1e-2)


def test_copying_draft_feeds_its_history_like_the_loop(target):
  """Prefill chunks, a roll-back and single proposals: the history holds every token at its
  position, and the logits are the inner draft's blended with the lookup on it."""
  inner, params = _draft("feature", target)
  gate = _eager_gate(target)
  draft = context_copy.ContextCopyDraft(inner, gate)
  prompt = jnp.asarray([[5, 6, 7, 5, 6, 9, 5, 6]])
  features = jax.random.normal(jax.random.PRNGKey(3), (1, 8, target.config.hidden_size))
  cache = draft.init_cache(params, 1, 16)
  inner_cache = inner.init_cache(params, 1, 16)
  _, _, cache = draft.forward(params, prompt[:, :6], cache, features[:, :6])
  cache = cache.with_lengths(jnp.asarray([5]))  # roll back one token, as a round does
  logits, _, cache = draft.forward(params, prompt[:, 5:8], cache, features[:, 5:8])
  _, _, inner_cache = inner.forward(params, prompt[:, :5], inner_cache, features[:, :5])
  inner_logits, inner_hidden, _ = inner.forward(params, prompt[:, 5:8], inner_cache,
                                                features[:, 5:8])
  np.testing.assert_array_equal(np.asarray(cache.history_bs[0, :8]), np.asarray(prompt[0]))
  want = context_copy.copy_logits(gate, inner_logits, inner_hidden, prompt,
                                  jnp.arange(5, 8)[None], proposing=False)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)
  # "5 6" occurred twice before position 7, the latest followed by 9: the copy token.
  assert int(jnp.argmax(logits[0, -1])) == 9
  proposal, _, cache = draft.forward(params, jnp.asarray([[9]]), cache, None)
  assert int(cache.history_bs[0, 8]) == 9 and int(cache.lengths_b[0]) == 9
  assert int(jnp.argmax(proposal[0, 0])) == 5  # "6 9" -> 5, as after position 5


@pytest.mark.parametrize("name", ["lm", "independent", "feature", "copying"])
def test_last_only_gives_the_last_tokens_logits(target, name):
  """`last_only` (a round's first draft call feeds two tokens and reads one law) returns
  the last fed token's logits of a full call, with the same hidden states and cache."""
  if name == "lm":
    draft, params = drafts.LMDraft(target.config), target.params
  else:
    draft, params = _draft("independent" if name == "independent" else "feature", target)
    if name == "copying":
      draft = context_copy.ContextCopyDraft(draft, _eager_gate(target))
  prompt = jnp.asarray([[5, 6, 7, 5, 6, 9, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2]])
  features = jax.random.normal(jax.random.PRNGKey(5), (2, 8, target.config.hidden_size))
  _, _, cache = draft.forward(params, prompt[:, :5], draft.init_cache(params, 2, 16),
                              features[:, :5])
  full = draft.forward(params, prompt[:, 5:], cache, features[:, 5:])
  last = draft.forward(params, prompt[:, 5:], cache, features[:, 5:], last_only=True)
  assert last[0].shape == (2, 1, VOCAB)
  np.testing.assert_allclose(np.asarray(last[0][:, 0]), np.asarray(full[0][:, -1]),
                             rtol=1e-6, atol=1e-6)
  for got, want in zip(jax.tree.leaves(last[1:]), jax.tree.leaves(full[1:])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_copying_draft_sets_proposing_only_on_its_own_proposals(target):
  """The gate's 'proposing' feature is on exactly when no target features come with the
  tokens (drafting step 2 on): a gate reading only it copies on proposals alone."""
  inner, params = _draft("feature", target)
  weights = [0.0] * (2 + len(context_copy.SCALAR_FEATURES) + target.config.hidden_size)
  weights[2 + context_copy.SCALAR_FEATURES.index("proposing")] = 10.0
  draft = context_copy.ContextCopyDraft(inner, context_copy.CopyGate(2, tuple(weights), -5.0))
  prompt = jnp.asarray([[5, 6, 7, 5, 6]])
  features = jax.random.normal(jax.random.PRNGKey(4), (1, 5, target.config.hidden_size))
  fed, _, cache = draft.forward(params, prompt, draft.init_cache(params, 1, 16), features)
  inner_fed, _, _ = inner.forward(params, prompt, inner.init_cache(params, 1, 16), features)
  # Fed with target features: lam = 0.95 sigmoid(-5) ~ 0.006 on the copy token 7.
  np.testing.assert_allclose(np.asarray(jax.nn.softmax(fed[0, -1]))[7],
                             np.asarray(jax.nn.softmax(inner_fed[0, -1]))[7], atol=0.01)
  # A proposal: lam = 0.95 sigmoid(5) ~ 0.94 on the copy token ("6 7" -> 5).
  proposal, _, _ = draft.forward(params, jnp.asarray([[7]]), cache, None)
  assert float(jax.nn.softmax(proposal[0, 0])[5]) > 0.9


def test_copy_gate_fit_learns_where_copying_pays():
  """Synthetic curves: where the 'all_agree' feature is on, acceptance rises with lam (best
  at 0.9); where it is off, it falls. The fitted probe must copy hard on the first and
  hardly at all on the second, and beat lam = 0."""
  lams = np.round(np.arange(0, 0.951, 0.05), 2)
  rng = np.random.default_rng(0)
  agree_column = 1 + context_copy.SCALAR_FEATURES.index("all_agree")  # after n = 1

  def task(size):
    features = np.zeros((size, 1, 1 + len(context_copy.SCALAR_FEATURES) + 2), np.float32)
    features[:, 0, 0] = 1  # n = 1 everywhere
    agree = rng.random(size) < 0.5
    features[:, 0, agree_column] = agree
    features[:, 0, -2:] = rng.normal(size=(size, 2))  # hidden noise
    rising = 0.3 + 0.4 * lams - 0.2 * np.maximum(lams - 0.9, 0) * 20
    falling = 0.5 - 0.4 * lams
    curves = np.where(agree[:, None], rising, falling)[:, None]
    return curves, features, np.ones(size, np.int32), agree

  a, b = task(60), task(20)
  gate, report = copy_gate.fit({"a": a[:3], "b": b[:3]}, lams, max_ngram=1, max_lam=0.95,
                               l2=0.0, steps=800, learning_rate=0.05, log=_quiet)
  for curves, features, length, agree in (a, b):
    lam = np.asarray(gate.weight(jnp.asarray(features[:, 0]), jnp.asarray(length)))
    assert lam[agree].min() > 0.75 and lam[~agree].max() < 0.1
  for name, (curves, _, _, agree) in (("a", a), ("b", b)):
    best = np.where(agree, curves[:, 0].max(-1), curves[:, 0, 0]).mean()
    assert report[name]["accept_without"] == pytest.approx(curves[..., 0].mean())
    assert report[name]["accept_without"] + 0.05 < report[name]["accept_with"] <= best + 1e-6
    assert len(report[name]["accept_with_by_step"]) == 1
  with pytest.raises(ValueError, match="lam grid must be"):
    copy_gate.fit({"a": a[:3]}, lams[1:], 1, 0.95, log=_quiet)
  with pytest.raises(ValueError, match="below max_lam"):
    copy_gate.fit({"a": a[:3]}, lams[:-2], 1, 0.95, log=_quiet)


def test_read_gate_names_bad_and_old_gate_files(tmp_path):
  path = tmp_path / copy_gate.GATE_FILE
  path.write_text(json.dumps({"q_edges": [0.1], "lambdas": [[0.0, 0.0], [0.5, 0.2]]}))
  with pytest.raises(ValueError, match="old table gate.*fit_copy_gate"):
    copy_gate.read_gate(str(tmp_path))
  path.write_text(json.dumps({"max_ngram": 2, "bias": 0.0, "max_lam": 0.9}))
  with pytest.raises(ValueError, match="copy_gate.json is not a valid copy gate.*weights"):
    copy_gate.read_gate(str(tmp_path))
  gate = context_copy.CopyGate.by_length((0.2, 0.4), hidden_size=3)
  copy_gate.save_gate(str(tmp_path), gate, {"note": 1})
  assert copy_gate.read_gate(str(tmp_path)) == gate


def test_fit_copy_gate_mode_writes_a_copying_draft_folder(target, tmp_path, monkeypatch,
                                                          base_draft):
  tok = _WordTokenizer()
  c = _tiny_config()
  c.data = _data_config(tmp_path, num_shards=2, continuations_only=True)
  data.generate(c.data, target, c.data.dir, log=_quiet, tokenizer=tok)
  monkeypatch.setattr(data, "target_continuations", _no_generation)
  c.mode, c.train.init_from, c.export_dir = "fit_copy_gate", base_draft[1], str(tmp_path / "out")
  c.copy.shards, c.copy.max_ngram, c.copy.fit_steps = (0, 1), 3, 50
  train.validate(c)
  report = copy_gate.run(c, target, log=_quiet, tokenizer=tok)
  assert set(report) == {"gsm8k", "cnndm"}
  for row in report.values():
    assert row["positions"] > 0 and 0 < row["accept_without"] < 1
    assert len(row["accept_with_by_step"]) == c.copy.unroll
  draft, _ = artifacts.load_draft_folder(c.export_dir, target)
  assert isinstance(draft, context_copy.ContextCopyDraft) and draft.gate.max_ngram == 3
  plain, _ = artifacts.load_draft_folder(c.export_dir, target, copy=False)
  assert isinstance(plain, architectures.DistilledDraft)
  from diversed_jax.speculative import build  # the user-facing specs
  assert isinstance(build.load_draft(c.export_dir, target)[0], context_copy.ContextCopyDraft)
  no_copy, _, spec = build.load_draft("nocopy:" + c.export_dir, target)
  assert isinstance(no_copy, architectures.DistilledDraft) and spec.startswith("nocopy:")
  with pytest.raises(ValueError, match="needs a distilled draft folder"):
    build.load_draft("nocopy:self:1", target)
  assert not os.path.exists(os.path.join(base_draft[1], copy_gate.GATE_FILE))
  c.copy.shards = ()
  with pytest.raises(ValueError, match="config.copy.shards"):
    train.validate(c)
  c.copy.shards, c.copy.max_lam = (0,), 0.93
  with pytest.raises(ValueError, match="config.copy.max_lam=0.93.*multiple"):
    train.validate(c)


def test_kept_ids_need_target_continuations(tmp_path):
  c = _tiny_config()
  c.data.continuations_dir = str(tmp_path)
  with pytest.raises(ValueError, match="data.continuations_dir.*continuation='target'"):
    train.validate(c)
  c.data.continuations_dir, c.data.continuations_only = "", True
  with pytest.raises(ValueError, match="data.continuations_only.*need data.continuations_dir"):
    train.validate(c)

@pytest.mark.parametrize("field, value, message", [
    ("copy.lam_step", 0.0, r"copy.lam_step=0.0 is invalid"),
    ("copy.max_lam", 1.2, r"copy.max_lam=1.2 is invalid"),
    ("copy.lam_step", 0.5, r"copy.lam_step=0.5 is invalid: at most copy.max_lam"),
    ("train.rescan_every", 0, r"train.rescan_every=0 is invalid"),
    ("train.log_every", 0, r"train.log_every=0 is invalid"),
    ("data.temperatures", (), r"data.temperatures=\(\) is invalid"),
    ("data.temperatures", (1.0, -1.0), r"data.temperatures=\(1.0, -1.0\) is invalid"),
    ("train.mesh_data", 0, r"train.mesh_data=0 is invalid: -1 \(all devices\)"),
])
def test_validate_names_the_bad_field(field, value, message):
  c = _tiny_config()
  c.copy.max_lam = 0.45 if value == 0.5 else c.copy.max_lam
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(ValueError, match=message):
    train.validate(c)


def test_more_mesh_devices_than_visible_are_refused_before_loading():
  c = _tiny_config()
  assert train.step_mesh(c.train) is None  # the test process: one device
  c.train.mesh_data = 2
  with pytest.raises(ValueError, match=r"config.train.mesh_data=2: only 1 devices"):
    train.step_mesh(c.train)


def test_feature_draft_takes_the_target_layers_geometry():
  """The copied layers fix heads, head width and MLP width: the configured ones (9 heads of
  7 for a 64-wide target of 8 heads of 8) cannot regroup them."""
  target_config = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=64, num_layers=2,
                              num_heads=8, num_kv_heads=2, head_dim=8, intermediate_size=96)
  target_params = init_params(target_config, jax.random.PRNGKey(0))
  cfg = architectures.draft_config("feature", target_config, 1, 576, 9, 3, 1536)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (8, 2, 8, 96)
  draft = architectures.DistilledDraft("feature", cfg, 64, VOCAB)
  train_params = architectures.init_train_params(draft, jax.random.PRNGKey(1), target_params)
  jax.tree.map(np.testing.assert_array_equal, train_params["layers"]["q"],
               target_params["layers"]["q"][-1:])
  params = {"train": train_params,
            "frozen": architectures.frozen_params(target_params, np.arange(10))}
  logits, _ = draft.train_forward(params, jnp.ones((1, 4), jnp.int32), jnp.zeros((1, 4, 64)))
  assert np.isfinite(np.asarray(logits)).all()
  regrouped = dataclasses.replace(draft, config=dataclasses.replace(cfg, num_heads=4,
                                                                     head_dim=16))
  with pytest.raises(ValueError, match="does not match the target layers"):
    architectures.init_train_params(regrouped, jax.random.PRNGKey(1), target_params)
  independent = architectures.draft_config("independent", target_config, 1, 48, 6, 2, 80)
  assert (independent.num_heads, independent.head_dim, independent.intermediate_size) == \
      (6, 8, 80)


def _fake_draft_folder(folder, params_text, gate=False):
  os.makedirs(folder, exist_ok=True)
  for name in artifacts.SAVED_FILES:
    (folder / name).write_text(params_text if name == "params.npz" else name)
  if gate:
    (folder / copy_gate.GATE_FILE).write_text("{}")


def test_export_replaces_a_draft_folder_and_refuses_other_folders(tmp_path):
  """The best draft replaces every draft file of the destination: a copy gate fitted for the
  old params is removed, not left to wrap the new ones."""
  c = _tiny_config()
  c.mode, c.workdir, c.export_dir = "export", str(tmp_path / "run"), str(tmp_path / "shipped")
  _fake_draft_folder(tmp_path / "run" / "best", "new")
  _fake_draft_folder(tmp_path / "shipped", "old", gate=True)
  (tmp_path / "shipped" / "NOTES.md").write_text("kept")
  train.run(c)
  assert sorted(os.listdir(c.export_dir)) == sorted(["NOTES.md", *artifacts.SAVED_FILES])
  assert (tmp_path / "shipped" / "params.npz").read_text() == "new"
  log = (tmp_path / "run" / "log.txt").read_text()
  assert f"removed {tmp_path / 'shipped' / copy_gate.GATE_FILE}" in log
  c.export_dir = str(tmp_path)  # holds files, and no draft: a mistyped path
  with pytest.raises(ValueError, match="holds files and is not a draft folder"):
    train.run(c)
  c.export_dir = str(tmp_path / "new")
  train.run(c)
  assert sorted(os.listdir(c.export_dir)) == sorted(artifacts.SAVED_FILES)


def test_held_out_shards_are_named_by_their_plan_source(target, shard_dir, tmp_path):
  """Once CNN/DM runs out the plan goes on with GSM8K alone: a held-out shard there is a
  GSM8K shard whatever its place in the pattern."""
  c = _tiny_config()
  plan = data.data_plan(c.data)
  cnndm = [i for i, (source, _) in enumerate(plan) if source == "cnndm"]
  late = cnndm[-1] + 2  # the pattern says cnndm here; the plan, gsm8k
  assert c.data.pattern[late % len(c.data.pattern)] == "cnndm" and plan[late][0] == "gsm8k"
  c.data.dir = str(tmp_path)
  c.train.eval_shards = (1, late)
  for index in c.train.eval_shards:
    shutil.copy(data.shard_path(shard_dir, 0), data.shard_path(c.data.dir, index))
  names = train.held_out_batches(c, np.arange(VOCAB))
  assert sorted(names) == sorted(["cnndm1", f"gsm8k{late}"])


@pytest.mark.slow
def test_shipped_draft_loads_as_the_default():
  # The shipped draft is tracked in git (diversed_jax/assets/drafts): missing, it was deleted.
  assert artifacts.shipped_draft("smollm2-135m-instruct") is not None, (
      "the shipped draft of smollm2-135m-instruct is missing from diversed_jax/assets")
  from diversed_jax.models.loading import load_model
  from diversed_jax.speculative import build
  model = load_model("smollm2-135m-instruct")
  draft, params, spec = build.load_draft(None, model)
  assert spec == artifacts.shipped_draft("smollm2-135m-instruct")
  # Its recipe's config builds the same draft (layers copied from the target's).
  path = os.path.join(ROOT, "configs", "distill_smollm2.py")
  spec_module = importlib.util.spec_from_file_location("distill_smollm2", path)
  module = importlib.util.module_from_spec(spec_module)
  spec_module.loader.exec_module(module)
  fresh = train._draft_from_config(module.get_config(), model.config)
  assert dataclasses.replace(fresh.config, num_layers=2) == draft.inner.config
  # The shipped folder carries a context-copy gate: the draft comes wrapped with it.
  assert isinstance(draft, context_copy.ContextCopyDraft)
  assert isinstance(draft.inner, architectures.DistilledDraft)
  logits, _, _ = draft.forward(params, jnp.asarray([[1, 2, 3]]), draft.init_cache(params, 1, 8),
                               jnp.zeros((1, 3, model.config.hidden_size)))
  assert logits.shape == (1, 3, model.config.vocab_size)


def test_article_windows_give_new_prompts_from_long_articles(tmp_path):
  article = " ".join(f"Sentence number {i} says something." for i in range(60))  # ~2,000 chars
  assert data.text_window(article, 0, 800) == article[:800].rstrip() + " ..."
  first, second = data.text_window(article, 1, 800), data.text_window(article, 2, 800)
  # A later window starts at a sentence's start at or past its offset, whole sentences on.
  assert first.startswith("Sentence number ") and article.index(first[:40]) >= 800
  assert article.index(second[:40]) >= 1600 and not second.endswith(" ...")
  assert data.text_window(article, 3, 800) is None  # nothing left to fill half a window
  assert data.text_window("Short. Text.", 1, 800) is None
  path = tmp_path / "articles.jsonl"
  path.write_text("\n".join(json.dumps({"article": a, "highlights": "h"})
                            for a in (article, "A short one.")))
  pairs = data.load_prompts("cnndm", str(path), max_chars=800, windows=(1, 2))
  assert [p for p, _ in pairs] == [data.TEMPLATES["cnndm"][0].format(article=w)
                                   for w in (first, second)]
  assert len(data.load_prompts("cnndm", str(path), max_chars=800)) == 2  # window 0 only


def test_article_windows_need_target_continuations(tmp_path):
  c = _tiny_config()
  c.mode, c.data.dir, c.data.cnndm_windows = "data", str(tmp_path), (1, 2)
  with pytest.raises(ValueError, match="cnndm_windows=.*continuation='target'"):
    train.validate(c)
  c.data.continuation = "target"
  train.validate(c)
  c.data.cnndm_windows = (-1,)
  with pytest.raises(ValueError, match=r"cnndm_windows=\(-1,\) is invalid"):
    train.validate(c)
