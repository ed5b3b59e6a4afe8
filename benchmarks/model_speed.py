"""Prefill and decode speed of the embedded model: our JAX forward vs transformers' PyTorch.

    python benchmarks/model_speed.py                      # batches 1, 4, 16 (a few minutes)
    python benchmarks/model_speed.py --batches 1 --no-torch

Prints tokens/s of prefill (one forward over the prompts) and greedy decoding (one token per
row per step, KV cache, float32) for both, and the memory-bandwidth bound of batch-1
decoding: every step reads all weights once, so tokens/s <= bandwidth / weight bytes.
Timings are the best of --repeats runs, ours and PyTorch's interleaved, so that load from
other processes on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np


def copy_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
  """Bytes moved per second (read + write) by a large numpy copy, in GB/s. The buffer is
  larger than the last-level cache, so this is DRAM bandwidth."""
  src = np.ones(megabytes * 2 ** 20 // 4, np.float32)
  dst = np.empty_like(src)
  best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
  return 2 * src.nbytes / best / 1e9


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


class JaxRunner:
  """Prefill and greedy decode with `transformer.forward` under jit, cache donated."""

  def __init__(self, model, layout: str):
    import jax
    import jax.numpy as jnp
    from diversed_jax.models import transformer

    self.jax, self.jnp = jax, jnp
    self.config = model.config
    self.params = (transformer.unstack_layers(model.params) if layout == "unstacked"
                   else model.params)
    config = self.config

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(params, tokens_bt, cache):
      # Logits of the last position only: the head is a fifth of a 128-token prefill.
      hidden, cache = transformer.forward_hidden(params, config, tokens_bt, cache)
      logits = transformer.logits_from_hidden(params, config, hidden[:, -1])
      return jnp.argmax(logits, -1).astype(jnp.int32)[:, None], cache

    self.step = step

  def _cache(self, batch: int, slots: int):
    from diversed_jax.models import transformer
    return transformer.init_cache(self.params, self.config, batch, slots)

  def prefill(self, prompts_bt: np.ndarray, slots: int) -> float:
    cache = self._cache(prompts_bt.shape[0], slots)
    tokens = self.jnp.asarray(prompts_bt)
    start = time.perf_counter()
    nxt, cache = self.step(self.params, tokens, cache)
    nxt.block_until_ready()
    return time.perf_counter() - start

  def decode(self, prompts_bt: np.ndarray, slots: int, new_tokens: int) -> float:
    """Seconds for new_tokens single-token steps after the prompt (prefill not counted)."""
    nxt, cache = self.step(self.params, self.jnp.asarray(prompts_bt),
                           self._cache(prompts_bt.shape[0], slots))
    nxt.block_until_ready()
    start = time.perf_counter()
    for _ in range(new_tokens):
      nxt, cache = self.step(self.params, nxt, cache)
    nxt.block_until_ready()
    return time.perf_counter() - start

  def warm_up(self, prompts_bt, slots):
    self.prefill(prompts_bt, slots)
    self.decode(prompts_bt, slots, 2)

  def forward_ms(self, tokens: int, slots: int = 256, steps: int = 10) -> float:
    """ms of one batch-1 forward over `tokens` new tokens with all their logits (what
    verifying a draft of tokens - 1 costs), cache rolled back after each."""
    jax, jnp = self.jax, self.jnp
    from diversed_jax.models import transformer
    config = self.config

    @functools.partial(jax.jit, donate_argnums=(2,))
    def verify(params, tokens_bt, cache):
      logits, _, new_cache = transformer.forward(params, config, tokens_bt, cache)
      return logits, new_cache.with_lengths(cache.lengths_b)

    cache = self._cache(1, slots).with_lengths(jnp.full((1,), slots // 2, jnp.int32))
    tokens_bt = jnp.ones((1, tokens), jnp.int32)
    logits, cache = verify(self.params, tokens_bt, cache)
    logits.block_until_ready()
    best = np.inf
    for _ in range(3):
      start = time.perf_counter()
      for _ in range(steps):
        logits, cache = verify(self.params, tokens_bt, cache)
      logits.block_until_ready()
      best = min(best, (time.perf_counter() - start) / steps * 1e3)
    return best


class LoopRunner:
  """The default decoding path: `SpeculativeDecoder` with method 'ar' (what
  `python -m diversed_jax.generate --method=ar` runs), one compiled while_loop per call.
  Decode time = time(1 + N new tokens) - time(1 new token), so prefill is not counted."""

  def __init__(self, model, new_tokens: int):
    from diversed_jax.speculative.decoder import ModelHandle, SpeculativeDecoder
    from diversed_jax.speculative.types import VerifyParams
    self.decoder = SpeculativeDecoder(ModelHandle(model.config, model.params))
    self.verify = VerifyParams(method="ar", temperature=0.0)
    self.new_tokens = new_tokens  # the decode length to compile in warm_up

  def _seconds(self, prompts_bt, new_tokens: int) -> float:
    gen = self.decoder.generate(prompts_bt.tolist(), self.verify, max_new_tokens=new_tokens,
                                eos_token_ids=())
    return gen.seconds

  def prefill(self, prompts_bt: np.ndarray, slots: int) -> float:
    return self._seconds(prompts_bt, 1)

  def decode(self, prompts_bt: np.ndarray, slots: int, new_tokens: int) -> float:
    return self._seconds(prompts_bt, 1 + new_tokens) - self._seconds(prompts_bt, 1)

  def warm_up(self, prompts_bt, slots):
    self._seconds(prompts_bt, 1)
    self._seconds(prompts_bt, 1 + self.new_tokens)


class TorchRunner:
  """transformers' PyTorch model from the same GGUF file, float32, `generate`."""

  def __init__(self, path: str):
    import torch
    import transformers

    self.torch = torch
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()

  def prefill(self, prompts_bt: np.ndarray, slots: int) -> float:
    with self.torch.no_grad():
      ids = self.torch.tensor(prompts_bt)
      return _timed(lambda: self.model(ids, use_cache=True, logits_to_keep=1))

  def _generate(self, prompts_bt, new_tokens):
    ids = self.torch.tensor(prompts_bt)
    with self.torch.no_grad():
      return _timed(lambda: self.model.generate(
          ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=new_tokens,
          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0))

  def decode(self, prompts_bt: np.ndarray, slots: int, new_tokens: int) -> float:
    """generate(new_tokens + 1) minus generate(1): new_tokens decode steps."""
    return self._generate(prompts_bt, new_tokens + 1) - self._generate(prompts_bt, 1)

  def warm_up(self, prompts_bt, slots):
    self._generate(prompts_bt, 2)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="smollm2-135m-instruct")
  parser.add_argument("--batches", default="1,4,16")
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--layouts", default="unstacked,stacked",
                      help="our parameter layouts to time (transformer.unstack_layers)")
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument("--no-loop", action="store_true",
                      help="skip the default path (SpeculativeDecoder, method 'ar')")
  parser.add_argument("--verify", default="1,2,5,9",
                      help="token counts of the batch-1 forward cost table ('' to skip)")
  parser.add_argument("--torch-threads", type=int, default=0,
                      help="torch.set_num_threads (0: torch's default, one per core); on a "
                      "busy machine 2 threads spin-wait on each other, 1 is fairer")
  args = parser.parse_args(argv)

  import jax
  from diversed_jax.models.kv_cache import bucket_length
  from diversed_jax.models.loading import load_model

  model = load_model(args.model)
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
  bandwidth = copy_bandwidth()
  print(f"model {model.name}: {weight_bytes / 1e6:.0f} MB float32 weights; jax "
        f"{jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs")
  print(f"copy bandwidth {bandwidth:.1f} GB/s -> batch-1 decode bound "
        f"{bandwidth * 1e9 / weight_bytes:.1f} tokens/s")

  runners = {f"jax-{layout}": JaxRunner(model, layout) for layout in args.layouts.split(",")}
  if not args.no_loop:
    runners["jax-loop-ar"] = LoopRunner(model, args.new_tokens)
  if not args.no_torch:
    import torch
    if args.torch_threads:
      torch.set_num_threads(args.torch_threads)
    runners["torch"] = TorchRunner(model.source_path)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

  slots = bucket_length(args.prompt_len + args.new_tokens + 1)
  rng = np.random.RandomState(0)
  print(f"\nprompt {args.prompt_len} tokens, {args.new_tokens} new tokens, cache {slots} slots, "
        f"best of {args.repeats}")
  print(f"{'runner':<16}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>14}"
        f"{'ms/step':>9}{'compile s':>11}")
  results = {}
  for batch in [int(b) for b in args.batches.split(",")]:
    prompts = rng.randint(3, model.config.vocab_size, (batch, args.prompt_len)).astype(np.int32)
    compile_s = {name: _timed(lambda r=r: r.warm_up(prompts, slots))
                 for name, r in runners.items()}
    best = {name: [np.inf, np.inf] for name in runners}
    for _ in range(args.repeats):
      for name, runner in runners.items():
        best[name][0] = min(best[name][0], runner.prefill(prompts, slots))
        best[name][1] = min(best[name][1], runner.decode(prompts, slots, args.new_tokens))
    for name, (prefill_s, decode_s) in best.items():
      results[name, batch] = batch * args.new_tokens / decode_s
      print(f"{name:<16}{batch:>6}{batch * args.prompt_len / prefill_s:>15.0f}"
            f"{results[name, batch]:>14.1f}{decode_s / args.new_tokens * 1e3:>9.1f}"
            f"{compile_s[name]:>11.1f}", flush=True)
  if args.verify:
    counts = [int(c) for c in args.verify.split(",")]
    print(f"\nbatch-1 forward over T new tokens (all logits), ms and ratio to T={counts[0]}")
    for name, runner in runners.items():
      if name.startswith("jax-") and name != "jax-loop-ar":
        ms = [runner.forward_ms(c) for c in counts]
        print(f"{name:<16}" + "".join(f"  T={c}: {m:.1f} ({m / ms[0]:.2f}x)"
                                       for c, m in zip(counts, ms)), flush=True)
  if "torch" in runners:
    print()
    for (name, batch), rate in sorted(results.items()):
      if name != "torch":
        print(f"{name} batch {batch}: {rate / results['torch', batch]:.2f}x PyTorch decode")
  return results


if __name__ == "__main__":
  sys.exit(main() and 0)
