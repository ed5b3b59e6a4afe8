"""Head training: config, teacher-forced log nu, rollout stats, a tiny end-to-end run,
resume after kill -9, head folders and their registration."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax import run_settings
from diversed_jax.distill import architectures
from diversed_jax.models import transformer
from diversed_jax.rl.head import EnsembleHead, init_head
from diversed_jax.rl.losses import log_nu
from diversed_jax.speculative import build
from diversed_jax.training import config as config_lib
from diversed_jax.training import head_io, toy
from diversed_jax.training.rollouts import RolloutSampler, head_weight_fn, policy_batch
from tests.teacher_forced import teacher_forced_batch
from diversed_jax.training.trainer import (TIMING_KEYS, drop_logged_after, example_order,
                                           train_head)

TEMPERATURE = 0.8


def _random_head(dq, dp, seed=3):
  """A linear head with a non-zero kernel, so w_t varies with the context."""
  module = EnsembleHead(kind="linear", init_weight=0.4)
  params = init_head(module, jax.random.PRNGKey(0), dq, dp)
  kernel = params["params"]["out"]["kernel"]
  params["params"]["out"]["kernel"] = 0.3 * jax.random.normal(jax.random.PRNGKey(seed),
                                                              kernel.shape)
  return module, params


# ---------------------------------------------------------------- config


def test_default_config_validates_and_freezes():
  cfg = config_lib.default_config()
  config_lib.validate(cfg)
  hp = config_lib.HParams.from_config(cfg)
  hash(hp)
  assert hp.batch_rows == cfg.prompts_per_step * cfg.rollouts_per_prompt


@pytest.mark.parametrize("field,value", [
    ("head_kind", "conv"), ("init_weight", 1.0), ("lam", -0.1), ("temperature", 0.0),
    ("advantage", "ppo"), ("warmup_steps", 40), ("rollouts_per_prompt", 1),
    ("num_draft", 0), ("clip_eps", 1.5), ("checkpoint_every", 0), ("lam", float("nan")),
    ("lam", float("inf")), ("weight_decay", float("nan")), ("grad_clip", float("nan")),
    ("learning_rate", float("inf")), ("seed", -1), ("mesh_data", 0), ("mesh_data", -2)])
def test_validate_names_the_bad_field(field, value):
  cfg = config_lib.default_config()
  cfg[field] = value
  with pytest.raises(ValueError, match=f"train.{field}={value!r}"):
    config_lib.validate(cfg)


def test_the_mesh_of_one_device_is_none_and_more_devices_than_visible_are_refused():
  cfg = config_lib.default_config()
  assert config_lib.HParams.from_config(cfg).mesh() is None  # the test process: 1 device
  cfg.mesh_data = 2
  with pytest.raises(ValueError, match=r"train.mesh_data=2: only 1 devices are visible"):
    config_lib.HParams.from_config(cfg).mesh()


def test_example_order_is_a_permutation_per_epoch():
  first = [example_order(i, 7, seed=1) for i in range(7)]
  second = [example_order(i, 7, seed=1) for i in range(7, 14)]
  assert sorted(first) == sorted(second) == list(range(7))
  assert first != second


# ---------------------------------------------------------------- teacher-forced pass


def test_teacher_forced_log_nu_matches_full_distributions():
  target, draft, draft_params = toy.toy_pair()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, toy.VOCAB, n).tolist() for n in (3, 7, 5)]
  generated = [rng.integers(0, toy.VOCAB, n).tolist() for n in (6, 2, 0)]
  num_new = 6
  batch = teacher_forced_batch(target.config, target.params, draft, draft_params, prompts,
                               generated, temperature=TEMPERATURE, num_new=num_new,
                               chunk_rows=2)
  module, params = _random_head(32, 32)
  w_bt = module.apply(params, batch["h_q_btd"], batch["h_p_btd"])
  got = np.asarray(log_nu(w_bt, batch["p_tok_bt"], batch["q_tok_bt"]))
  for b, (prompt, gen) in enumerate(zip(prompts, generated)):
    mask = np.asarray(batch["mask_bt"][b])
    assert mask.sum() == len(gen) and np.all(mask[:len(gen)] == 1)
    if not gen:
      continue
    seq = jnp.asarray([prompt + gen])
    p_logits, h_p, _ = transformer.forward(target.params, target.config, seq)
    q_logits, h_q, _ = draft.forward(draft_params, seq, None)
    at = np.arange(len(prompt) - 1, len(prompt) + len(gen) - 1)
    p_tv = jax.nn.softmax(p_logits[0, at] / TEMPERATURE)
    q_tv = jax.nn.softmax(q_logits[0, at] / TEMPERATURE)
    w_t = module.apply(params, h_q[0, at], h_p[0, at])
    nu_tv = w_t[:, None] * p_tv + (1 - w_t[:, None]) * q_tv
    want = np.log(np.asarray(nu_tv)[np.arange(len(gen)), gen])
    np.testing.assert_allclose(got[b, :len(gen)], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batch["tv_pq_bt"][b, :len(gen)],
                               0.5 * np.abs(p_tv - q_tv).sum(-1), atol=1e-5)
    np.testing.assert_allclose(batch["h_p_btd"][b, :len(gen)], h_p[0, at], atol=1e-5)
  assert np.all(np.asarray(batch["p_tok_bt"]) * (1 - np.asarray(batch["mask_bt"])) == 0)


# ---------------------------------------------------------------- rollouts


def _feature_draft(target):
  """A toy feature (EAGLE-style) draft on the toy target, moved off its init: it drafts a
  round's later positions from its own features and keeps them in its cache."""
  config = architectures.draft_config("feature", target.config, 1, 32, 4, 2, 48)
  draft = architectures.DistilledDraft(kind="feature", config=config, target_hidden=32,
                                       vocab_size=target.config.vocab_size)
  train = architectures.init_train_params(draft, jax.random.PRNGKey(1), target.params)
  train = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(2), x.shape),
                       train)
  frozen = architectures.frozen_params(target.params, np.arange(target.config.vocab_size))
  return draft, {"train": train, "frozen": frozen}


