"""The generation CLI end to end: a tiny random model carrying the real SmolLM2 tokenizer."""

import dataclasses
import json
import os
import re
import subprocess
import sys
import types

import jax
import pytest

from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.models import ModelConfig, init_params, loading
from diversed_jax.speculative.types import VerifyParams
from tests.entry_points import entry_point, usage_error


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("tiny_smollm"))
  config = ModelConfig(family="llama", vocab_size=49152, hidden_size=32, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                       bos_token_id=1, eos_token_ids=(2,))
  loading.save_hf_folder(config, init_params(config, jax.random.PRNGKey(0), std=0.3), folder)
  tokenizer_lib.load_tokenizer("smollm2-135m-instruct").save_pretrained(folder)
  return folder


def _run_generate(folder, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "diversed_jax.generate", f"--target={folder}",
       "--prompt=Say hello.", "--max_new_tokens=12", *flags],
      capture_output=True, text=True, env=env, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _generate(folder, *flags, with_log=False):
  result = _run_generate(folder, "--json", *flags)
  record = json.loads(result.stdout.strip().splitlines()[-1])
  return (record, result.stderr) if with_log else record


# The text output's summary line (on stderr; the text alone is on stdout).
SUMMARY_LINE = re.compile(r"^\[(\d+) tokens, \d+\.\d tokens/s, (\d+) rounds, "
                          r"acceptance (\d\.\d{3})\]$", re.M)


def test_generate_prints_text_or_json_for_autoregressive_and_speculative(tiny_model_folder):
  # generate.main is the same for every method (smc and ssd decode in process in
  # smc_test and ssd_test; every flag's way to the decoder: test_every_flag_reaches_...).
  ar = _run_generate(tiny_model_folder, "--temperature=0")  # text, as a person reads it
  sd = _generate(tiny_model_folder, "--temperature=0", "--method=sd", "--draft=self:1",
                 "--num_draft=3")
  for key in ("text", "token_ids", "num_tokens", "tokens_per_second"):
    assert key in sd
  assert sd["num_tokens"] == len(sd["token_ids"]) > 0
  # Greedy speculative decoding is exact: plain decoding printed the same text.
  assert sd["text"].strip() and ar.stdout == sd["text"] + "\n"
  (summary,) = SUMMARY_LINE.findall(ar.stderr)
  assert int(summary[0]) == sd["num_tokens"]
  for key in ("rounds", "accepted_per_round", "acceptance_rate", "tokens_per_round"):
    assert key in sd
  assert len(sd["accepted_per_round"]) == sd["rounds"]
  assert sd["tokens_per_round"] == pytest.approx(sd["num_tokens"] / sd["rounds"])
  diversed, log = _generate(tiny_model_folder, "--temperature=1", "--method=diversed",
                            "--draft=self:2", "--seed=3", with_log=True)
  assert diversed["head"] == "fixed w=0.5" and diversed["num_tokens"] > 0
  assert "runs with a fixed w=0.5 (the static ensemble, not DIVERSED)" in log, log[-2000:]


