"""The generation CLI end to end: a tiny random model carrying the real SmolLM2 tokenizer."""

import json
import os
import re
import subprocess
import sys

import jax
import pytest

from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.models import ModelConfig, init_params, loading


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("tiny_smollm"))
  config = ModelConfig(family="llama", vocab_size=49152, hidden_size=32, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                       bos_token_id=1, eos_token_ids=(2,))
  loading.save_hf_folder(config, init_params(config, jax.random.PRNGKey(0), std=0.3), folder)
  tokenizer_lib.load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)
  return folder


def _generate(folder, *flags, with_log=False):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "diversed_jax.generate", f"--target={folder}",
       "--prompt=Say hello.", "--max_new_tokens=12", "--json", *flags],
      capture_output=True, text=True, env=env, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads(result.stdout.strip().splitlines()[-1])
  return (record, result.stderr) if with_log else record


def test_generate_json_for_autoregressive_and_speculative(tiny_model_folder):
  ar = _generate(tiny_model_folder, "--temperature=0")
  for key in ("text", "token_ids", "num_tokens", "tokens_per_second"):
    assert key in ar
  assert ar["num_tokens"] == len(ar["token_ids"]) > 0
  sd = _generate(tiny_model_folder, "--temperature=0", "--method=sd", "--draft=self:1",
                 "--num_draft=3")
  assert sd["token_ids"] == ar["token_ids"]  # greedy speculative decoding is exact
  for key in ("rounds", "accepted_per_round", "acceptance_rate", "tokens_per_round"):
    assert key in sd
  assert len(sd["accepted_per_round"]) == sd["rounds"]
  assert sd["tokens_per_round"] == pytest.approx(sd["num_tokens"] / sd["rounds"])
  diversed, log = _generate(tiny_model_folder, "--temperature=1", "--method=diversed",
                            "--draft=self:2", "--seed=3", with_log=True)
  assert diversed["head"] == "fixed w=0.5" and diversed["num_tokens"] > 0
  assert "runs with a fixed w=0.5 (the static ensemble, not DIVERSED)" in log, log[-2000:]
  smc = _generate(tiny_model_folder, "--temperature=1", "--method=smc", "--draft=self:1",
                  "--num_draft=3", "--particles=2")
  assert smc["acceptance_rate"] == 1.0 and 0.5 <= smc["ess"] <= 1.0
  assert smc["rounds"] == -(-smc["num_tokens"] // 4)  # every round commits K + 1 tokens
  ssd = _generate(tiny_model_folder, "--temperature=0", "--method=ssd", "--draft=self:1",
                  "--num_draft=3", "--fanout=3", "--guess_budget=5")
  assert ssd["token_ids"] == ar["token_ids"]  # pre-drafting changes no output
  assert 0.0 <= ssd["hit_rate"] <= 1.0


def test_generate_rejects_a_draft_with_another_vocabulary(tiny_model_folder, tmp_path):
  other = ModelConfig(family="llama", vocab_size=100, hidden_size=16, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32)
  folder = loading.save_hf_folder(other, init_params(other, jax.random.PRNGKey(1)),
                                  str(tmp_path / "other"))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "diversed_jax.generate", f"--target={tiny_model_folder}",
       f"--draft={folder}", "--method=sd", "--prompt=hi", "--max_new_tokens=4"],
      capture_output=True, text=True, env=env, timeout=600)
  assert result.returncode != 0
  assert "vocabulary size 100" in result.stderr and "49152" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--method=sd", "--num_draft=0"], "--num_draft must be >= 1 with --method=sd, got 0"),
    (["--num_draft=-1"], "--num_draft must be >= 0 with --method=ar, got -1"),
    (["--temperature=-1"], "--temperature must be finite and >= 0, got -1.0"),
    (["--method=lossy", "--lenience=2"], "--lenience must be in (0, 1], got 2.0"),
    (["--max_new_tokens=0"], "--max_new_tokens must be >= 1, got 0"),
    (["--method=smc"], "--temperature must be > 0 with method 'smc', got 0.0"),
    (["--method=mentored", "--divergence=js"], "flag --divergence=js: value should be one of"),
    (["--method=smc", "--temperature=1", "--particles=0"], "--particles must be >= 1, got 0"),
    (["--method=ssd", "--saguaro_scale=0"], "--saguaro_scale must be in (0, 1], got 0.0"),
    (["--method=ssd", "--num_draft=3", "--guess_budget=9"],
     "--guess_budget=9 exceeds the (K + 1) x fanout = 8 guesses"),
])
def test_generate_rejects_bad_flags_before_loading_a_model(flags, message):
  # The target does not exist: the run must stop at the flags, naming the bad one.
  result = subprocess.run(
      [sys.executable, "-m", "diversed_jax.generate", "--target=/nonexistent/model",
       "--prompt=hi", *flags],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
  assert result.returncode != 0
  assert message in result.stderr
  assert "no model at" not in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--target=bogus-model"], "--target='bogus-model': not a registered model name"),
    (["--method=sd", "--draft=self:0"], "--draft='self:0': a self-draft is 'self:L'"),
    (["--method=sd", "--draft=nocopy:/no/draft"], "--draft='nocopy:/no/draft': 'nocopy:'"),
    (["--method=diversed", "--head=/nonexistent"], "--head='/nonexistent': not a head folder"),
    (["--method=diversed", "--task=nosuchtask"], "--task='nosuchtask': unknown task"),
])
def test_check_flags_refuses_unknown_names_before_loading(flags, message):
  # In process (check_flags loads nothing): the names a typo would otherwise carry to a
  # failure after the target loads, or (--task) to a silent w = 0.5.
  from absl import app
  from absl import flags as absl_flags
  from diversed_jax import generate
  try:
    absl_flags.FLAGS(["generate", "--prompt=hi", *flags])
    with pytest.raises(app.UsageError, match=re.escape(message)):
      generate.check_flags()
    absl_flags.FLAGS.unparse_flags()  # back to the defaults
    absl_flags.FLAGS(["generate", "--prompt=hi", "--method=sd", "--draft=self:2",
                      "--task=cnndm"])
    assert generate.check_flags().method == "sd"
  finally:
    absl_flags.FLAGS.unparse_flags()


def test_without_a_task_diversed_takes_the_pairs_gsm8k_head(monkeypatch):
  # generate --method=diversed without --task: the choice is DEFAULT_HEAD_TASK, not the
  # first head in sort order ('cnndm' < 'gsm8k').
  from diversed_jax.speculative import build
  monkeypatch.setattr(build, "_register_shipped_artifacts", lambda: None)
  monkeypatch.setattr(build, "DEFAULT_HEADS", {("t", "d", "cnndm"): "/heads/cnndm",
                                               ("t", "d", "gsm8k"): "/heads/gsm8k"})
  monkeypatch.setattr(build, "HEAD_LOADER", [lambda folder: (None, {"folder": folder})])
  assert build.DEFAULT_HEAD_TASK == "gsm8k"
  assert build.load_head(None, "t", "d", None)[2] == "/heads/gsm8k"
  assert build.load_head(None, "t", "d", "cnndm")[2] == "/heads/cnndm"
  assert build.load_head(None, "t", "d", "mbpp")[2] == build.FIXED_HEAD
  warning = build.fixed_weight_warning("t", "d", "mbpp")
  assert "task 'mbpp'" in warning and "(cnndm, gsm8k)" in warning
