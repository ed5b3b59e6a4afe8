"""Tiny random models and a byte-level tokenizer, written once to a temporary folder.

They make every code path of the main job (training, every method, reports) run in
seconds on a CPU: the text they generate is noise, so only the plumbing is tested.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

import jax

VOCAB_SIZE = 260  # 256 bytes + 3 special tokens, padded
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_VERSION = "1"  # bump when the layout below changes


def default_folder() -> str:
  """$DIVERSED_TINY_DIR, else a folder in the system temp dir keyed by this layout."""
  env = os.environ.get("DIVERSED_TINY_DIR")
  if env:
    return env
  key = hashlib.sha1(_VERSION.encode()).hexdigest()[:8]
  return os.path.join(tempfile.gettempdir(), f"diversed_jax_tiny_{key}")


def _tokenizer():
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
  for name in SPECIALS:
    vocab[name] = len(vocab)
  model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  model.decoder = decoders.ByteLevel()
  tok = PreTrainedTokenizerFast(tokenizer_object=model, bos_token=SPECIALS[1],
                                eos_token=SPECIALS[2], pad_token=SPECIALS[0])
  tok.chat_template = CHAT_TEMPLATE
  return tok, vocab


def _write_model(folder: str, num_layers: int, seed: int, tokenizer, eos_id: int,
                 pad_id: int) -> None:
  from diversed_jax.models import init_params, loading
  from diversed_jax.models.config import ModelConfig

  config = ModelConfig(family="llama", vocab_size=VOCAB_SIZE, hidden_size=32,
                       num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64, eos_token_ids=(eos_id,), pad_token_id=pad_id)
  # std 0.5 makes the random logits peaked, so draft and target disagree measurably.
  params = init_params(config, jax.random.PRNGKey(seed), std=0.5)
  loading.save_hf_folder(config, params, folder)
  tokenizer.save_pretrained(folder)


def write_tiny_models(folder: str | None = None) -> str:
  """Writes target/ (2 layers), draft/ and draft_finetuned/ (1 layer each) under `folder`
  (idempotent; safe when several processes race). Returns the folder."""
  folder = folder or default_folder()
  if os.path.isfile(os.path.join(folder, "done")):
    return folder
  tmp = tempfile.mkdtemp(prefix=".tiny_", dir=os.path.dirname(os.path.abspath(folder)))
  tok, vocab = _tokenizer()
  eos_id, pad_id = vocab[SPECIALS[2]], vocab[SPECIALS[0]]
  _write_model(os.path.join(tmp, "target"), 2, 0, tok, eos_id, pad_id)
  _write_model(os.path.join(tmp, "draft"), 1, 1, tok, eos_id, pad_id)
  _write_model(os.path.join(tmp, "draft_finetuned"), 1, 2, tok, eos_id, pad_id)
  open(os.path.join(tmp, "done"), "w").close()
  try:
    os.rename(tmp, folder)
  except OSError:  # another process finished first
    shutil.rmtree(tmp, ignore_errors=True)
  return folder


def shrink_train(train) -> None:
  """A few-second head-training run (fields of training.config.default_config)."""
  sizes = dict(total_steps=2, warmup_steps=0, prompts_per_step=2, rollouts_per_prompt=2,
               max_new_tokens=8, num_draft=2, max_prompt_tokens=1024,
               checkpoint_every=2, log_every=1, limit=4)
  for key, value in sizes.items():
    if key in train:
      train[key] = value
