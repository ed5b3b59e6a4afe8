"""Tokenizer loading, chat prompts and the draft/target vocabulary check."""

import pytest
import tokenizers
import transformers

from diversed_jax import tokenizer as tok_lib

_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
             "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def _tiny_tokenizer_folder(path, words):
  """A word-level tokenizer saved as a transformers folder (no network)."""
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
  vocab.update({w: i + 3 for i, w in enumerate(words)})
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
  fast.chat_template = _TEMPLATE
  fast.save_pretrained(str(path))
  return str(path)


WORDS = ["hello", "world", "user:", "assistant:", "how", "are", "you"]


def test_load_is_cached_and_encodes(tmp_path):
  folder = _tiny_tokenizer_folder(tmp_path / "a", WORDS)
  tok = tok_lib.load_tokenizer(folder)
  assert tok_lib.load_tokenizer(folder) is tok
  assert tok_lib.encode_prompt(tok, "hello world", chat=False) == [3, 4]


def test_chat_prompt_adds_special_tokens_once(tmp_path):
  tok = tok_lib.load_tokenizer(_tiny_tokenizer_folder(tmp_path / "a", WORDS))
  ids = tok_lib.encode_prompt(tok, "hello", chat=True)
  assert tok.decode(ids) == "<s> user: hello </s> <s> assistant:"
  assert ids.count(1) == 2  # one BOS per turn, none added on top by encoding


def test_check_compatible(tmp_path):
  a = tok_lib.load_tokenizer(_tiny_tokenizer_folder(tmp_path / "a", WORDS))
  tok_lib.check_compatible(a, a)
  tok_lib.check_compatible(a, a.get_vocab())
  bigger = tok_lib.load_tokenizer(_tiny_tokenizer_folder(tmp_path / "b", WORDS + ["extra"]))
  with pytest.raises(ValueError, match="draft vocabulary size 10, target vocabulary size 11"):
    tok_lib.check_compatible(a, bigger)
  shuffled = tok_lib.load_tokenizer(_tiny_tokenizer_folder(tmp_path / "c", WORDS[::-1]))
  with pytest.raises(ValueError, match="both vocabulary size 10"):
    tok_lib.check_compatible(a, shuffled)


def test_missing_spec(tmp_path):
  with pytest.raises(FileNotFoundError):
    tok_lib.load_tokenizer(str(tmp_path / "nothing"))


@pytest.mark.slow
def test_smollm2_chat_prompt():
  tok = tok_lib.load_tokenizer("smollm2-135m-instruct")
  ids = tok_lib.encode_prompt(tok, "What is 2 + 2?", chat=True)
  # <|im_start|> = 1 opens each turn (the template inserts a system turn), once each.
  assert ids[0] == 1 and ids.count(1) == 3
  assert tok.decode(ids).endswith("<|im_start|>assistant\n")
  tok_lib.check_compatible(tok, tok)