def test_every_flag_reaches_the_run(tmp_path, monkeypatch, capsys):
  """Each flag at a value of its own (no default, no other flag's): the VerifyParams and
  every other thing main() passes on (loaders, decoder, prompt, output) name the flag they
  come from, so two flags wired to each other's fields fail."""
  head, model = tmp_path / "head", tmp_path / "model"
  head.mkdir()
  (head / "head.json").write_text("{}")
  model.mkdir()
  fields = dict(method="ssd", temperature=0.7, top_p=0.9, lenience=0.3, weight=0.2,
                cascade_rule="chow", cascade_alpha=0.15, epsilon=0.25, divergence="kl",
                particles=3, ess_threshold=0.6, fanout=5, guess_budget=7, saguaro_scale=0.8)
  unset = {"typical_epsilon", "typical_delta"}  # the main job's settings; no flags
  assert set(fields) | unset == {f.name for f in dataclasses.fields(VerifyParams)}
  numbers = [v for v in fields.values() if not isinstance(v, str)]
  assert len(set(numbers)) == len(numbers)  # a swap of two of them changes the result
  defaults = VerifyParams()
  assert all(v != getattr(defaults, k) for k, v in fields.items() if k != "method")
  other = dict(target=str(model), draft="self:2", head=str(head), task="cnndm",
               prompt="Say hi.", num_draft=6, max_new_tokens=9, seed=11,
               matmul_precision="bfloat16")
  argv = [f"--{k}={v}" for k, v in {**fields, **other}.items()] + ["--raw", "--json"]
  calls = {}

  class Decoder:
    def generate(self, prompts, verify, **kwargs):
      calls["generate"] = (prompts, verify, kwargs)
      return types.SimpleNamespace(token_ids=[[5, 6, 7]], seconds=0.5, compile_seconds=0.25)

  class Tokenizer:
    def decode(self, ids, skip_special_tokens):
      assert skip_special_tokens
      return f"text of {ids}"

  def build_decoder(*args, **kwargs):
    calls["build_decoder"] = (args, kwargs)
    return Decoder(), {"draft": "the draft", "head": "the head"}

  def encode_prompt(tokenizer, text, chat):
    calls["encode_prompt"] = (text, chat)
    return [1, 2]

  def summarize_generation(out, speculative):
    calls["summarize"] = speculative
    return {"rounds": 2, "acceptance_rate": 0.5}

  target = types.SimpleNamespace(name="the target")
  with entry_point("diversed_jax.generate", argv) as (generate, rest):
    verify = generate.verify_params_from_flags()
    assert dataclasses.asdict(verify) == {**dataclasses.asdict(defaults), **fields}
    assert generate.check_flags() == verify
    monkeypatch.setattr(generate.loading, "load_model",
                        lambda spec: calls.setdefault("load_model", spec) and target)
    monkeypatch.setattr(generate.tokenizer_lib, "load_tokenizer",
                        lambda spec: calls.setdefault("load_tokenizer", spec) and Tokenizer())
    monkeypatch.setattr(generate.tokenizer_lib, "encode_prompt", encode_prompt)
    monkeypatch.setattr(generate.build, "build_decoder", build_decoder)
    monkeypatch.setattr(generate.metrics, "summarize_generation", summarize_generation)
    generate.main(rest)
  assert calls["load_model"] == calls["load_tokenizer"] == str(model)
  assert calls["build_decoder"] == ((target, "self:2", str(head), "cnndm"),
                                    {"need_draft": True, "matmul_precision": "bfloat16"})
  assert calls["encode_prompt"] == ("Say hi.", False)  # --raw: no chat template
  assert calls["generate"] == ([[1, 2]], verify,
                               {"num_draft": 6, "max_new_tokens": 9, "seed": 11})
  assert calls["summarize"] is True
  record = json.loads(capsys.readouterr().out)
  assert record == {"text": "text of [5, 6, 7]", "token_ids": [5, 6, 7], "num_tokens": 3,
                    "tokens_per_second": 6.0, "seconds": 0.5, "compile_seconds": 0.25,
                    "method": "ssd", "draft": "the draft", "head": "the head",
                    "rounds": 2, "acceptance_rate": 0.5}


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


# Bad flags: the run stops at them, naming the bad one, before the target (which does not
# exist) loads. In process through generate.main (usage_error); the first also from the
# command line, for the message and exit status that app.run makes of it.
BAD_FLAGS = [
    (["--temperature=-1"], "--temperature must be finite and >= 0, got -1.0"),
    (["--method=sd", "--num_draft=0"], "--num_draft must be >= 1 with --method=sd, got 0"),
    (["--num_draft=-1"], "--num_draft must be >= 0 with --method=ar, got -1"),
    (["--method=lossy", "--lenience=2"], "--lenience must be in (0, 1], got 2.0"),
    (["--max_new_tokens=0"], "--max_new_tokens must be >= 1, got 0"),
    (["--method=smc"], "--temperature must be > 0 with method 'smc', got 0.0"),
    (["--method=mentored", "--divergence=js"], "flag --divergence=js: value should be one of"),
    (["--method=smc", "--temperature=1", "--particles=0"], "--particles must be >= 1, got 0"),
    (["--method=ssd", "--saguaro_scale=0"], "--saguaro_scale must be in (0, 1], got 0.0"),
    (["--method=ssd", "--num_draft=3", "--guess_budget=9"],
     "--guess_budget=9 exceeds the (K + 1) x fanout = 8 guesses"),
]
# Names a typo would otherwise carry to a failure after the target loads, or (--task) to
# a silent w = 0.5.
BAD_NAMES = [
    (["--target=bogus-model"], "--target='bogus-model': not a registered model name"),
    (["--method=sd", "--draft=self:0"], "--draft='self:0': a self-draft is 'self:L'"),
    (["--method=sd", "--draft=nocopy:/no/draft"], "--draft='nocopy:/no/draft': 'nocopy:'"),
    (["--method=diversed", "--head=/nonexistent"], "--head='/nonexistent': not a head folder"),
    (["--method=diversed", "--task=nosuchtask"], "--task='nosuchtask': unknown task"),
]


def test_generate_rejects_bad_flags_before_loading_a_model():
  flags, message = BAD_FLAGS[0]
  result = subprocess.run(
      [sys.executable, "-m", "diversed_jax.generate", "--target=/nonexistent/model",
       "--prompt=hi", *flags],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
  assert result.returncode == 1
  assert message in result.stderr
  assert "no model at" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("flags, message", BAD_FLAGS + BAD_NAMES)
def test_bad_flags_and_names_are_usage_errors_before_loading(flags, message, monkeypatch,
                                                             capsys):
  # The default target: usage_error fails if it loads.
  assert message in usage_error("diversed_jax.generate", ["--prompt=hi", *flags],
                                monkeypatch, capsys)


def test_check_flags_accepts_good_names():
  with entry_point("diversed_jax.generate", ["--prompt=hi", "--method=sd", "--draft=self:2",
                                             "--task=cnndm"]) as (generate, _):
    assert generate.check_flags().method == "sd"


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
