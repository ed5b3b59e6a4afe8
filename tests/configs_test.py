"""Every config file loads and validates; bad values fail early, naming field and value."""

import json
import os
import re
import subprocess
import sys

import jax
import pytest

from diversed_jax.evaluation import config_io, context, methods, presets
from diversed_jax.evaluation.validate import validate
from diversed_jax.speculative import build
from diversed_jax.tasks.registry import get_task
from tests.entry_points import usage_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("default", "gsm8k", "cnndm", "xsum", "mbpp", "humaneval")


def _load(name, variant="", **overrides):
  spec = os.path.join(ROOT, "configs", f"{name}.py") + (f":{variant}" if variant else "")
  return config_io.load_config(spec, overrides)


@pytest.fixture(scope="module", autouse=True)
def tiny_dir(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("tiny") / "models")
  old = os.environ.get("DIVERSED_TINY_DIR")
  os.environ["DIVERSED_TINY_DIR"] = folder
  yield folder
  if old is None:
    del os.environ["DIVERSED_TINY_DIR"]
  else:
    os.environ["DIVERSED_TINY_DIR"] = old


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_validates(name):
  config = _load(name)
  validate(config)
  assert config.task.name == ("gsm8k" if name == "default" else name)
  assert methods.expand(config)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("variant", ["llama", "qwen3", "gemma3", "tiny"])
def test_variants_validate(name, variant):
  config = _load(name, variant)
  validate(config)
  if variant in presets.PAIRS:
    assert (config.model.target, config.model.draft) == presets.PAIRS[variant]
  else:
    assert os.path.isfile(os.path.join(config.model.target, "config.json"))


def test_unknown_variant():
  with pytest.raises(ValueError, match="'bogus'"):
    _load("gsm8k", "bogus")


BAD = [
    ("decode.temperature", -1.0), ("decode.top_p", 0.0), ("decode.num_draft", 0),
    ("decode.max_new_tokens", 0), ("decode.batch_size", 0), ("mode", "serve"),
    ("methods.run", "ar,beam"), ("methods.run", " , "), ("methods.lenience", (0.0,)),
    ("methods.static_weights", (0.5, 1.5)), ("methods.static_rule", "geometric"),
    ("task.name", "squad"), ("task.source", "/no/such/file.jsonl"), ("task.limit", -2),
    ("task.split", "dev"), ("task.fields.test_list", "tests"), ("model.target", "/no/model"),
    ("model.draft", "self:x"), ("head.path", "/no/head"), ("head.task", "squad"),
    ("eval.results_file", "a/b.jsonl"), ("train.lam", -1.0),
    ("decode.matmul_precision", "fp32"),
]


@pytest.mark.parametrize("field,value", BAD)
def test_bad_value_names_field_and_value(field, value):
  config = _load("gsm8k", **{field: value})
  if field == "methods.static_rule":
    config.methods.run = "static"
  with pytest.raises(ValueError) as err:
    validate(config)
  message = str(err.value)
  assert message.startswith(field + "=") or field in message, message
  assert repr(value) in message or str(value) in message, message


def test_cascade_and_mentored_grids():
  config = _load("gsm8k", **{"methods.run": "cascade,mentored",
                             "methods.cascade_rules": ("opt", "nope")})
  with pytest.raises(ValueError, match=r"methods.cascade_rules=.*'nope'"):
    validate(config)
  config = _load("gsm8k", **{"methods.run": "mentored", "methods.mentored_epsilon": (2.0,)})
  with pytest.raises(ValueError, match=r"methods.mentored_epsilon=\(2.0,\)"):
    validate(config)
  # KL and chi^2 budgets are unbounded; their settings say the divergence.
  config = _load("gsm8k", **{"methods.run": "mentored", "methods.mentored_epsilon": (2.0,),
                             "methods.mentored_divergence": "kl"})
  validate(config)
  (setting,) = methods.expand(config)
  assert setting.name == "mentored(kl,eps=2)" and setting.verify.divergence == "kl"
  config = _load("gsm8k", **{"methods.run": "mentored",
                             "methods.mentored_divergence": "hellinger"})
  with pytest.raises(ValueError, match=r"methods.mentored_divergence='hellinger': must be one"):
    validate(config)


def test_xsum_needs_a_source_and_humaneval_no_shots():
  with pytest.raises(ValueError, match="task.source=''"):
    validate(_load("xsum", **{"task.source": ""}))
  with pytest.raises(ValueError, match="task.num_shots=2"):
    validate(_load("humaneval", **{"task.num_shots": 2}))
  with pytest.raises(ValueError, match="train.split='train'.*humaneval"):
    validate(_load("humaneval", **{"mode": "train", "train.task": ""}))


