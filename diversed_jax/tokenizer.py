"""Tokenizers through transformers: model folders, GGUF files, registry names.

Draft and target must share one vocabulary (speculative decoding compares their
distributions token by token); `check_compatible` enforces it.
"""

from __future__ import annotations

import functools
import os
from typing import Mapping, Sequence

from diversed_jax.models.loading import resolve_location

# How many token -> id pairs check_compatible compares beyond the sizes.
_SAMPLE = 2048


@functools.lru_cache(maxsize=8)
def _load(path: str):
  # Cached per resolved path: a GGUF tokenizer takes about 4 s to build.
  from transformers import AutoTokenizer

  if os.path.isfile(path):
    if not path.endswith(".gguf"):
      path = os.path.dirname(path) or "."  # a weights file: its folder holds the tokenizer
    else:
      return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                           gguf_file=os.path.basename(path))
  return AutoTokenizer.from_pretrained(path)


def load_tokenizer(spec: str):
  """The transformers tokenizer of a registry name, model folder, .gguf file or hub id.

  Raises:
    FileNotFoundError: nothing at `spec` (see loading.resolve_location).
  """
  _, path = resolve_location(spec)
  return _load(os.path.abspath(path))


def encode_prompt(tokenizer, text: str, chat: bool | None = None,
                  system: str | None = None) -> list[int]:
  """Token ids of a prompt: with `chat`, one user turn through the chat template followed
  by the assistant header (the template's own special tokens, added once); without,
  `tokenizer.encode` with its default special tokens (a base model's BOS).

  chat: None = when the tokenizer has a chat template (instruct models).
  system: an optional system message (templates that insert a default one keep theirs
    when None).

  Raises:
    ValueError: chat=True for a tokenizer without a chat template.
  """
  has_template = bool(getattr(tokenizer, "chat_template", None))
  if chat is None:
    chat = has_template
  if not chat:
    return list(tokenizer.encode(text))
  if not has_template:
    raise ValueError(
        f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
        "encode with chat=False")
  messages = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": text}]
  # Render to text, then encode without special tokens: the template already holds BOS
  # and turn markers, and text rendering behaves the same across transformers 4 and 5.
  rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=True)
  return list(tokenizer.encode(rendered, add_special_tokens=False))


def _vocab(tokenizer_or_vocab) -> Mapping[str, int]:
  if isinstance(tokenizer_or_vocab, Mapping):
    return tokenizer_or_vocab
  return tokenizer_or_vocab.get_vocab()


def check_compatible(draft, target) -> None:
  """Raises ValueError unless draft and target map tokens to ids identically.

  Args:
    draft, target: tokenizers (anything with get_vocab()) or token -> id mappings.

  Compares the vocabulary sizes, then a deterministic sample of token -> id pairs.
  """
  draft_vocab, target_vocab = _vocab(draft), _vocab(target)
  if len(draft_vocab) != len(target_vocab):
    raise ValueError(
        f"draft and target tokenizers differ: draft vocabulary size {len(draft_vocab)}, "
        f"target vocabulary size {len(target_vocab)}")
  tokens: Sequence[str] = sorted(draft_vocab)
  step = max(1, len(tokens) // _SAMPLE)
  for token in tokens[::step]:
    if target_vocab.get(token) != draft_vocab[token]:
      raise ValueError(
          f"draft and target tokenizers differ (both vocabulary size {len(draft_vocab)}): "
          f"token {token!r} is id {draft_vocab[token]} in the draft and "
          f"{target_vocab.get(token)} in the target")