def _committed(stats, b, values_rk, length):
  """Row b's per-round values at its committed positions (i <= n), in token order."""
  active = np.asarray(stats.active_rb[:, b], bool)
  n_r = np.asarray(stats.num_accepted_rb[active, b])
  values_rk = np.asarray(values_rk)[active, b]
  return np.concatenate([values_rk[r, :n + 1] for r, n in enumerate(n_r)])[:length], n_r


@pytest.mark.parametrize("draft_kind", ["independent", "feature"])
def test_rollouts_record_the_laws_their_tokens_were_sampled_under(draft_kind):
  target, draft, draft_params = toy.toy_pair()
  if draft_kind == "feature":
    draft, draft_params = _feature_draft(target)
  module, params = _random_head(32, 32)
  weight_fn = head_weight_fn(kind="linear", hidden_dim=module.hidden_dim,
                             init_weight=module.init_weight, layer_norm=False)
  sampler = RolloutSampler(target.config, target.params, draft, draft_params, weight_fn,
                           temperature=TEMPERATURE, num_draft=3, max_new_tokens=10,
                           eos_token_ids=())
  prompts = toy.toy_examples(3, seed=5)
  roll = sampler.sample(params, prompts, group_size=2, seed=7)
  assert len(roll.generated) == 6 and roll.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
  assert roll.prompts[1] == prompts[0]
  stats = roll.generation.stats
  batch = policy_batch(roll.generation, 10)
  teacher = teacher_forced_batch(target.config, target.params, draft, draft_params,
                                 roll.prompts, roll.generated, temperature=TEMPERATURE,
                                 num_new=10)
  w_recorded = np.asarray(module.apply(params, batch["h_q_btd"], batch["h_p_btd"]))
  w_teacher = np.asarray(module.apply(params, teacher["h_q_btd"], teacher["h_p_btd"]))
  np.testing.assert_array_equal(batch["mask_bt"], 1.0)  # no EOS: 10 tokens each
  teacher_gap = 0.0
  for b, gen in enumerate(roll.generated):
    used, n_r = _committed(stats, b, stats.weights_rbk, len(gen))
    assert min(int((n_r + 1).sum()), 10) == len(gen) == 10
    assert int((n_r[:-1] + 1).sum()) < 10  # the last round was needed
    # The record holds the head inputs the loop weighed each committed token with.
    np.testing.assert_allclose(w_recorded[b], used, atol=1e-5)
    teacher_gap = max(teacher_gap, float(np.abs(w_teacher[b] - used).max()))
  # The target's side is the same in a pass over the text.
  np.testing.assert_allclose(batch["p_tok_bt"], teacher["p_tok_bt"], atol=2e-4)
  np.testing.assert_allclose(batch["h_p_btd"], teacher["h_p_btd"], atol=2e-4)
  # TV(p, q) >= |p(x) - q(x)| for every token.
  assert np.all(batch["tv_pq_bt"] + 1e-6 >= np.abs(batch["p_tok_bt"] - batch["q_tok_bt"]))
  if draft_kind == "independent":  # a pass over the text gives an independent draft's laws
    for key in ("q_tok_bt", "tv_pq_bt", "h_q_btd"):
      np.testing.assert_allclose(batch[key], teacher[key], atol=2e-4, err_msg=key)
  else:  # but not a feature draft's, which drafted from its own features
    assert teacher_gap > 0.05, teacher_gap
  assert 0.0 <= roll.summary["acceptance_rate"] <= 1.0
  assert roll.summary["tokens_per_round"] == pytest.approx(
      60 / np.asarray(stats.active_rb).sum())


