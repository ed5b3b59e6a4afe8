"""The main job end to end on tiny random models: train_and_eval through the real
`python -m diversed_jax.main`, the report files and their columns, and resuming."""

import csv
import dataclasses
import json
import os
import subprocess
import sys

import types

import numpy as np
import pytest

from diversed_jax.evaluation import config_io, evaluate, methods, report
from diversed_jax.evaluation.results import ResultStore
from diversed_jax.speculative import build, loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ("method", "params", "dataset", "n_examples", "acceptance_rate", "tokens_per_round",
            "mean_accepted", "expected_accepted_theory", "quality_metric", "quality",
            "tokens_per_second", "speedup_vs_ar")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tiny") / "models")


def test_train_and_eval_end_to_end(tmp_path, tiny_dir):
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", DIVERSED_TINY_DIR=tiny_dir)
  proc = subprocess.run(
      [sys.executable, "-m", "diversed_jax.main", "--config=configs/gsm8k.py:tiny",
       f"--workdir={workdir}", "--config.mode=train_and_eval",
       "--config.methods.run=ar,sd,static,diversed,smc,ssd",
       "--config.methods.static_weights=(0.4,0.8)", "--config.methods.smc_particles=(2,)",
       "--config.decode.temperature=0.5"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-4000:]
  head = workdir / "train" / "head"
  assert (head / "head.json").is_file()
  rows = json.loads((workdir / "summary.json").read_text())
  assert [r["setting"] for r in rows] == ["ar", "sd", "static(w=0.4)", "static(w=0.8)",
                                          "diversed", "smc(n=2)", "ssd(f=2,c=1)"]
  for row in rows:
    assert set(REQUIRED) <= set(row)
    assert row["n_examples"] == 4 and row["quality_metric"] == "accuracy"
    assert row["dataset"] == "gsm8k:shipped:test"
    assert 0.0 <= row["acceptance_rate"] <= 1.0 and row["tokens_per_second"] > 0
  by_name = {r["setting"]: r for r in rows}
  assert by_name["ar"]["speedup_vs_ar"] == 1.0
  assert by_name["static(w=0.8)"]["params"] == {"weight": 0.8}
  assert by_name["diversed"]["params"]["head"] == str(head)  # the head just trained
  assert 0.0 < by_name["diversed"]["mean_weight"] < 1.0
  smc = by_name["smc(n=2)"]  # every draft committed, weighed instead
  # 2 particles' ESS fraction is in [0.5, 1] whatever the weights, and 1 only if they are
  # equal: well below 1 (0.58 here), the draft's and the target's laws (they differ)
  # weighed them.
  assert smc["acceptance_rate"] == 1.0 and 0.5 <= smc["mean_ess"] < 0.9
  assert smc["params"] == {"particles": 2, "ess_threshold": 0.5}
  assert by_name["sd"]["mean_ess"] is None
  ssd = by_name["ssd(f=2,c=1)"]  # the draft pre-drafting: exact, with its hit rate
  assert 0.0 <= ssd["hit_rate"] <= 1.0 and ssd["params"] == {"fanout": 2, "saguaro_scale": 1.0}
  assert by_name["sd"]["hit_rate"] is None
  with open(workdir / "summary.csv") as f:
    header = next(csv.reader(f))
  assert set(REQUIRED) <= set(header)
  table = (workdir / "summary.md").read_text()
  assert "| setting |" in table and "diversed" in table
  assert table.strip() in proc.stdout  # printed at the end
  assert (workdir / "pareto.png").stat().st_size > 10_000
  lines = (workdir / "results.jsonl").read_text().splitlines()
  assert len(lines) == 7 * 4


class _Stop(Exception):
  pass


def test_resume_after_interruption(tmp_path, tiny_dir, monkeypatch):
  monkeypatch.setenv("DIVERSED_TINY_DIR", tiny_dir)
  config = config_io.load_config(os.path.join(ROOT, "configs", "gsm8k.py:tiny"),
                                 {"methods.run": "ar,sd", "task.limit": 5})
  workdir = str(tmp_path)
  path = os.path.join(workdir, "results.jsonl")
  written = []

  def stop_after_three_batches(setting, records):
    written.append((setting.name, len(records)))
    if len(written) == 3:  # 'ar' done (3 batches: 2 + 2 + 1), 'sd' not started
      raise _Stop

  with pytest.raises(_Stop):
    evaluate.evaluate(config, workdir, log=lambda m: None, after_batch=stop_after_three_batches)
  assert len(open(path).read().splitlines()) == 5
  with open(path, "a") as f:  # a line torn by a kill mid-write
    f.write('{"fingerprint": "abc", "setting": "sd", "exam')
  seen = []
  rows = evaluate.evaluate(config, workdir, log=lambda m: None,
                           after_batch=lambda s, recs: seen.append(s.name))
  assert seen == ["sd"] * 3  # only the unfinished setting ran
  records = [json.loads(line) for line in open(path)]
  keys = [(r["setting"], r["example_id"]) for r in records]
  assert len(keys) == len(set(keys)) == 2 * 5
  assert [r["n_examples"] for r in rows] == [5, 5]
  # A wider slice reuses what is done and adds only the new examples.
  config.unlock()
  config.task.limit = 6
  seen.clear()
  rows = evaluate.evaluate(config, workdir, log=lambda m: None,
                           after_batch=lambda s, recs: seen.append((s.name, len(recs))))
  assert seen == [("ar", 1), ("sd", 1)]
  assert [r["n_examples"] for r in rows] == [6, 6]
  assert len(open(path).read().splitlines()) == 2 * 6


def test_continuous_batching_gives_the_same_per_example_records(tmp_path, tiny_dir,
                                                                 monkeypatch):
  """decode.queue > batch_size decodes more examples per call through the same rows, and
  decode.shrink_tail then finishes with the unfinished rows only; greedy completions and
  each example's rounds and accepted drafts are unchanged (ar and exact SD: greedy, they
  are deterministic)."""
  monkeypatch.setenv("DIVERSED_TINY_DIR", tiny_dir)
  variants = {"static": (0, False), "queued": (5, False), "shrunk": (5, True)}
  records = {}
  for name, (queue, shrink) in variants.items():
    config = config_io.load_config(os.path.join(ROOT, "configs", "gsm8k.py:tiny"),
                                   {"methods.run": "ar,sd", "task.limit": 5,
                                    "decode.temperature": 0.0, "decode.queue": queue,
                                    "decode.shrink_tail": shrink})
    calls = []
    evaluate.evaluate(config, str(tmp_path / name), log=lambda m: None,
                      after_batch=lambda s, recs: calls.append(len(recs)))
    assert calls == ([2, 2, 1] * 2 if queue == 0 else [5] * 2)
    lines = open(tmp_path / name / "results.jsonl").read().splitlines()
    records[name] = {(r["setting"], r["example_id"]): r for r in map(json.loads, lines)}
  assert len(records["static"]) == 10
  for name in ("queued", "shrunk"):
    assert records[name].keys() == records["static"].keys()
    for key, static in records["static"].items():
      got = records[name][key]
      for field in ("completion", "num_tokens", "rounds", "accepted", "reward"):
        assert got[field] == static[field], (name, key, field)
      assert got["theory"] == pytest.approx(static["theory"], rel=1e-5)


def test_a_slice_at_an_offset_gives_the_same_records_as_the_whole(tmp_path, tiny_dir,
                                                                 monkeypatch):
  """Keys follow an example's position in the split, not in the slice: at temperature 1 the
  examples 2 and 3 sample the same whether the slice starts at 0 or at 2 (a whole call of
  batch_size 2 further), and their records carry the same index."""
  monkeypatch.setenv("DIVERSED_TINY_DIR", tiny_dir)
  records = {}
  for offset, limit in ((0, 4), (2, 2)):
    # Whole prompts: the shipped questions are longer than the tiny preset's 96 tokens.
    config = config_io.load_config(os.path.join(ROOT, "configs", "gsm8k.py:tiny"),
                                   {"methods.run": "sd", "decode.temperature": 1.0,
                                    "task.offset": offset, "task.limit": limit,
                                    "task.max_prompt_tokens": 1024})
    workdir = tmp_path / str(offset)
    evaluate.evaluate(config, str(workdir), log=lambda m: None)
    lines = (workdir / "results.jsonl").read_text().splitlines()
    records[offset] = {r["example_id"]: r for r in map(json.loads, lines)}
  assert len(records[0]) == 4 and len(records[2]) == 2
  for example_id, got in records[2].items():
    whole = records[0][example_id]
    for field in ("index", "completion", "num_tokens", "rounds", "accepted"):
      assert got[field] == whole[field], (example_id, field)
  assert sorted(r["index"] for r in records[2].values()) == [2, 3]


def test_a_queue_shorter_than_the_batch_is_refused(tiny_dir, monkeypatch):
  from diversed_jax.evaluation import validate
  monkeypatch.setenv("DIVERSED_TINY_DIR", tiny_dir)
  config = config_io.load_config(os.path.join(ROOT, "configs", "gsm8k.py:tiny"),
                                 {"decode.queue": 1})
  with pytest.raises(ValueError, match="decode.queue"):
    validate.validate(config)


def test_store_drops_a_torn_tail(tmp_path):
  path = str(tmp_path / "r.jsonl")
  store = ResultStore(path)
  store.append([{"fingerprint": "f", "example_id": "a"}, {"fingerprint": "f", "example_id": "b"}])
  with open(path, "a") as f:
    f.write('{"fingerprint": "f", "exa')
  store = ResultStore(path)
  assert store.done("f") == {"a", "b"} and store.done("g") == set()
  assert open(path).read().count("\n") == 2 and open(path).read().endswith("\n")


def test_store_skips_a_bad_middle_line_and_keeps_what_follows(tmp_path, caplog):
  path = str(tmp_path / "r.jsonl")
  store = ResultStore(path)
  store.append([{"fingerprint": "f", "example_id": "a"}])
  with open(path, "a") as f:
    f.write('{"fingerprint": "f", "exa\n')  # a bad line, not the last one
  store.append([{"fingerprint": "f", "example_id": "b"}])
  before = open(path).read()
  with caplog.at_level("WARNING"):
    store = ResultStore(path)
  assert store.done("f") == {"a", "b"}
  assert open(path).read() == before  # nothing deleted
  assert f"{path} line 2 " in caplog.text


def test_report_handles_missing_ar(tmp_path):
  from diversed_jax.evaluation.methods import expand
  config = config_io.load_config(os.path.join(ROOT, "configs", "gsm8k.py"),
                                 {"methods.run": "sd,static"})
  records = [{"rounds": 4, "num_draft": 4, "accepted": 6, "num_tokens": 10, "seconds": 0.5,
              "reward": 1.0, "theory": 5.0}]
  rows = report.summarize([(s, records, {}) for s in expand(config)], "d", "accuracy")
  assert rows[0]["speedup_vs_ar"] is None
  assert rows[0]["acceptance_rate"] == 6 / 16 and rows[0]["tokens_per_round"] == 2.5
  paths = report.write_reports(rows, str(tmp_path))
  assert os.path.getsize(paths["pareto.png"]) > 0


def test_xsum_local_file_with_a_head_from_another_task(tmp_path, tiny_dir, monkeypatch):
  import jax
  from diversed_jax.rl.head import EnsembleHead, init_head
  from diversed_jax.training import head_io
  monkeypatch.setenv("DIVERSED_TINY_DIR", tiny_dir)
  data = tmp_path / "xsum.jsonl"
  data.write_text("".join(json.dumps({"id": f"x{i}", "document": f"The river rose {i} metres.",
                                      "summary": "The river rose."}) + "\n" for i in range(2)))
  # A head "trained on GSM8K": at initialisation it outputs w = 0.8 everywhere.
  module = EnsembleHead(init_weight=0.8)
  head = head_io.save_head(str(tmp_path / "gsm8k_head"), module,
                           init_head(module, jax.random.PRNGKey(0), 32, 32), 32, 32,
                           task="gsm8k")
  config = config_io.load_config(os.path.join(ROOT, "configs", "xsum.py:tiny"),
                                 {"methods.run": "ar,diversed", "task.source": str(data),
                                  "head.path": head})
  rows = evaluate.evaluate(config, str(tmp_path / "run"), log=lambda m: None)
  assert [r["quality_metric"] for r in rows] == ["rouge2", "rouge2"]
  assert rows[0]["n_examples"] == 2 and rows[0]["dataset"] == f"xsum:{data}:test"
  assert rows[1]["params"]["head"] == head
  assert abs(rows[1]["mean_weight"] - 0.8) < 1e-4


def test_bench_mode(tmp_path, tiny_dir, monkeypatch):
  from diversed_jax.evaluation import runner
  monkeypatch.setenv("DIVERSED_TINY_DIR", tiny_dir)
  config = config_io.load_config(os.path.join(ROOT, "configs", "gsm8k.py:tiny"),
                                 {"mode": "bench", "methods.run": "ar,sd"})
  rows = runner.run(config, str(tmp_path), log=lambda m: None)
  assert [r["setting"] for r in rows] == ["ar", "sd"]
  assert rows[0]["speedup_vs_ar"] == 1.0 and rows[1]["tokens_per_second"] > 0
  assert (tmp_path / "bench.md").is_file() and (tmp_path / "bench.json").is_file()


def test_distill_mode_runs_the_distill_job(tmp_path, monkeypatch):
  from diversed_jax.distill import train as distill_train
  from diversed_jax.evaluation import runner
  seen = []
  monkeypatch.setattr(distill_train, "run", seen.append)
  monkeypatch.chdir(ROOT)
  config = config_io.load_config(os.path.join(ROOT, "configs", "gsm8k.py"),
                                 {"mode": "distill", "distill.mode": "data"})
  runner.run(config, str(tmp_path), log=lambda m: None)
  assert len(seen) == 1 and seen[0].mode == "data"


class _FakeDecoder:
  """Each prompt of a call decodes in its own column for 3 rounds, each round accepting 1 of
  K = 2 drafts with w = (0.2, 0.4, 0.6) at the three positions; a call lasts 1 s per prompt."""

  def __init__(self):
    self.calls = []

  def generate(self, prompts, verify, *, num_draft, max_new_tokens, seed, batch_size):
    del verify, num_draft, max_new_tokens, seed, batch_size
    n = len(prompts)
    self.calls.append(n)
    shape = (3, n)
    stats = loop.RoundStats(
        active_rb=np.ones(shape, bool), prompt_rb=np.broadcast_to(np.arange(n), shape),
        num_accepted_rb=np.ones(shape, np.int32),
        accept_prob_rbk=np.full(shape + (2,), 0.5, np.float32),
        beta_rbk=np.full(shape + (2,), 0.5, np.float32),
        weights_rbk=np.broadcast_to(np.float32([0.2, 0.4, 0.6]), shape + (3,)),
        width_r=np.full(3, n, np.int32))
    return types.SimpleNamespace(token_ids=[[5] * 6] * n, seconds=float(n), stats=stats,
                                 compile_seconds=0.0)


class _FakeTokenizer:
  def encode(self, text, add_special_tokens=True):
    return [1] + [ord(c) % 50 for c in text[:20]]

  def decode(self, ids, skip_special_tokens=True):
    return "The answer is 3."


def _fake_models(head="/heads/gsm8k"):
  decoder = _FakeDecoder()
  return types.SimpleNamespace(decoder_for=lambda setting: decoder, tokenizer=_FakeTokenizer(),
                               info={"target": "t", "draft": "d", "head": head},
                               decoder=decoder)


def _gsm8k_config(**overrides):
  return config_io.load_config(os.path.join(ROOT, "configs", "gsm8k.py"),
                               {"model.chat": False, **overrides})


def _run(config, setting, tmp_path):
  from diversed_jax.tasks.registry import get_task
  task = get_task("gsm8k")
  examples = task.load(limit=config.task.limit)
  models = _fake_models()
  store = ResultStore(str(tmp_path / f"{setting.name}.jsonl"))
  evaluate.run_setting(setting, "fp", config, models, task, examples,
                       [[1]] * len(examples), store, log=lambda m: None)
  return models.decoder.calls, store.records("fp")


def test_padding_prompts_time_is_not_charged_to_real_examples(tmp_path):
  # 9 examples, 8 a call: the second call is 1 example padded to one batch of 2 prompts.
  config = _gsm8k_config(**{"decode.batch_size": 2, "decode.queue": 8, "methods.run": "ar",
                            "task.limit": 9})
  calls, records = _run(config, methods.expand(config)[0], tmp_path)
  assert calls == [8, 2]
  assert [r["seconds"] for r in records] == pytest.approx([1.0] * 9)


def test_a_short_call_is_padded_to_batch_size_times_a_power_of_two():
  # Each padded length is one more compiled program: at most log2(queue / batch) + 1 of them.
  decode = types.SimpleNamespace(batch_size=2, queue=12)
  sizes = [evaluate.padded_call_size(n, decode) for n in range(1, 13)]
  assert sizes == [2, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12]
  assert evaluate.padded_call_size(3, types.SimpleNamespace(batch_size=4, queue=0)) == 4


def test_weight_is_the_mean_over_committed_positions_and_cascade_has_none(tmp_path):
  config = _gsm8k_config(**{"methods.run": "static,cascade,diversed",
                            "methods.static_weights": (0.5,), "task.limit": 2})
  weights = {}
  for setting in methods.expand(config):
    _, records = _run(config, setting, tmp_path)
    weights[setting.family] = [r.get("weight") for r in records]
  # n = 1 accepted draft a round: w at d_1 (0.2) and at the residual's position (0.4).
  assert weights["static"] == pytest.approx([0.3, 0.3])
  assert weights["diversed"] == pytest.approx([0.3, 0.3])
  assert weights["cascade"] == [None, None]


def test_diversed_with_a_fixed_weight_is_reported(tmp_path):
  config = _gsm8k_config(**{"methods.run": "diversed", "task.limit": 2})

  def warnings_with(head):
    lines = []
    evaluate.evaluate(config, str(tmp_path / head.replace("/", "_")),
                      models=_fake_models(head), log=lines.append)
    return [line for line in lines if line.startswith("WARNING")]

  assert warnings_with("/heads/gsm8k") == []
  (warning,) = warnings_with(build.FIXED_HEAD)
  assert "fixed w=0.5" in warning and "task 'gsm8k'" in warning


def test_fingerprint_follows_the_call_layout_and_only_its_own_rule_fields():
  models = _fake_models()
  run = "ar,sd,typical"

  def fingerprints(**overrides):
    config = _gsm8k_config(**{"methods.run": run, **overrides})
    return {s.name: evaluate.setting_fingerprint(config, s, models)
            for s in methods.expand(config)}

  base = fingerprints()
  assert fingerprints(**{"decode.queue": 4}) == base  # queue = batch_size: the same calls
  for change in ({"decode.batch_size": 2}, {"decode.queue": 8}, {"decode.shrink_tail": True}):
    changed = fingerprints(**change)
    assert all(changed[name] != base[name] for name in base), change
  typical = fingerprints(**{"methods.typical_delta": 0.2})
  assert typical["ar"] == base["ar"] and typical["sd"] == base["sd"]
  assert typical["typical"] != base["typical"]
  # The fields added in sessions 48-49 (SMC's, mentored's divergence, SSD's) at their
  # defaults are not hashed, so records written before they existed keep their
  # fingerprints; moved, they change their own method's settings only.
  sd = next(s for s in methods.expand(_gsm8k_config(**{"methods.run": "sd"})))
  before = {k: v for k, v in dataclasses.asdict(sd.verify).items()
            if k not in ("particles", "ess_threshold", "divergence", "fanout",
                         "guess_budget", "saguaro_scale")}
  assert evaluate.verify_fields(sd.verify) == before
  smc_base = fingerprints(**{"methods.run": "sd,smc"})
  moved = fingerprints(**{"methods.run": "sd,smc", "methods.smc_ess_threshold": 0.2})
  assert moved["sd"] == smc_base["sd"] and moved["smc(n=4)"] != smc_base["smc(n=4)"]
  ssd_base = fingerprints(**{"methods.run": "sd,ssd"})
  moved = fingerprints(**{"methods.run": "sd,ssd", "methods.ssd_fanout": 3})
  assert moved["sd"] == ssd_base["sd"] and moved["ssd(f=3,c=1)"] != ssd_base["ssd(f=2,c=1)"]
  moved = fingerprints(**{"methods.run": "sd,ssd", "methods.ssd_guess_budget": 4})
  assert moved["sd"] == ssd_base["sd"]
  assert moved["ssd(f=2,b=4,c=1)"] != ssd_base["ssd(f=2,c=1)"]


def test_a_raised_scoring_version_changes_the_tasks_fingerprints(monkeypatch):
  """Results scored by an older answer extraction are decoded and scored again."""
  from diversed_jax.tasks import registry
  models = _fake_models()
  config = _gsm8k_config(**{"methods.run": "ar,sd"})
  fingerprints = lambda: {s.name: evaluate.setting_fingerprint(config, s, models)
                          for s in methods.expand(config)}
  before = fingerprints()
  gsm8k = registry.get_task("gsm8k")
  monkeypatch.setitem(registry._TASKS, "gsm8k",
                      dataclasses.replace(gsm8k, scoring_version=gsm8k.scoring_version + 1))
  after = fingerprints()
  assert all(after[name] != before[name] for name in before)
