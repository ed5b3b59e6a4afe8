"""`python -m diversed_jax.training` end to end, in process, on the tiny random models: its
flags reach the run (the prompts' file, split, limit, shots and article truncation, the
`train` settings), and --ship_as copies the trained head into the shipped heads."""

import json
import os

import pytest

from diversed_jax.evaluation import tiny
from tests.entry_points import entry_point

WORDS = [f"word{i:02d}" for i in range(40)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  return tiny.write_tiny_models(str(tmp_path_factory.mktemp("tiny") / "models"))


def test_training_trains_on_its_flags_and_ships_the_head(tiny_dir, tmp_path, monkeypatch,
                                                        capsys):
  from diversed_jax import tokenizer as tokenizer_lib
  from diversed_jax.training import artifacts, trainer

  source = tmp_path / "articles.jsonl"  # no ids: each example is named by its split
  source.write_text("".join(
      json.dumps({"article": f"Story {i}: " + " ".join(WORDS), "highlights": f"Story {i}."})
      + "\n" for i in range(5)))
  assets = tmp_path / "assets" / "heads"
  monkeypatch.setattr(artifacts, "ASSETS", str(assets))
  seen = {}
  real_train_head = trainer.train_head

  def train_head(train_cfg, **kwargs):  # what main() hands the trainer
    seen.update(kwargs)
    return real_train_head(train_cfg, **kwargs)
  monkeypatch.setattr(trainer, "train_head", train_head)

  workdir = tmp_path / "run"
  target, draft = os.path.join(tiny_dir, "target"), os.path.join(tiny_dir, "draft")
  argv = [f"--target={target}", f"--draft={draft}", "--task=cnndm", f"--source={source}",
          "--split=mine", "--limit=3", "--shots=1", "--max_source_words=6",
          f"--workdir={workdir}", "--ship_as=tiny-head",
          "--train.total_steps=1", "--train.warmup_steps=0", "--train.prompts_per_step=2",
          "--train.rollouts_per_prompt=2", "--train.max_new_tokens=4", "--train.num_draft=2",
          "--train.checkpoint_every=1", "--train.lam=0.3"]
  with entry_point("diversed_jax.training", argv) as (training, rest):
    training.main(rest)
  out = capsys.readouterr().out

  # The examples: the file's first --limit records, named by --split.
  assert [e.id for e in seen["examples"]] == ["cnndm/mine/0", "cnndm/mine/1", "cnndm/mine/2"]
  assert "task cnndm: 3 mine examples" in out
  # Their prompts: one shot (the shipped train split's), each article cut to 6 words.
  prompt = tokenizer_lib.load_tokenizer(target).decode(
      seen["task"].prompt_ids(seen["examples"][1]))
  articles = [part.split("\n")[0].split() for part in prompt.split("Article: ")[1:]]
  assert len(articles) == 2 and all(len(a) == 6 + 1 and a[-1] == "..." for a in articles)
  assert articles[1] == ["Story", "1:", "word00", "word01", "word02", "word03", "..."]

  head = workdir / "head"
  assert f"head: {head}" in out and f"shipped: {assets / 'tiny-head'}" in out
  with open(head / "head.json") as f:
    meta = json.load(f)
  assert meta["task"] == "cnndm" and meta["steps"] == 1
  assert meta["draft_spec"] == draft
  assert (meta["train"]["total_steps"], meta["train"]["lam"]) == (1, 0.3)
  for name in ("params.npz", "head.json"):
    assert (assets / "tiny-head" / name).read_bytes() == (head / name).read_bytes()
  assert artifacts.shipped_heads(str(assets)) == {
      (meta["target"], draft, "cnndm"): str(assets / "tiny-head")}