def test_method_expansion_carries_temperature_and_grids():
  config = _load("gsm8k", **{
      "methods.run": "ar,sd,sd_finetuned,lossy,cascade,static,diversed,mentored,typical",
      "methods.lenience": (0.2, 0.6), "methods.static_weights": (0.1, 0.9),
      "methods.cascade_rules": ("chow", "opt"), "methods.mentored_epsilon": (0.05,),
      "decode.temperature": 0.1})
  settings = methods.expand(config)
  names = [s.name for s in settings]
  assert names == ["ar", "sd", "sd_finetuned", "lossy(l=0.2)", "lossy(l=0.6)",
                   "cascade(chow,a=0.1)", "cascade(opt,a=0.1)", "static(w=0.1)",
                   "static(w=0.9)", "diversed", "mentored(eps=0.05)", "typical"]
  assert all(s.verify.temperature == 0.1 for s in settings)
  by_name = {s.name: s for s in settings}
  assert by_name["lossy(l=0.6)"].verify.lenience == 0.6
  assert by_name["static(w=0.9)"].verify.weight == 0.9
  assert by_name["sd_finetuned"].draft == "finetuned"
  assert by_name["cascade(chow,a=0.1)"].verify.cascade_rule == "chow"
  assert by_name["mentored(eps=0.05)"].verify.epsilon == 0.05


def test_smc_settings_and_their_refusals():
  config = _load("gsm8k", **{"methods.run": "ar,smc", "methods.smc_particles": (2, 8),
                             "methods.smc_ess_threshold": 0.25})
  settings = methods.expand(config)
  assert [s.name for s in settings] == ["ar", "smc(n=2)", "smc(n=8)"]
  assert (settings[2].verify.particles, settings[2].verify.ess_threshold) == (8, 0.25)
  validate(config)
  for field, value, message in [
      ("methods.smc_particles", (0,), r"methods.smc_particles=\(0,\): value 0: must be >= 1"),
      ("methods.smc_particles", (2.5,), r"value 2.5: must be an integer"),
      ("methods.smc_ess_threshold", 1.5, r"methods.smc_ess_threshold=1.5: must be <= 1"),
      ("decode.temperature", 0.0, r"decode.temperature=0.0: method 'smc' needs temperature"),
  ]:
    with pytest.raises(ValueError, match=message):
      validate(_load("gsm8k", **{"methods.run": "ar,smc", field: value}))


def test_ssd_settings_and_their_refusals():
  config = _load("gsm8k", **{"methods.run": "sd,ssd", "methods.ssd_fanout": 3,
                             "methods.ssd_saguaro_scales": (1.0, 0.5)})
  settings = methods.expand(config)
  assert [s.name for s in settings] == ["sd", "ssd(f=3,c=1)", "ssd(f=3,c=0.5)"]
  assert (settings[2].verify.fanout, settings[2].verify.saguaro_scale) == (3, 0.5)
  assert settings[2].verify.guess_budget == 0
  validate(config)
  budgeted = _load("gsm8k", **{"methods.run": "ssd", "methods.ssd_guess_budget": 4})
  (setting,) = methods.expand(budgeted)
  assert setting.name == "ssd(f=2,b=4,c=1)" and setting.verify.guess_budget == 4
  validate(budgeted)
  for field, value, message in [
      ("methods.ssd_fanout", 0, r"methods.ssd_fanout=0: must be >= 1"),
      ("methods.ssd_guess_budget", -1, r"methods.ssd_guess_budget=-1: must be >= 0"),
      ("methods.ssd_guess_budget", 99, r"methods.ssd_guess_budget=99: must be at most "
       r"\(decode.num_draft \+ 1\) x methods.ssd_fanout = "),
      ("methods.ssd_saguaro_scales", (0.0,),
       r"ssd_saguaro_scales=\(0.0,\): value 0.0: must be > 0"),
      ("methods.ssd_saguaro_scales", (1.5,), r"value 1.5: must be <= 1"),
  ]:
    with pytest.raises(ValueError, match=message):
      validate(_load("gsm8k", **{"methods.run": "sd,ssd", field: value}))


