"""Set-up shared by the engine benchmarks: the target, its tokenizer, a decoder with a
draft, and GSM8K-test prompts (chat-formatted token lists)."""

from __future__ import annotations

import os
import platform

from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.models import loading
from diversed_jax.speculative import build
from diversed_jax.tasks.registry import get_task


def load_decoder(target_name: str, draft_spec: str | None):
  """(target, tokenizer, SpeculativeDecoder, info) for a target and a draft spec (None:
  the target's default draft)."""
  target = loading.load_model(target_name)
  tokenizer = tokenizer_lib.load_tokenizer(target_name)
  decoder, info = build.build_decoder(target, draft_spec)
  print(f"draft {info.get('draft')}, head of 'diversed': {info.get('head')}", flush=True)
  return target, tokenizer, decoder, info


def gsm8k_test_prompts(tokenizer, limit: int) -> list[list[int]]:
  """The first `limit` GSM8K-test prompts as chat-formatted token lists."""
  task = get_task("gsm8k")
  return [tokenizer_lib.encode_prompt(tokenizer, task.prompt(e), chat=True)
          for e in task.load(split="test", limit=limit)]


def host_info() -> dict:
  """Which machine measured a run: the CPU's model, its logical cores, jax's backend
  and device, and the rows from which the few-row kernel uses register tiles (0: no
  AVX-512 or no kernel). Timings from different hosts are not comparable (the tiles'
  choice itself is per vendor), so draft_speed.py's and spec_speed.py's outputs carry it."""
  import jax

  from diversed_jax.models import cpu_kernels
  cpu = platform.processor() or platform.machine()
  try:  # virtual machines often hide the model's name; family and model still tell it
    with open("/proc/cpuinfo") as f:
      fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines()
                    if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    cpu = f"{fields['model name']} (family {fields['cpu family']}, model {fields['model']})"
  except (OSError, KeyError):
    pass
  return {"cpu": cpu, "logical_cores": os.cpu_count(), "backend": jax.default_backend(),
          "device": jax.devices()[0].device_kind, "kernel_tiles_from_rows":
          cpu_kernels.tile_rows() if jax.default_backend() == "cpu" else 0}
