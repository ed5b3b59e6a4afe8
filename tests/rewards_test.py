"""Task rewards: GSM8K answer extraction, ROUGE, and the code benchmarks' reference solutions."""

import os

import pytest
from rouge_score import rouge_scorer

from diversed_jax.tasks import code, datasets, gsm8k, sandbox, summarization
from diversed_jax.tasks.registry import get_task

# Reference programs get a generous timeout: the machine is shared, and a few references are
# slow by design (MBPP 123 sums amicable numbers below 10,000 in ~2-5 s).
REFERENCE_TIMEOUT_S = 30.0
WORKERS = 2
# MBPP tasks whose test_setup_code builds trees with the solution's own `Node` class: they
# pass only with the setup after the code (code.mbpp_program).
MBPP_SETUP_USES_SOLUTION = {"367", "927"}
# Set to run all 974 MBPP tasks (and all 427 sanitized ones) instead of the fixed samples
# (~1 minute each on 2 busy cores).
FULL = os.environ.get("DIVERSED_FULL_BENCH_TESTS") == "1"


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
    ("The answer is 1,234.", "1234"),
    ("So the total is $1,234.50. The answer is $1,234.50.", "1234.5"),
    ("The answer is -7.", "-7"),
    ("The temperature dropped to \u221212 degrees.", "-12"),
    ("She has 8 - 3 = 5 apples left", "5"),
    ("He paid $18 in total", "18"),
    ("The final answer is: 42\n\nQuestion: Tom has 7 apples. The answer is 7", "42"),
    ("Answer: 0.50", "0.5"),
    ("\\boxed{1000000}", "1000000"),
    ("We get 3.25 hours, i.e. 3.25", "3.25"),
    ("Numbers 2,3,4 sum to 9", "9"),
    ("It costs -$5 after the refund", "-5"),
    ("#### 1,000,000", "1000000"),
    ("There were 007 bonds", "7"),
    ("no number here", None),
    ("the answer is clearly large, about 40 or 41", "40"),
])
def test_extract_answer(text, expected):
  assert gsm8k.extract_answer(text) == expected


def test_gsm8k_reward():
  assert gsm8k.gsm8k_reward("so 5 * 200 = 1000. The answer is 1,000.", "1000") == 1.0
  assert gsm8k.gsm8k_reward("The answer is 1000.00", "He earns #### 1,000") == 1.0
  assert gsm8k.gsm8k_reward("The answer is 999.", "1000") == 0.0
  assert gsm8k.gsm8k_reward("I don't know.", "1000") == 0.0
  assert gsm8k.gsm8k_reward("The answer is -3", "-3") == 1.0


def test_every_shipped_gsm8k_solution_gives_its_own_answer():
  for split in ("train", "test"):
    for ex in datasets.load_examples("gsm8k", split=split):
      final = ex.meta["solution"].rsplit("####", 1)[1].strip().replace(",", "")
      assert ex.reference == final, ex.id
      assert gsm8k.gsm8k_reward(ex.meta["solution"], ex.reference) == 1.0


def test_rouge_matches_rouge_score():
  scorer = rouge_scorer.RougeScorer(["rouge2", "rougeL"], use_stemmer=True)
  pairs = [(ex.source_text[:400], ex.reference) for ex in datasets.load_examples(
      "cnndm", limit=5)]
  pairs += [("The cats were running quickly.", "A cat runs quickly."), ("", "anything"),
            ("identical words here", "identical words here")]
  for prediction, reference in pairs:
    expected = scorer.score(reference, prediction)
    assert summarization.rouge2(prediction, reference) == expected["rouge2"].fmeasure
    assert summarization.rouge_l(prediction, reference) == expected["rougeL"].fmeasure
    assert summarization.summarization_reward(prediction, reference) == pytest.approx(
        expected["rouge2"].fmeasure)
  scores = summarization.rouge_scores("a b c d", "a b c e")
  assert set(scores) == {"rouge1", "rouge2", "rougeL", "rougeLsum"}
  assert scores["rouge2"] == pytest.approx(2 / 3)


def test_summary_reward_stops_where_the_completion_runs_on_into_a_new_article():
  reference = "Police arrested a man in Boston.\nHe was charged with theft."
  summary = "A man was arrested by police in Boston.\nHe was charged with theft."
  alone = summarization.summarization_reward(summary, reference)
  for run_on in ("\n\nArticle: The city council met on Tuesday to discuss the new budget.",
                 "\nSUMMARY: The council voted on the budget for the coming year.",
                 "\n\n  article : Rain fell all week in the north of the country."):
    assert summarization.summarization_reward(summary + run_on, reference) == alone
  # The first line may repeat the prompt's header; a mid-line 'summary:' is the text's.
  assert summarization.own_summary("Summary: A man.\nArticle: x") == "Summary: A man."
  assert summarization.own_summary(" A summary: of it.\nMore. ") == "A summary: of it.\nMore."


