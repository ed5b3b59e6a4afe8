"""Tests of the DIVERSED ensemble head (w_t, the weight on the target)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diversed_jax.rl.head import EnsembleHead, init_head, make_head_fn

DQ, DP, H = 6, 10, 16


def _inputs(key, lead=(3, 5)):
  kq, kp = jax.random.split(key)
  # Very different feature scales, as between a small draft and a large target.
  return (jax.random.normal(kq, lead + (DQ,)), 50.0 * jax.random.normal(kp, lead + (DP,)))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("init_weight", [0.5, 0.2, 0.9])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_initial_weight_is_exact_for_every_input(kind, init_weight, layer_norm):
  head = EnsembleHead(kind=kind, hidden_dim=H, init_weight=init_weight, layer_norm=layer_norm)
  params = init_head(head, jax.random.key(0), DQ, DP)
  for seed, lead in [(1, (3, 5)), (2, (4,)), (3, ())]:
    w = head.apply(params, *_inputs(jax.random.key(seed), lead))
    assert w.shape == lead and w.dtype == jnp.float32
    np.testing.assert_allclose(w, init_weight, rtol=0, atol=1e-7)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_output_in_open_unit_interval_and_input_dependent(kind):
  head = EnsembleHead(kind=kind, hidden_dim=H, layer_norm=True)
  params = init_head(head, jax.random.key(0), DQ, DP)
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.key(7), len(leaves))
  params = jax.tree_util.tree_unflatten(
      tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  w = head.apply(params, *_inputs(jax.random.key(1)))
  assert bool(jnp.all((w > 0) & (w < 1)))
  assert float(jnp.std(w)) > 1e-3  # a trained head gives a context-dependent w_t


def test_param_shapes():
  shapes = lambda p: jax.tree_util.tree_map(jnp.shape, p)
  lin = init_head(EnsembleHead("linear"), jax.random.key(0), DQ, DP)
  assert shapes(lin) == {"params": {"out": {"kernel": (DQ + DP, 2), "bias": (2,)}}}
  mlp = init_head(EnsembleHead("mlp", hidden_dim=H, layer_norm=True), jax.random.key(0), DQ, DP)
  assert shapes(mlp) == {"params": {
      "norm": {"scale": (DQ + DP,), "bias": (DQ + DP,)},
      "hidden": {"kernel": (DQ + DP, H), "bias": (H,)},
      "out": {"kernel": (H, 2), "bias": (2,)}}}
  np.testing.assert_array_equal(mlp["params"]["out"]["kernel"], 0.0)
  assert float(jnp.abs(mlp["params"]["hidden"]["kernel"]).max()) > 0  # only the last layer is 0


def test_linear_head_is_softmax_of_two_logits_on_concat():
  head = EnsembleHead("linear")
  params = init_head(head, jax.random.key(0), DQ, DP)
  kernel = jax.random.normal(jax.random.key(1), (DQ + DP, 2))
  params = {"params": {"out": {"kernel": kernel, "bias": jnp.array([0.3, -0.1])}}}
  h_q, h_p = _inputs(jax.random.key(2))
  h_q, h_p = h_q / 10, h_p / 500
  z = np.concatenate([h_q, h_p], -1) @ np.asarray(kernel) + np.array([0.3, -0.1])
  expected = np.exp(z[..., 1]) / np.exp(z).sum(-1)
  np.testing.assert_allclose(head.apply(params, h_q, h_p), expected, rtol=1e-5)


def test_make_head_fn_is_pure_and_jittable():
  head = EnsembleHead("mlp", hidden_dim=H, init_weight=0.3)
  params = init_head(head, jax.random.key(0), DQ, DP)
  params = jax.tree_util.tree_map(lambda x: x + 0.1, params)
  fn = make_head_fn(head, params)
  h_q, h_p = _inputs(jax.random.key(1))
  np.testing.assert_allclose(jax.jit(fn)(h_q, h_p), head.apply(params, h_q, h_p), rtol=1e-6)
  w_bf16 = fn(h_q.astype(jnp.bfloat16), h_p.astype(jnp.bfloat16))
  assert w_bf16.dtype == jnp.float32


def test_bad_config_raises():
  h_q, h_p = _inputs(jax.random.key(1))
  with pytest.raises(ValueError, match="kind"):
    init_head(EnsembleHead("transformer"), jax.random.key(0), DQ, DP)
  with pytest.raises(ValueError, match="init_weight"):
    init_head(EnsembleHead(init_weight=1.0), jax.random.key(0), DQ, DP)


def test_shipped_head_is_dropped_when_its_draft_folder_changes(tmp_path):
  from diversed_jax.digest import folder_digest
  from diversed_jax.training import artifacts, head_io
  draft = tmp_path / "draft"
  draft.mkdir()
  np.savez(draft / "params.npz", w=np.zeros(3))
  module = EnsembleHead(init_weight=0.5)
  params = init_head(module, jax.random.key(0), DQ, DP)
  assets = tmp_path / "assets"
  head_io.save_head(str(assets / "h"), module, params, DQ, DP, target="t",
                    draft_spec=str(draft), draft_digest=folder_digest(draft), task="gsm8k")
  assert artifacts.shipped_heads(str(assets)) == {("t", str(draft), "gsm8k"):
                                                  str(assets / "h")}
  (draft / "copy_gate.json").write_text("{}")  # a context-copy gate changes its law
  assert artifacts.shipped_heads(str(assets)) == {}
  (draft / "copy_gate.json").unlink()
  assert len(artifacts.shipped_heads(str(assets))) == 1
  np.savez(draft / "params.npz", w=np.ones(3))  # the draft re-exported in place
  assert artifacts.shipped_heads(str(assets)) == {}


def test_shipped_heads_match_the_shipped_drafts():
  from diversed_jax.training import artifacts
  heads = artifacts.shipped_heads()
  assert {task for (_, _, task) in heads} >= {"gsm8k", "cnndm"}
  assert any(draft.endswith("smollm2-135m-feature") for (_, draft, _) in heads)


def test_a_given_head_must_match_the_target_and_draft(tmp_path, caplog):
  # Heads of different drafts can have the same input width: only head.json tells them
  # apart, so a head given explicitly is checked against the resolved pair.
  from diversed_jax.digest import folder_digest
  from diversed_jax.speculative import build
  from diversed_jax.training import head_io
  draft = tmp_path / "draft"
  draft.mkdir()
  np.savez(draft / "params.npz", w=np.zeros(3))
  module = EnsembleHead(init_weight=0.5)
  params = init_head(module, jax.random.key(0), DQ, DP)
  folder = head_io.save_head(str(tmp_path / "h"), module, params, DQ, DP, target="t",
                             draft_spec=str(draft), draft_digest=folder_digest(draft),
                             task="gsm8k")
  self4 = head_io.save_head(str(tmp_path / "h4"), module, params, DQ, DP, target="t",
                            draft_spec="self:4", task="gsm8k")
  assert build.load_head(folder, "t", str(draft), "gsm8k")[2] == folder
  assert build.load_head(folder, "t", build.NO_COPY + str(draft), "gsm8k")[2] == folder
  assert build.load_head(self4, "t", "self:4", "gsm8k")[2] == self4
  with pytest.raises(ValueError, match=f"head '{self4}' was trained with draft 'self:4'.*"
                     f"the draft is '{draft}'"):
    build.load_head(self4, "t", str(draft), "gsm8k")
  with pytest.raises(ValueError, match="draft 'self:4'.* the draft is 'self:2'"):
    build.load_head(self4, "t", "self:2", "gsm8k")
  with pytest.raises(ValueError, match="trained for target 't', not 'u'"):
    build.load_head(folder, "u", str(draft), "gsm8k")
  with caplog.at_level("WARNING"):
    build.load_head(folder, "t", str(draft), "cnndm")  # another task: a warning only
  assert "trained on task 'gsm8k' and is used on 'cnndm'" in caplog.text
  np.savez(draft / "params.npz", w=np.ones(3))  # the draft re-exported in place
  with pytest.raises(ValueError, match="was trained with draft"):
    build.load_head(folder, "t", str(draft), "gsm8k")


def test_shipped_heads_load_for_their_drafts_and_only_for_them():
  from diversed_jax.speculative import build
  build._register_shipped_artifacts()
  target = "smollm2-135m-instruct"
  feature = build.DEFAULT_DRAFTS[target]
  shipped = build.shipped_head(target, feature, "gsm8k")
  assert build.load_head(None, target, feature, "gsm8k")[2] == shipped
  assert build.load_head(shipped, target, feature, "gsm8k")[2] == shipped  # given explicitly
  self4 = build.shipped_head(target, "self:4", "gsm8k")
  assert build.load_head(self4, target, "self:4", "gsm8k")[2] == self4
  # Any path to the draft's folder, and its gate-less form, find the same head (the
  # benchmarks once ran 'diversed' with a fixed w for these).
  relative = os.path.relpath(feature)
  for spec in (relative, build.NO_COPY + feature, os.path.join(feature, ".")):
    assert build.shipped_head(target, spec, "gsm8k") == shipped, spec
  assert build.shipped_head(target, "self:8", "gsm8k") is None
  with pytest.raises(ValueError, match="self4_gsm8k' was trained with draft 'self:4'"):
    build.load_head(self4, target, feature, "gsm8k")
