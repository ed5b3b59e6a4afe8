"""Task data, prompts and the registry: shipped samples, local files, errors, token ids."""

import dataclasses
import json
import os
import types

import pytest

from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.tasks import datasets, gsm8k, prompts, registry
from diversed_jax.tasks.datasets import Example
from diversed_jax.tasks.registry import TASK_NAMES, Task, get_task


class FakeTokenizer:
  """Characters as ids; BOS 1 when special tokens are added; a visible chat template."""
  bos_id = 1

  def __init__(self, chat_template=None):
    self.chat_template = chat_template
    self.calls = []

  def encode(self, text, add_special_tokens=True):
    self.calls.append(("encode", text, add_special_tokens))
    return ([self.bos_id] if add_special_tokens else []) + [ord(c) for c in text]

  def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
    self.calls.append(("chat", messages, tokenize, add_generation_prompt))
    assert not tokenize
    text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


@pytest.mark.parametrize("task, split, count, first_id", [
    ("gsm8k", "test", 200, "gsm8k/test/0"),
    ("gsm8k", "train", 300, "gsm8k/train/0"),
    ("cnndm", "test", 100, "469c6ac05092ca5997728c9dfc19f9ab6b936e40"),
    ("cnndm", "train", 100, None),
    ("cnndm", "train_more", 1305, None),
    ("mbpp", "prompt", 10, "1"),
    ("mbpp", "test", 500, "11"),
    ("mbpp", "validation", 90, "511"),
    ("mbpp", "train", 374, "601"),
    ("mbpp", "all", 974, "1"),
    ("humaneval", "test", 164, "HumanEval/0"),
])
def test_shipped_samples(task, split, count, first_id):
  examples = datasets.load_examples(task, split=split)
  assert len(examples) == count
  assert all(ex.task == task and ex.source_text and ex.reference for ex in examples)
  assert len({ex.id for ex in examples}) == count
  if first_id is not None:
    assert examples[0].id == first_id
  for name in ("SOURCE.md",):
    assert os.path.isfile(datasets.shipped_path(task, name))


def test_shipped_record_contents():
  ex = datasets.load_examples("gsm8k", limit=1)[0]
  assert ex.reference == "18" and ex.meta["solution"].endswith("#### 18")
  assert ex.source_text.startswith("Janet")
  mbpp = datasets.load_examples("mbpp", split="test", limit=1)[0]
  assert mbpp.meta["test_list"][0].startswith("assert remove_Occ")
  assert mbpp.reference == "\n".join(mbpp.meta["test_list"])
  assert "def remove_Occ" in mbpp.meta["solution"] and mbpp.meta["test_setup_code"] == ""
  he = datasets.load_examples("humaneval", limit=1)[0]
  assert he.meta["entry_point"] == "has_close_elements" and "def check" in he.reference
  sanitized = datasets.load_examples("mbpp", source="sanitized", split="all")
  assert len(sanitized) == 427 and sanitized[0].source_text.startswith("Write a function")
  assert any(ex.meta["test_setup_code"] for ex in sanitized)  # from test_imports lists
  assert len(datasets.load_examples("mbpp", source="sanitized")) == 257  # test split
  with pytest.raises(dataclasses.FrozenInstanceError):
    ex.reference = "19"
  assert datasets.load_examples("cnndm", limit=3) == datasets.load_examples("cnndm")[:3]


def _write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def test_local_xsum_file_with_its_own_field_names(tmp_path):
  records = [{"id": "a1", "document": "The council met on Monday.", "summary": "Council met."},
             {"id": "a2", "document": "Rain fell all week.", "summary": "It rained."}]
  path = _write_jsonl(tmp_path / "xsum.jsonl", records)
  examples = datasets.load_examples("xsum", source=path)
  assert [(e.id, e.source_text, e.reference) for e in examples] == [
      ("a1", "The council met on Monday.", "Council met."),
      ("a2", "Rain fell all week.", "It rained.")]
  # Other names, mapped by `fields`; no id field gives positional ids.
  renamed = [{"text": r["document"], "headline": r["summary"]} for r in records]
  path = _write_jsonl(tmp_path / "other.jsonl", renamed)
  examples = datasets.load_examples("xsum", source=path, limit=1,
                                    fields={"source_text": "text", "reference": "headline"})
  assert examples == [Example("xsum/test/0", "xsum", "The council met on Monday.",
                              "Council met.", {})]
  # A JSON array works too.
  array = tmp_path / "array.json"
  array.write_text(json.dumps(records))
  assert len(datasets.load_examples("xsum", source=str(array))) == 2