def test_xsum_local_file_with_its_fields(tmp_path):
  path = tmp_path / "xsum_small.jsonl"
  rows = [{"id": f"x{i}", "document": f"Article number {i}. It rained.",
           "summary": f"Rain {i}."} for i in range(3)]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  config = _load("xsum", **{"task.source": str(path), "task.limit": 2})
  validate(config)
  task, examples = context.load_slice(config.task)
  assert task.metric == "rouge2"
  assert [e.id for e in examples] == ["x0", "x1"]
  assert examples[1].source_text == "Article number 1. It rained."
  assert examples[1].reference == "Rain 1."
  assert "Article number 1" in task.prompt(examples[1])
  # Other field names, given by override.
  renamed = tmp_path / "renamed.jsonl"
  renamed.write_text("".join(json.dumps({"key": r["id"], "text": r["document"],
                                         "target": r["summary"]}) + "\n" for r in rows))
  config = _load("xsum", **{"task.source": str(renamed), "task.fields.id": "key",
                            "task.fields.source_text": "text", "task.fields.reference": "target",
                            "task.offset": 1})
  validate(config)
  _, examples = context.load_slice(config.task)
  assert [e.reference for e in examples] == ["Rain 1.", "Rain 2."]


def test_gsm8k_local_jsonl_override(tmp_path):
  path = tmp_path / "math.jsonl"
  path.write_text(json.dumps({"q": "What is 2+3?", "a": "2+3=5\n#### 5"}) + "\n")
  config = _load("gsm8k", **{"task.source": str(path), "task.fields.source_text": "q",
                             "task.fields.reference": "a"})
  validate(config)
  _, examples = context.load_slice(config.task)
  assert examples[0].reference == "5"


# Each entry point's usage errors: absl's app.run parses the flags, then main() must stop
# with the bad field and value before anything loads. All run in process (entry_point);
# SUBPROCESS_CASES also from the command line, one per entry point, for the message and
# exit status that app.run makes of the error.
USAGE_ERRORS = [
    ("diversed_jax.main", ["--config=configs/gsm8k.py", "--workdir={tmp}",
                           "--config.decode.temperature=-1"],
     "decode.temperature=-1.0: must be >= 0"),
    ("diversed_jax.training", ["--workdir={tmp}", "--target=/nonexistent/model",
                               "--train.lam=-1"],
     "--train.lam=-1.0: must be"),
    ("diversed_jax.training", ["--workdir={tmp}", "--target=/nonexistent/model",
                               "--task=news"],
     "--task: unknown task 'news'"),
    ("diversed_jax.training", ["--workdir={tmp}", "--target=/nonexistent/model",
                               "--shots=-1"],
     "--shots must be >= 0, got -1"),
    ("diversed_jax.distill", ["--config=configs/distill_smollm2.py", "--config.workdir={tmp}",
                              "--config.target=/nonexistent/model", "--config.train.batch=0"],
     "config.train.batch=0 is invalid"),
    # Model names and folders, before the target loads.
    ("diversed_jax.training", ["--workdir={tmp}", "--target=/nonexistent/model"],
     "--target='/nonexistent/model': not a registered model name"),
    ("diversed_jax.training", ["--workdir={tmp}", "--draft=slef:4"],
     "--draft='slef:4': not a registered model name"),
    ("diversed_jax.distill", ["--config=configs/distill_smollm2.py", "--config.workdir={tmp}",
                              "--config.target=/nonexistent/model"],
     "config.target='/nonexistent/model': not a registered model name"),
    ("diversed_jax.distill", ["--config=configs/distill_smollm2.py", "--config.workdir={tmp}",
                              "--config.train.init_from={tmp}"],
     "config.train.init_from="),
    # A mesh of more devices than visible.
    ("diversed_jax.training", ["--workdir={tmp}", "--target=/nonexistent/model",
                               "--train.mesh_data={more}"],
     "--train.mesh_data={more}: only {devices} devices are visible"),
    ("diversed_jax.distill", ["--config=configs/distill_smollm2.py", "--config.workdir={tmp}",
                              "--config.target=/nonexistent/model",
                              "--config.train.mesh_data={more}"],
     "config.train.mesh_data={more}: only {devices} devices are visible"),
]
SUBPROCESS_CASES = [USAGE_ERRORS[0], USAGE_ERRORS[1], USAGE_ERRORS[4]]
assert {case[0] for case in SUBPROCESS_CASES} == {case[0] for case in USAGE_ERRORS}


def _filled(texts, tmp, devices):
  return [text.format(tmp=tmp, more=devices + 1, devices=devices) for text in texts]