def test_extract_code():
  assert code.extract_code("Here:\n```python\ndef f():\n  return 1\n```\nDone") == (
      "def f():\n  return 1")
  assert code.extract_code("```\nx = 1\n```") == "x = 1"
  two = "```text\nnot code\n```\n```py\ndef g(): pass\n```\n```python\ndef f(): pass\n```"
  assert code.extract_code(two) == "def g(): pass"
  assert code.extract_code(two, entry_point="f") == "def f(): pass"
  assert code.extract_code("```python\ndef f():\n    return 2\n") == "def f():\n    return 2"
  assert code.extract_code("    return x + 1\n") == "    return x + 1"
  # A bare fence after code closes it (a base model's body, then ``` and prose): the code
  # before it, not the prose after it, whatever follows.
  body = "    for x in xs:\n        if x:\n            return True\n    return False\n"
  assert code.extract_code(body + "```\n\nThis function checks pairs.") == body.rstrip()
  assert code.extract_code(body + "```\nUsage:\n```python\nprint(f([1]))\n```", "f") == (
      body.rstrip())
  whole = "def f(xs):\n" + body
  assert code.extract_code(whole + "```\nDone.", "f") == whole.rstrip()
  # A fence after prose, or with a language tag, opens a block.
  assert code.extract_code("Sure! Here it is:\n```\nx = 1\n```\nBye") == "x = 1"
  assert code.extract_code("x = 0\n```python\nx = 1\n```") == "x = 1"
  assert code.extract_code("Answer\n```\nx = 1\n```") == "x = 1"  # one word: prose


def _run(programs):
  return sandbox.run_many(programs, workers=WORKERS, timeout_s=REFERENCE_TIMEOUT_S)


def _failures(examples, results):
  return {ex.id: r.stderr_tail[-300:] for ex, r in zip(examples, results) if not r.passed}


def test_all_humaneval_canonical_solutions_pass():
  examples = datasets.load_examples("humaneval")
  assert len(examples) == 164
  results = _run([code.build_program(ex.meta["solution"], ex) for ex in examples])
  assert _failures(examples, results) == {}


def test_humaneval_completion_forms_and_wrong_solutions():
  examples = datasets.load_examples("humaneval")
  picked = examples[::16]
  programs, expected = [], []
  for i, ex in enumerate(picked):
    prompt, solution = ex.source_text, ex.meta["solution"]
    # An instruct model's fenced whole function, a base model's body followed by
    # rambling that the stop sequences must cut off, and one that closes a fence it never
    # opened and explains: all pass.
    programs.append(code.build_program(f"Sure!\n```python\n{prompt}{solution}```\n", ex))
    programs.append(code.build_program(f"{solution}\n\ndef unrelated(:\n  oops", ex))
    programs.append(code.build_program(f"{solution}\n```\n\nThis function checks pairs.", ex))
    # Another task's solution, and a body that returns nothing: both fail.
    other = picked[(i + 1) % len(picked)].meta["solution"]
    programs.append(code.build_program(other, ex))
    programs.append(code.build_program("    return None\n", ex))
    expected += [True, True, True, False, False]
  results = _run(programs)
  assert [r.passed for r in results] == expected


def _mbpp_sample():
  examples = datasets.load_examples("mbpp", split="all")
  if FULL:
    return examples
  # A fixed ~20% sample across all four splits; it holds both tasks whose setup uses the
  # solution.
  return [ex for ex in examples if int(ex.id) % 5 == 2]


def test_mbpp_reference_solutions_pass():
  examples = _mbpp_sample()
  assert len(examples) >= 100 and MBPP_SETUP_USES_SOLUTION <= {ex.id for ex in examples}
  results = _run([code.build_program(ex.meta["solution"], ex) for ex in examples])
  assert _failures(examples, results) == {}


def test_mbpp_setup_code_runs_after_the_solution():
  # Setups that build trees of the solution's `Node` class need it defined first.
  assert code.mbpp_program("code", ["assert t"], "setup\n") == "code\nsetup\n\nassert t\n"
  examples = [ex for ex in datasets.load_examples("mbpp", split="all")
              if ex.id in MBPP_SETUP_USES_SOLUTION]
  assert len(examples) == 2 and all("Node(" in ex.meta["test_setup_code"] for ex in examples)
  results = _run([code.build_program(ex.meta["solution"], ex) for ex in examples])
  assert _failures(examples, results) == {}


def test_sanitized_mbpp_reference_solutions_pass():
  examples = datasets.load_examples("mbpp", source="sanitized", split="all")
  assert len(examples) == 427
  if not FULL:
    # The full set's fixed ~20% sample (367 and 927 are not in this set), and every task
    # whose setup (the sanitized set's test_imports) runs after the solution.
    examples = [ex for ex in examples if int(ex.id) % 5 == 2 or ex.meta["test_setup_code"]]
    assert len(examples) >= 90 and sum(bool(ex.meta["test_setup_code"]) for ex in examples) >= 10
  results = _run([code.build_program(ex.meta["solution"], ex) for ex in examples])
  assert _failures(examples, results) == {}


def test_mbpp_wrong_solutions_fail():
  examples = _mbpp_sample()[:40]
  wrong = [examples[(i + 1) % len(examples)].meta["solution"] for i in range(len(examples))]
  programs = [code.build_program(w, ex) for w, ex in zip(wrong, examples)]
  programs.append(code.build_program("", examples[0]))  # an empty completion
  assert not any(r.passed for r in _run(programs))


def test_task_rewards_for_code_tasks():
  mbpp = get_task("mbpp")
  ex = datasets.load_examples("mbpp", limit=2)
  fenced = [f"```python\n{e.meta['solution']}\n```" for e in ex]
  assert mbpp.rewards(fenced + ["```python\nprint('no')\n```"], ex + ex[:1]) == [1.0, 1.0, 0.0]
  he = get_task("humaneval")
  ex = datasets.load_examples("humaneval", limit=1)[0]
  assert he.reward(ex.meta["solution"], ex) == 1.0
  assert code.humaneval_reward("    return 0\n", ex.source_text, ex.reference,
                               ex.meta["entry_point"]) == 0.0
  first = datasets.load_examples("mbpp", limit=1)[0]
  assert code.mbpp_reward(first.meta["solution"], first.meta["test_list"]) == 1.0