def test_local_file_errors_name_the_problem(tmp_path):
  path = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "x", "headline": "y"}])
  with pytest.raises(ValueError) as err:
    datasets.load_examples("xsum", source=path)
  message = str(err.value)
  assert "'document'" in message and "source_text" in message
  assert "['headline', 'text']" in message and path in message
  missing = str(tmp_path / "nope.jsonl")
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    datasets.load_examples("cnndm", source=missing)
  (tmp_path / "broken.jsonl").write_text('{"id": 1}\n{not json\n')
  with pytest.raises(ValueError, match="broken.jsonl:2"):
    datasets.load_examples("cnndm", source=str(tmp_path / "broken.jsonl"))
  with pytest.raises(ValueError, match="unknown task 'squad'.*gsm8k"):
    datasets.load_examples("squad")
  with pytest.raises(ValueError, match="no shipped sample for split 'validation'"):
    datasets.load_examples("gsm8k", split="validation")
  with pytest.raises(ValueError, match="nothing is shipped"):
    datasets.load_examples("xsum")


def test_bad_limits_splits_and_repeated_ids_are_refused(tmp_path):
  # limit=-1 would drop the last example, limit=0 keep none.
  for limit in (0, -1):
    with pytest.raises(ValueError, match=rf"limit={limit}: must be >= 1"):
      datasets.load_examples("gsm8k", limit=limit)
  assert len(datasets.load_examples("gsm8k", limit=1)) == 1
  # An unknown split of the sanitized set kept every record.
  with pytest.raises(ValueError, match=r"split 'tset'.*\['prompt', 'test'"):
    datasets.load_examples("mbpp", source="sanitized", split="tset")
  from diversed_jax.evaluation import config_io, validate
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  config = config_io.load_config(os.path.join(root, "configs", "mbpp.py"),
                                 {"task.source": "sanitized", "task.split": "tset"})
  with pytest.raises(ValueError, match=r"task.split='tset': the shipped sanitized mbpp"):
    validate.validate(config)
  # Results are keyed by id: a file repeating one is refused, naming the id and the file.
  records = [{"id": "a1", "document": "One.", "summary": "1."},
             {"id": "a2", "document": "Two.", "summary": "2."},
             {"id": "a1", "document": "Three.", "summary": "3."}]
  path = _write_jsonl(tmp_path / "dup.jsonl", records)
  with pytest.raises(ValueError, match=r"id 'a1' appears more than once in .*dup.jsonl"):
    datasets.load_examples("xsum", source=path)
  assert [e.id for e in datasets.load_examples("xsum", source=path, limit=2)] == ["a1", "a2"]


def test_hub_failure_suggests_a_local_file(monkeypatch):
  import datasets as hf_datasets
  calls = []

  def offline(*args, **kwargs):
    calls.append((args, kwargs))
    raise ConnectionError("Couldn't reach the Hugging Face Hub")
  monkeypatch.setattr(hf_datasets, "load_dataset", offline)
  with pytest.raises(RuntimeError, match="local JSON/JSONL file") as err:
    datasets.load_examples("xsum", source="EdinburghNLP/xsum", limit=5)
  assert "EdinburghNLP/xsum" in str(err.value) and "ConnectionError" in str(err.value)
  assert calls == [(("EdinburghNLP/xsum", None), {"split": "test[:5]"})]
  with pytest.raises(RuntimeError):
    datasets.load_examples("mbpp", source="google-research-datasets/mbpp:sanitized")
  assert calls[-1][0] == ("google-research-datasets/mbpp", "sanitized")