def test_the_record_stops_at_each_rows_end():
  """EOS cuts rows short: the batch is zero past each row's tokens."""
  target, draft, draft_params = toy.toy_pair()
  module, params = _random_head(32, 32)
  weight_fn = head_weight_fn(kind="linear", hidden_dim=module.hidden_dim,
                             init_weight=module.init_weight, layer_norm=False)
  sampler = RolloutSampler(target.config, target.params, draft, draft_params, weight_fn,
                           temperature=TEMPERATURE, num_draft=3, max_new_tokens=10,
                           eos_token_ids=(3, 5))
  roll = sampler.sample(params, toy.toy_examples(4, seed=2), group_size=2, seed=1)
  lengths = [len(g) for g in roll.generated]
  assert min(lengths) < 10, lengths  # some row stopped early
  batch = policy_batch(roll.generation, 10)
  for b, length in enumerate(lengths):
    assert batch["mask_bt"][b].tolist() == [1.0] * length + [0.0] * (10 - length)
    assert np.all(batch["p_tok_bt"][b, :length] > 0)
    for key in ("p_tok_bt", "q_tok_bt", "tv_pq_bt", "h_q_btd", "h_p_btd"):
      assert not np.any(batch[key][b, length:]), key


# ---------------------------------------------------------------- end to end


def _metrics(workdir):
  """step -> metrics (the last line written for each step)."""
  out = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      out[record["step"]] = record
  return out