@pytest.mark.parametrize("module, args, message", USAGE_ERRORS)
def test_bad_value_is_a_usage_error_before_loading(tmp_path, monkeypatch, capsys, module, args,
                                                  message):
  devices = jax.device_count()
  args = [arg.replace("configs/", f"{ROOT}/configs/") for arg in args]
  message, *args = _filled([message, *args], tmp_path, devices)
  assert message in usage_error(module, args, monkeypatch, capsys)


@pytest.mark.parametrize("module, args, message", SUBPROCESS_CASES)
def test_bad_value_on_the_command_line_is_a_usage_error_before_loading(tmp_path, module, args,
                                                                        message):
  # The entry points check their flags first and name the bad field and value (no
  # traceback); a check after loading would meet the missing model or print its loading.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  message, *args = _filled([message, *args], tmp_path, 1)
  proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert message in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr and "no model at" not in proc.stderr
  assert "loading target" not in proc.stdout


def test_shots_never_come_from_the_evaluated_file(tmp_path):
  path = tmp_path / "x.jsonl"
  path.write_text(json.dumps({"document": "d", "summary": "s"}) + "\n")
  with pytest.raises(ValueError, match="task.num_shots=1"):
    validate(_load("xsum", **{"task.source": str(path), "task.num_shots": 1}))
  validate(_load("gsm8k", **{"task.num_shots": 2}))  # from the shipped train split


class _CharTokenizer:
  """Characters as ids, with a visible chat template."""
  chat_template = "{{ messages }}"

  def encode(self, text, add_special_tokens=True):
    return [ord(c) for c in text]

  def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
    return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + (
        "<assistant>" if add_generation_prompt else "")


def test_a_local_file_of_any_name_never_gives_its_own_examples_as_shots(tmp_path):
  # Not .jsonl, yet a file: read as one, and the shots come from the shipped train split,
  # not from its first records as if it were a hub dataset's train split.
  path = tmp_path / "gsm8k_test.ndjson"
  path.write_text("".join(json.dumps({"question": f"Leaked question {i}?",
                                      "answer": f"#### {i}"}) + "\n" for i in range(3)))
  config = _load("gsm8k", **{"task.source": str(path), "task.num_shots": 2, "task.limit": 1})
  validate(config)
  task, examples = context.load_slice(config.task)
  prompt = "".join(map(chr, context.encode_prompts(config, task, examples, _CharTokenizer(),
                                                  log=lambda m: None)[0]))
  assert prompt.count("Leaked question") == 1  # the example itself, no other
  shipped = context.prompt_shots(config)
  assert [s.id for s in shipped] == ["gsm8k/train/0", "gsm8k/train/1"]


@pytest.mark.parametrize("name, overrides", [
    ("gsm8k", {"task.split": "train"}),  # the shipped train split, the shots' own
    ("mbpp", {"task.split": "all"}),  # holds the 'prompt' split the shots come from
    ("cnndm", {"task.source": "abisee/cnn_dailymail", "task.split": "train"}),
])
def test_shots_from_the_evaluated_split_are_refused(name, overrides):
  config = _load(name, **overrides, **{"task.num_shots": 2})
  with pytest.raises(ValueError, match=r"task.num_shots=2: .*task.source="):
    validate(config)
  with pytest.raises(ValueError, match="task.num_shots=2"):
    context.prompt_shots(config)


def test_too_long_few_shot_prompts_keep_the_chat_template_and_instruction():
  from diversed_jax import tokenizer as tokenizer_lib
  from diversed_jax.tasks import prompts
  tokenizer = tokenizer_lib.load_tokenizer("smollm2-135m-instruct")
  config = _load("cnndm", **{"task.num_shots": 2, "task.limit": 2})
  task, examples = context.load_slice(config.task)
  logged = []
  ids = context.encode_prompts(config, task, examples, tokenizer, log=logged.append)
  assert logged and logged[0].startswith("2 of 2 prompts shortened")
  for prompt in ids:
    text = tokenizer.decode(prompt)
    assert len(prompt) <= config.task.max_prompt_tokens
    assert text.startswith("<|im_start|>system\n") and text.count("Article: ") == 3
    assert f"<|im_start|>user\n{prompts.SUMMARY_INSTRUCTION['cnndm']}" in text
    assert text.endswith("Summary:<|im_end|>\n<|im_start|>assistant\n")
  # Below the template and instruction alone (a smoke test's budget): said, not hidden.
  config = _load("gsm8k", **{"task.max_prompt_tokens": 40, "task.limit": 1})
  task, examples = context.load_slice(config.task)
  logged = []
  assert len(context.encode_prompts(config, task, examples, tokenizer,
                                    log=logged.append)[0]) == 40
  assert len(logged) == 1 and logged[0].startswith("WARNING: task.max_prompt_tokens=40 is")