def test_hub_records_are_mapped(monkeypatch):
  import datasets as hf_datasets
  rows = [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}]
  monkeypatch.setattr(hf_datasets, "load_dataset", lambda *a, **k: rows)
  (ex,) = datasets.load_examples("gsm8k", source="openai/gsm8k")
  assert ex.reference == "4" and ex.source_text == "What is 2+2?"


def test_truncate():
  text = "one two  three\nfour five"
  assert prompts.truncate(text) == text
  assert prompts.truncate(text, max_words=3) == "one two  three ..."
  assert prompts.truncate(text, max_words=5) == text
  assert prompts.truncate(text, max_chars=7) == "one two ..."
  assert prompts.truncate(text, max_words=4, max_chars=100) == "one two  three\nfour ..."


def test_gsm8k_prompt_zero_and_few_shot():
  ex = datasets.load_examples("gsm8k", limit=1)[0]
  zero = prompts.build_prompt(ex)
  assert zero.startswith(prompts.GSM8K_INSTRUCTION) and "The answer is N" in zero
  assert zero.endswith(f"Question: {ex.source_text}\nAnswer:")
  shots = prompts.load_shots("gsm8k", 2)
  assert [s.id for s in shots] == ["gsm8k/train/0", "gsm8k/train/1"]
  few = prompts.build_prompt(ex, shots)
  assert shots[0].source_text in few and f"The answer is {shots[0].reference}." in few
  assert "<<" not in few and "####" not in few
  assert few.index(shots[1].source_text) < few.index(ex.source_text)


def test_summary_prompts_truncate_the_article():
  ex = datasets.load_examples("cnndm", limit=1)[0]
  text = prompts.build_prompt(ex, max_source_words=50)
  assert text.startswith(prompts.SUMMARY_INSTRUCTION["cnndm"]) and text.endswith("Summary:")
  article = text.split("Article: ", 1)[1]
  assert len(article.split()) <= 50 + 2 and " ..." in article
  assert len(prompts.build_prompt(ex, max_source_chars=300)) < 500
  shots = prompts.load_shots("cnndm", 1)
  with_shot = prompts.build_prompt(ex, shots, max_source_words=30)
  assert f"Summary: {shots[0].reference}" in with_shot
  xsum = Example("x", "xsum", "A long article " * 100, "Short.", {})
  assert "one sentence" in prompts.build_prompt(xsum, max_source_words=20)
  task = get_task("cnndm")
  assert len(task.prompt(ex).split()) < task.max_source_words + 40


def test_code_prompts():
  ex = datasets.load_examples("mbpp", limit=1)[0]
  text = prompts.build_prompt(ex)
  assert ex.source_text in text and ex.meta["test_list"][0] in text
  assert ex.meta["test_list"][1] not in text  # one test only: the signature hint
  shots = prompts.load_shots("mbpp", 3)
  assert [s.id for s in shots] == ["2", "3", "4"]
  few = prompts.build_prompt(ex, shots)
  assert "```python\ndef similar_elements" in few and "\r" not in few
  he = datasets.load_examples("humaneval", limit=1)[0]
  assert prompts.build_prompt(he, chat=False) == he.source_text
  chat = prompts.build_prompt(he)
  assert he.source_text.rstrip() in chat and chat.startswith(prompts.HUMANEVAL_INSTRUCTION)
  with pytest.raises(ValueError, match="no train split"):
    prompts.load_shots("humaneval", 1)
  assert prompts.load_shots("humaneval", 0) == []


def _text(ids):
  return "".join(chr(i) for i in ids)