def _logged_steps(workdir):
  """The step of every line of metrics.jsonl, in file order."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["step"] for line in f]


def test_a_resume_drops_the_lines_logged_after_its_checkpoint(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(1, 6))
                  + '{"step": 6, "lo')  # killed mid-line
  drop_logged_after(str(path), 3)
  assert _logged_steps(str(tmp_path)) == [1, 2, 3]
  drop_logged_after(str(path), 3)  # nothing past it: left as it is
  assert _logged_steps(str(tmp_path)) == [1, 2, 3]


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
  """Two 12-step toy runs, lambda = 0 and lambda = 2."""
  runs = {}
  for lam in (0.0, 2.0):
    workdir = str(tmp_path_factory.mktemp(f"toy_lam{lam}"))
    folder = toy.run(workdir, progress=None, lam=lam)
    runs[lam] = (folder, _metrics(workdir))
  return runs


def test_reward_rises_without_regulariser(toy_runs):
  _, m = toy_runs[0.0]
  early = np.mean([m[s]["reward"] for s in (1, 2, 3)])
  late = np.mean([m[s]["reward"] for s in (10, 11, 12)])
  assert late > early + 0.05, (early, late)
  assert m[12]["w_mean"] > m[1]["w_mean"] + 0.05


def test_larger_lambda_trades_quality_for_acceptance(toy_runs):
  _, low = toy_runs[0.0]
  _, high = toy_runs[2.0]
  tail = lambda m, k: np.mean([m[s][k] for s in (10, 11, 12)])
  assert tail(high, "w_mean") < tail(low, "w_mean") - 0.2
  assert tail(high, "acceptance_proxy") > tail(low, "acceptance_proxy") + 0.05
  assert tail(high, "acceptance_rate") > tail(low, "acceptance_rate")
  assert tail(high, "reward") < tail(low, "reward")


def test_head_folder_loads_through_build(toy_runs, tmp_path):
  folder, _ = toy_runs[0.0]
  module, params, meta = head_io.read_head(folder)
  assert meta["task"] == "toy" and meta["draft_spec"] == "toy" and meta["steps"] == 12
  assert meta["train"]["lam"] == 0.0 and "reward" in meta["final"]
  weight_fn, head_params, desc = build.load_head(folder, "t", "d", "toy")
  assert desc == folder
  h_q, h_p = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 32))
  np.testing.assert_array_equal(weight_fn(head_params, h_q, h_p),
                                module.apply(params, h_q, h_p))


def test_shipped_head_registration(toy_runs, monkeypatch, tmp_path):
  from diversed_jax.training import artifacts
  folder, _ = toy_runs[0.0]
  assets = tmp_path / "heads"
  (assets / "toy-head").mkdir(parents=True)
  for name in ("head.json", "params.npz"):
    (assets / "toy-head" / name).write_bytes(open(os.path.join(folder, name), "rb").read())
  monkeypatch.setattr(artifacts, "ASSETS", str(assets))
  monkeypatch.setattr(build, "DEFAULT_HEADS", {})
  artifacts.register()
  # head.json records no target name for the toy pair: not registered as a default.
  assert build.DEFAULT_HEADS == {}
  meta = json.load(open(assets / "toy-head" / "head.json"))
  meta.update(target="tiny", draft_spec="assets/drafts/x")
  json.dump(meta, open(assets / "toy-head" / "head.json", "w"))
  artifacts.register()
  key = ("tiny", os.path.join(artifacts.PACKAGE_DIR, "assets/drafts/x"), "toy")
  assert build.DEFAULT_HEADS == {key: str(assets / "toy-head")}
  assert build.HEAD_LOADER == [head_io.load_head_folder]
  # `training --ship_as` refuses, before training, a name that would not be the default.
  with pytest.raises(ValueError, match="--ship_as=other: .*toy-head is the shipped default"):
    artifacts.check_ship_as("other", "tiny", key[1], "toy")
  artifacts.check_ship_as("toy-head", "tiny", key[1], "toy")  # replaces it
  artifacts.check_ship_as("other", "tiny", key[1], "gsm8k")  # no head for that task yet


def test_ppo_epochs_keep_the_learning_rate_until_the_last_step(tmp_path):
  # Each rollout step makes ppo_epochs updates; a schedule counted in rollout steps would
  # decay to 0 after total_steps / ppo_epochs of them and freeze the head from then on.
  from diversed_jax.training.checkpoint import Checkpointer
  toy.run(str(tmp_path), progress=None, total_steps=4, ppo_epochs=2, checkpoint_every=1,
          keep_checkpoints=2)
  ckpt = Checkpointer(str(tmp_path / "checkpoints"))
  assert ckpt.latest_step() == 4
  like = ckpt.manager.item_metadata(4).state
  before, _ = ckpt.restore(3, like)
  after, _ = ckpt.restore(4, like)
  ckpt.close()
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()),
                       before["params"], after["params"])
  assert max(jax.tree.leaves(moved)) > 1e-4, moved


def test_a_resume_under_other_settings_is_refused(tmp_path):
  # A resumed run with another lam, schedule or prompt set would mix two runs in one head
  # (and head.json would record only the second's settings).
  workdir = str(tmp_path)
  toy.run(workdir, progress=None, total_steps=2, checkpoint_every=2)
  for overrides, change in (({"lam": 5.0}, "train.lam=0.1 (now 5.0)"),
                            ({"total_steps": 3}, "train.total_steps=2 (now 3)")):
    with pytest.raises(ValueError, match=re.escape(f"was trained with {change}: resume")):
      toy.run(workdir, progress=None, checkpoint_every=2, **{"total_steps": 2, **overrides})
  target, draft, draft_params = toy.toy_pair()
  with pytest.raises(ValueError, match=r"was trained with prompts_digest='\w+' \(now"):
    train_head(toy.toy_config(total_steps=2, checkpoint_every=2), target=target, draft=draft,
               draft_params=draft_params, task=toy.toy_task(),
               examples=toy.toy_examples()[1:], workdir=workdir, draft_spec="toy",
               eos_token_ids=(), progress=None)
  # Bookkeeping may change: the finished run's head comes back.
  folder = toy.run(workdir, progress=None, total_steps=2, checkpoint_every=1, log_every=2)
  assert head_io.read_head(folder)[2]["steps"] == 2


def test_settings_changes_compare_only_what_both_record():
  saved = {"train": {"lam": 0.1, "seed": 0, "ppo": {"clip": 0.2}}, "task": "gsm8k"}
  changes = run_settings.changes
  assert changes(saved, {"train": {"lam": 0.1, "seed": 0, "new_field": 1},
                         "task": "gsm8k", "draft": "x"}) == []
  assert changes({}, {"train": {"lam": 0.3}}) == []  # written before settings
  assert changes(saved, {"train": {"lam": 0.3, "seed": 1, "ppo": {"clip": 0.1}},
                         "task": "mbpp"}) == [
      "task='gsm8k' (now 'mbpp')", "train.lam=0.1 (now 0.3)", "train.ppo.clip=0.2 (now 0.1)",
      "train.seed=0 (now 1)"]
  assert changes(run_settings.as_json({"shards": (0, 1)}), {"shards": [0, 1]}) == []


# ---------------------------------------------------------------- resume after kill -9


def _launch(workdir, overrides, sleep=0.0):
  cmd = [sys.executable, "-m", "diversed_jax.training.toy", "--workdir", workdir,
         "--overrides", json.dumps(overrides), "--sleep", str(sleep)]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                          text=True)


def test_resume_after_kill_matches_uninterrupted_run(tmp_path):
  overrides = {"total_steps": 8, "checkpoint_every": 2, "lam": 0.1}
  ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
  ref = _launch(ref_dir, overrides)
  victim = _launch(run_dir, overrides, sleep=1.5)
  metrics_path = os.path.join(run_dir, "metrics.jsonl")
  deadline = time.time() + 300
  while time.time() < deadline:
    if os.path.exists(metrics_path) and max(_metrics(run_dir), default=0) >= 3:
      break
    assert victim.poll() is None, victim.stdout.read()
    time.sleep(0.2)
  os.kill(victim.pid, signal.SIGKILL)
  victim.wait()
  killed_at = max(_metrics(run_dir))
  assert killed_at < 8

  resumed = _launch(run_dir, overrides)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, out
  assert "resumed from" in out
  ref_out, _ = ref.communicate(timeout=600)
  assert ref.returncode == 0, ref_out

  want, got = _metrics(ref_dir), _metrics(run_dir)
  assert _logged_steps(run_dir) == _logged_steps(ref_dir) == list(range(1, 9))
  for step in range(1, 9):
    for key, value in want[step].items():
      if key not in TIMING_KEYS:
        assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-6), (step, key)
  _, p_ref, _ = head_io.read_head(os.path.join(ref_dir, "head"))
  _, p_run, _ = head_io.read_head(os.path.join(run_dir, "head"))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), p_ref, p_run)