def test_main_job_head_trains_on_the_evaluations_prompts():
  from diversed_jax.evaluation import runner
  tokenizer = _CharTokenizer()
  for chat in (True, False):
    config = _load("cnndm", **{"task.num_shots": 1, "model.chat": chat, "task.limit": 1,
                               "train.max_prompt_tokens": 4096})
    task, examples = context.load_slice(config.task)
    evaluated = context.encode_prompts(config, task, examples, tokenizer, log=print)[0]
    assert runner.training_task(config, task, tokenizer).prompt_ids(examples[0]) == evaluated


def test_a_nocopy_draft_folder_validates():
  build._register_shipped_artifacts()
  folder = build.DEFAULT_DRAFTS["smollm2-135m-instruct"]
  validate(_load("gsm8k", **{"model.draft": build.NO_COPY + folder}))
  with pytest.raises(ValueError, match="model.draft='nocopy:/no/draft'"):
    validate(_load("gsm8k", **{"model.draft": "nocopy:/no/draft"}))


def test_mbpp_sanitized_source_loads_through_the_config():
  config = _load("mbpp", **{"task.source": "sanitized", "task.limit": 3})
  validate(config)
  _, examples = context.load_slice(config.task)
  assert len(examples) == 3 and examples[0].source_text.startswith("Write a")
  assert all(e.meta["test_list"] for e in examples)
  _, original = context.load_slice(_load("mbpp").task)  # the `text` field of the original
  assert original[0].id == "11" and original[0].source_text.startswith("Write a python")


@pytest.mark.parametrize("name", CONFIGS)
def test_every_task_config_runs_diversed_with_a_shipped_head(name):
  config = _load(name)
  build._register_shipped_artifacts()
  target = config.model.target
  draft = build.DEFAULT_DRAFTS[target]
  assert build.shipped_head(target, draft, config.head.task or config.task.name), (
      build.fixed_weight_warning(target, draft, config.head.task or config.task.name))


def test_distill_export_is_refused_with_the_command_that_does_it():
  config = _load("gsm8k", **{"mode": "distill", "distill.mode": "export"})
  with pytest.raises(ValueError, match=r"distill.mode='export'.*python -m diversed_jax.distill "
                     r"--config=configs/distill_smollm2.py --config.mode=export "
                     r"--config.export_dir="):
    validate(config)


def test_negative_temperature_message():
  with pytest.raises(ValueError, match=r"^decode.temperature=-0.5: must be >= 0 \(0 = greedy\)$"):
    validate(_load("gsm8k", **{"decode.temperature": -0.5}))


def test_the_preset_is_chosen_by_the_variant_only():
  # An overridable model.preset that nothing read: the variant (`:llama`) is the switch.
  with pytest.raises(KeyError, match="model.preset"):
    _load("gsm8k", **{"model.preset": "llama"})


def test_typical_thresholds_are_in_typical_settings_only():
  def verify_of(delta):
    config = _load("gsm8k", **{"methods.run": "ar,sd,static,typical",
                               "methods.typical_delta": delta})
    return {s.name: s.verify for s in methods.expand(config)}
  low, high = verify_of(0.09), verify_of(0.2)
  for name in ("ar", "sd", "static(w=0.5)"):
    assert low[name] == high[name]
  assert (low["typical"].typical_delta, high["typical"].typical_delta) == (0.09, 0.2)
  assert high["typical"].typical_epsilon == 0.3


@pytest.mark.parametrize("overrides,message", [
    ({"seed": -5}, "seed=-5: must be >= 0"),
    ({"methods.static_weights": (0.5, 0.5)}, "methods.static_weights=(0.5, 0.5): repeats a"),
    ({"mode": "train_and_eval", "task.split": "train"},
     "train.split='train': the head would train on the evaluated examples"),
])
def test_bad_seeds_repeated_settings_and_training_on_the_evaluated_split_are_refused(
    overrides, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    validate(_load("gsm8k", **overrides))


def test_prompts_refuse_shots_that_are_evaluated_examples():
  # The last guard, where the evaluated slice and the shots meet (evaluate and bench):
  # a shot among the examples would show its own solved answer in the prompt.
  config = _load("gsm8k", **{"task.num_shots": 2})
  shots = context.prompt_shots(config)
  task = get_task("gsm8k")
  with pytest.raises(ValueError, match="is also an evaluated example"):
    context.encode_prompts(config, task, shots[:1], tokenizer=None)