def test_a_prompt_over_its_budget_keeps_its_template_and_instruction():
  # Ids are characters: the budget counts characters. A cut from the left would lose the
  # "<user>" header and the instruction; shortening keeps both and the article's end marker.
  tok = FakeTokenizer(chat_template="{{ messages }}")
  article = lambda i: " ".join(f"w{i}" for _ in range(500))
  ex = Example("e", "cnndm", article(0), "Ref.", {})
  shots = [Example(f"s{i}", "cnndm", article(i), "Shot summary.", {}) for i in (1, 2)]
  header = "<user>" + prompts.SUMMARY_INSTRUCTION["cnndm"]
  full, cut = prompts.fit_prompt_ids(ex, shots, tok, 10_000, max_source_words=400)
  assert not cut and len(full) > 3_000
  ids, cut = prompts.fit_prompt_ids(ex, shots, tok, 900, max_source_words=400)
  text = _text(ids)
  assert cut and len(ids) <= 900 and text.startswith(header)
  assert text.endswith("\nSummary:</user><assistant>") and text.count("Article: ") == 3
  ids, cut = prompts.fit_prompt_ids(ex, shots, tok, 300, max_source_words=400)
  text = _text(ids)  # articles at MIN_SOURCE_WORDS are still too long: the shots go
  assert cut and len(ids) <= 300 and text.startswith(header) and text.count("Article: ") == 1
  # A GSM8K prompt has no article to cut: shots go, then the question keeps its end; when
  # the instruction alone is too long the prompt comes back whole for the caller.
  question = Example("q", "gsm8k", "Tom has 3 apples. " * 15 + "How many?", "3", {})
  gsm_shots = [Example("g", "gsm8k", "One plus one?", "2", {"solution": "1+1=2\n#### 2"})]
  gsm_header = "<user>" + prompts.GSM8K_INSTRUCTION
  ids, cut = prompts.fit_prompt_ids(question, gsm_shots, tok, 500)
  assert cut and len(ids) <= 500 and _text(ids).startswith(gsm_header)
  assert "One plus one" not in _text(ids) and question.source_text in _text(ids)
  ids, cut = prompts.fit_prompt_ids(question, gsm_shots, tok, 300)
  text = _text(ids)
  assert cut and 280 < len(ids) <= 300 and text.startswith(gsm_header)
  assert "Question: ... " in text and text.endswith("apples. How many?\nAnswer:</user><assistant>")
  whole, _ = prompts.fit_prompt_ids(question, gsm_shots, tok, 10_000)
  assert prompts.fit_prompt_ids(question, gsm_shots, tok, 100) == (whole, False)
  task = get_task("cnndm")
  assert task.prompt_ids(ex, shots, tok, 900) == prompts.fit_prompt_ids(
      ex, shots, tok, 900, max_source_words=task.max_source_words)


def test_local_sources_and_where_shots_come_from(tmp_path):
  odd = tmp_path / "gsm8k_test.ndjson"  # an existing file is local, whatever its suffix
  odd.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
  assert datasets.is_local(str(odd)) and datasets.is_local("x.jsonl")
  assert not datasets.is_local("openai/gsm8k")
  assert prompts.shot_origin("gsm8k", str(odd)) == (None, "train")
  assert prompts.shot_origin("mbpp", None) == (None, "prompt")
  assert prompts.shot_origin("cnndm", "abisee/cnn_dailymail") == ("abisee/cnn_dailymail",
                                                                   "train")


def test_shots_that_are_evaluated_examples_are_refused(tmp_path):
  from diversed_jax.evaluation import validate
  # A copy of the whole MBPP file read as the evaluated data holds the shots (ids 2, 3, 4).
  copy = tmp_path / "mbpp_full.jsonl"
  copy.write_bytes(open(datasets.shipped_path("mbpp", "mbpp.jsonl"), "rb").read())
  task_cfg = types.SimpleNamespace(name="mbpp", source=str(copy), split="test", num_shots=3)
  with pytest.raises(ValueError, match=r"task.num_shots=3: .*evaluated data itself"):
    validate.check_shots_apart(task_cfg)
  examples = datasets.load_examples("mbpp", source=str(copy), split="test")
  shots = prompts.load_shots("mbpp", 3)
  with pytest.raises(ValueError, match=r"task.num_shots=3: few-shot example '2' is also an "
                                       r"evaluated example \('2', the same id\)"):
    prompts.check_shots_disjoint(examples, shots)
  prompts.check_shots_disjoint(examples[10:], shots)  # the test split's slice: apart
  # Without ids the text tells: a gsm8k file holding a shipped train question.
  train = datasets.load_examples("gsm8k", split="train", limit=2)
  path = _write_jsonl(tmp_path / "g.jsonl", [
      {"question": "An unseen question?", "answer": "#### 1"},
      {"question": train[1].source_text + "\n", "answer": train[1].meta["solution"]}])
  evaluated = datasets.load_examples("gsm8k", source=path, split="train")
  with pytest.raises(ValueError, match=r"'gsm8k/train/1'.*the same text"):
    prompts.check_shots_disjoint(evaluated, train)
  # Positional ids name places: the same one over other texts is no leak.
  prompts.check_shots_disjoint(evaluated[:1], train)
  prompts.check_shots_disjoint(examples, [])


def test_encode_prompt_chat_and_base():
  chat_tok = FakeTokenizer(chat_template="{{ messages }}")
  ids = tokenizer_lib.encode_prompt(chat_tok, "Hi")
  expected = "<user>Hi</user><assistant>"
  assert ids == [ord(c) for c in expected]
  assert chat_tok.calls[-1] == ("encode", expected, False)
  ids = tokenizer_lib.encode_prompt(chat_tok, "Hi", system="Be brief.")
  assert ids == [ord(c) for c in "<system>Be brief.</system>" + expected]
  base_tok = FakeTokenizer()
  assert tokenizer_lib.encode_prompt(base_tok, "Hi") == [1, ord("H"), ord("i")]
  assert tokenizer_lib.encode_prompt(chat_tok, "Hi", chat=False) == [1, ord("H"), ord("i")]
  with pytest.raises(ValueError, match="no chat template"):
    tokenizer_lib.encode_prompt(base_tok, "Hi", chat=True)


def test_registry():
  metrics = {name: get_task(name).metric for name in TASK_NAMES}
  assert metrics == {"gsm8k": "accuracy", "cnndm": "rouge2", "xsum": "rouge2",
                     "mbpp": "pass@1", "humaneval": "pass@1"}
  for name in TASK_NAMES:
    assert get_task(name).fields
  # One list of names: the registry's tasks are the loaders' (datasets.TASKS).
  assert tuple(registry._TASKS) == TASK_NAMES == datasets.TASKS
  # Budgets and sources are the configs' (decode.max_new_tokens, task.source): a Task
  # carries only what its methods read, and the version of its scoring (fingerprints).
  assert [f.name for f in dataclasses.fields(Task)] == [
      "name", "fields", "metric", "max_source_words", "eval_split", "scoring_version"]
  assert get_task("gsm8k").scoring_version == 1  # the session-51 answer extraction
  # Summaries cut before a new 'Article:' / 'Summary:' line the completion runs on into.
  assert get_task("cnndm").scoring_version == get_task("xsum").scoring_version == 1
  assert get_task("mbpp").scoring_version == get_task("humaneval").scoring_version == 1
  assert get_task("xsum").fields["source_text"] == "document"
  with pytest.raises(ValueError, match=r"unknown task 'gsm'.*\['gsm8k', 'cnndm'"):
    get_task("gsm")


def test_task_rewards_and_quality():
  gsm = get_task("gsm8k")
  examples = gsm.load(limit=2)
  completions = [f"... The answer is {examples[0].reference}.", "The answer is -1."]
  assert gsm.rewards(completions, examples) == [1.0, 0.0]
  assert gsm.quality(completions, examples) == 0.5
  cnndm = get_task("cnndm")
  ex = cnndm.load(limit=1)
  assert cnndm.reward(ex[0].reference, ex[0]) == 1.0
  assert 0.0 <= cnndm.reward("Something else entirely.", ex[0]) < 0.1
  with pytest.raises(ValueError, match="1 completions for 2 examples"):
    gsm.rewards(["x"], examples)


# GSM8K answers: our prompt ends in "Question: ...\nAnswer:" (prompts._gsm8k), so a completion
# may repeat that header before its reasoning, and may run on into a new question after its
# answer.
@pytest.mark.parametrize("completion, expected", [
    # The header opens reasoning: its first number (16) is not the answer.
    ("Answer: Janet's ducks lay 16 eggs. She eats 3 and bakes with 4.\n"
     "16 - 3 - 4 = 9 eggs, sold at $2: 9 * 2 = 18. The answer is 18.", "18"),
    ("**Answer:** She sells 9 eggs for $2 each, so she makes 18 dollars.", "18"),  # last number
    # Text after the model's answer that starts a new question does not win, "####" or not.
    ("The answer is 18.\n\nQuestion: Tom has 3 bags of 2 apples.\nAnswer: 3 * 2 = 6\n#### 7",
     "18"),
    ("So she earns $18.\n#### 18\n\nQuestion: What is 3 + 4?\nThe answer is 7.", "18"),
    # A header holding only a number states it.
    ("Answer: 18", "18"),
    ("She makes 9 * 2 = 18 dollars.\n**Answer:** $1,080.", "1080"),
    ("Answer:\n16 - 3 - 4 = 9, and 9 * 2 = 18", "18"),  # no marker: the last number
    ("Final answer: 42 (from 6 * 7)", "42"),  # 'answer:' inside a line is a marker
    ("The answer is .5", "0.5"),
    ("It grows by -.25 each day", "-0.25"),
    ("versions 1.2.5 and 3", "3"),
])
def test_gsm8k_the_models_own_answer_statement_wins(completion, expected):
  assert gsm8k.extract_answer(completion) == expected


# The answer is the model's last statement of it, within this problem: an early 'answer' in
# the reasoning, an answer in words, or a new question the model invents does not win.
@pytest.mark.parametrize("completion, expected", [
    ("To find the answer: we compute 16-3-4=9, then 9*2 = 18.\nSo she makes $18.", "18"),
    ("we know the answer is in dollars: 18 * 2 = 36. The answer is 36.", "36"),
    ("we know the answer is in dollars: 18 * 2 = 36.", "36"),  # the result, not an operand
    ("The answer is: eighteen dollars. Next, 4 more", None),  # in words: nothing before it
    ("9 * 2 = 18. The answer is eighteen. Next, 4 more", "18"),
    ("She has 3 + 4 = 7 apples.\n\nQuestion: How many pears?\nAnswer: 5", "7"),
    ("She has 7 apples.\nQ: What is 2 + 3?\nA: 5", "7"),
    ("The answer is 5. Checking: 2 + 3 = 5, so the answer is 5 * 200 = 1,000.", "1000"),
    ("First 4, then 8.\n#### 12\nThe answer is 8.", "12"),  # '####' wins
    ("Total: $1,234.50 spent. The answer is $1,234.50.", "1234.5"),
    ("The temperature is 3 - 5 = -2 degrees. The answer is -2.", "-2"),
    ("The final answer is: **$2,000**", "2000"),
    ("Each costs 0.25, so 4 cost 1.00. Final answer: 1", "1"),
    ("The answer is 0.5 hours.", "0.5"),
])
def test_gsm8k_the_last_statement_within_the_problem_wins(completion, expected):
  assert gsm8k.extract_answer(completion) == expected


def test_gsm8k_reference_is_after_its_last_hashes():
  # A worked answer may say "answer is" before its final '#### N'.
  solution = "The answer is not 5: she has 5 + 3 = 8.\n#### 8"
  assert gsm8k.reference_answer(solution) == "8"
  assert gsm8k.reference_answer("72") == "72"
  assert gsm8k.gsm8k_reward("The answer is 8.", solution) == 1.0
  record = {"question": "How many?", "answer": solution}
  assert datasets._to_example("gsm8k", record, datasets.default_fields("gsm8k"), ("id",),
                              "file", 0, "test").reference == "8"
