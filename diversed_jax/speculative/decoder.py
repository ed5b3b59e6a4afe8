"""Host-side front end of the speculative loop: padding, buckets, timing, results.

`SpeculativeDecoder` binds a target, an optional draft and an optional ensemble head;
`generate` pads prompts to a length bucket (so every batch in a bucket reuses one
compiled program), runs `loop.decode` and returns plain Python/numpy results.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diversed_jax.models import transformer
from diversed_jax.models.config import ModelConfig
from diversed_jax.models.kv_cache import bucket_length
from diversed_jax.parallel import hosts
from diversed_jax.parallel import mesh as mesh_lib
from diversed_jax.speculative import loop, metrics, programs, smc, split_queue, ssd
from diversed_jax.speculative.policy_trace import PolicyTrace
from diversed_jax.speculative.types import VerifyParams

PROMPT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# `jax.default_matmul_precision` values for the products of float32 models (on CPU all
# compute in float32; on GPUs and TPUs "default" takes TF32 / bfloat16 passes).
MATMUL_PRECISIONS = ("highest", "high", "default", "float32", "tensorfloat32", "bfloat16")


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0,
                buckets: Sequence[int] = PROMPT_BUCKETS) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token lists to a shared bucket length: (tokens [B, P], lengths [B])."""
  if not len(prompts):
    raise ValueError("no prompts to decode")
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  short = np.flatnonzero(lengths < 2)
  if short.size:
    raise ValueError(f"every prompt needs >= 2 tokens: prompt {short[0]} has "
                     f"{lengths[short[0]]} ({short.size} of {len(prompts)} too short)")
  width = bucket_length(int(lengths.max()), tuple(buckets))
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, :len(prompt)] = prompt
  return tokens, lengths


def _check_token_ids(tokens_qp: np.ndarray, lengths_q: np.ndarray, vocab_size: int) -> None:
  """ValueError naming the first prompt with an id outside [0, vocab_size) (padding
  aside): the embedding lookup would clamp it silently."""
  in_prompt = np.arange(tokens_qp.shape[1])[None, :] < lengths_q[:, None]
  bad_qp = in_prompt & ((tokens_qp < 0) | (tokens_qp >= vocab_size))
  if bad_qp.any():
    row = int(np.argmax(bad_qp.any(axis=1)))
    raise ValueError(f"prompt {row} has token id {tokens_qp[row][bad_qp[row]][0]} outside "
                     f"the vocabulary [0, {vocab_size})")


@dataclasses.dataclass
class Generation:
  """Results of one batch, on the host."""
  token_ids: list[list[int]]  # generated ids per prompt (EOS included when hit)
  rounds: int
  accepted_per_round: list[list[int]]  # per prompt, n for each round it was decoded
  stats: loop.RoundStats  # numpy arrays, [R, B, ...] trimmed to the rounds run
  seconds: float  # wall-clock of the decode call (compiled)
  compile_seconds: float
  policy: PolicyTrace | None = None  # numpy, [Q, N, ...]: with generate's record_policy

  @property
  def num_tokens(self) -> int:
    return sum(len(t) for t in self.token_ids)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelHandle:
  """A target's config and parameters (stacked layers, as loaded)."""
  config: ModelConfig
  params: Any

  @functools.cached_property
  def decoding_params(self):
    """The parameters in the decoding layout (`transformer.unstack_layers`): a second
    copy of the weights (537 MB for SmolLM2-135M), made on first use and shared by every
    decoder of this handle."""
    return transformer.unstack_layers(self.params)


class SpeculativeDecoder:
  """A target, an optional draft (object, params) and an optional head (weight_fn, params)."""

  def __init__(self, target: ModelHandle, draft=None, draft_params=None, weight_fn=None,
               head_params=None, mesh=None, unstack: bool = True,
               prefill_chunk: int = loop.PREFILL_CHUNK, shrink_tail: bool = False,
               matmul_precision: str = "highest"):
    """`mesh`: an optional jax.sharding.Mesh; rows are then split over its 'data' axis
    (the batch must divide by its size) and parameters replicated. With a queue
    (`generate`'s batch_size), each device runs its own over a block of the prompts
    (`split_queue`; prompts and rows must divide by its size).

    `unstack`: run the models with unrolled per-layer weights
    (`ModelHandle.decoding_params`, a second copy of the target's weights made on first
    use, shared by the decoders of one handle). On CPU this makes one-token steps
    1.4-1.6x faster (XLA copies stacked weights out of the scan every step), and its
    [out, in] matrices let the (K+1)-token verification take the fused few-row products
    of `models.products` (one row's verification of 4-5 tokens: 20-30% faster than
    stacked). False keeps the caller's layout everywhere.

    `prefill_chunk`: prompt tokens per prefill pass (`loop.decode`).

    `shrink_tail`: once no prompt is queued, the batch shrinks to its unfinished rows at
    B/2, B/4, ... (`loop.decode`'s `tail_widths`), so the last slow rows do not pay for
    the finished ones: on SmolLM2 at batch 8 with 48 queued prompts, greedy sd calls 4%
    faster. Each width compiles one more round (batch 8: 13 -> 31 s; batch 4: ~10 ->
    ~38 s), so it pays for long or repeated calls only; False (default) keeps all rows.

    `matmul_precision`: the precision of the models' float32 products
    (`jax.default_matmul_precision`, one of MATMUL_PRECISIONS) in every compiled program.
    "highest" (default) keeps exact methods exact off the CPU: there, "default" runs a
    (K+1)-token verification's products in TF32 (GPU) or bfloat16 passes (TPU) while a
    one-token step may take another kernel, so the two round differently and greedy
    speculative decoding stops reproducing plain greedy decoding (on an H200, SmolLM2-135M:
    different output in 7 of 8 runs with "default", identical with "highest", where plain
    decoding ran at 0.83x / 0.65x of its "default" speed at batch 1 / 8). "default" trades
    exactness for that speed. On CPU every setting computes the same float32 products.
    """
    if matmul_precision not in MATMUL_PRECISIONS:
      raise ValueError(f"matmul_precision={matmul_precision!r}: must be one of "
                       f"{list(MATMUL_PRECISIONS)}")
    self.matmul_precision = matmul_precision
    self.mesh = mesh
    self.prefill_chunk = prefill_chunk
    self.shrink_tail = shrink_tail
    self.unstack = unstack
    if unstack and draft is not None and hasattr(draft, "inference_params"):
      draft_params = draft.inference_params(draft_params)
    self.target = target
    self.draft = draft
    self.draft_params = draft_params
    self.weight_fn = weight_fn
    self.head_params = head_params
    # Compiled programs, one per (spec, prompt bucket, ...), released under pressure.
    self.programs = programs.ProgramCache()

  def target_params(self):
    """The target's parameters in the decoding layout (see `unstack`)."""
    return self.target.decoding_params if self.unstack else self.target.params

  @functools.cached_property
  def _placement(self) -> mesh_lib.Placement:
    return mesh_lib.Placement(self.mesh)

  @functools.cached_property
  def _models(self):
    """(target, draft) parameters as the programs take them: replicated over the mesh, if
    any, copied to its devices once rather than at every call."""
    return self._placement.params((self.target_params(), self.draft_params))

  def _spec(self, verify: VerifyParams, num_draft: int, max_new_tokens: int,
            eos_token_ids, record_policy: bool = False) -> loop.LoopSpec:
    if verify.method != "ar" and self.draft is None:
      raise ValueError(f"method {verify.method!r} needs a draft model")
    return loop.LoopSpec(verify=verify, num_draft=0 if verify.method == "ar" else num_draft,
                         max_new_tokens=max_new_tokens,
                         eos_token_ids=tuple(eos_token_ids), record_policy=record_policy)

  def generate(self, prompts: Sequence[Sequence[int]], verify: VerifyParams, *,
               num_draft: int = 4, max_new_tokens: int = 64, seed: int = 0,
               eos_token_ids: Sequence[int] | None = None, pad_id: int = 0,
               batch_size: int | None = None, record_policy: bool = False) -> Generation:
    """Decodes `prompts` (token lists). `batch_size`: rows decoded at once; None decodes
    all prompts as one batch, a smaller value queues the rest and refills finished rows
    (continuous batching; all prompts share one length bucket). Method 'smc' decodes
    `batch_size` prompts at a time instead, each with its `verify.particles` rows;
    method 'ssd' decodes one prompt at a time (`batch_size` is not used).
    `record_policy`: also return each generated token's law inputs (`policy_trace`;
    the mixing rules only)."""
    if batch_size is not None and not 1 <= batch_size <= len(prompts):
      raise ValueError(f"batch_size={batch_size} must be in [1, {len(prompts)}] "
                       "(the number of prompts) or None")
    if batch_size == len(prompts):
      batch_size = None
    if eos_token_ids is None:
      eos_token_ids = self.target.config.eos_token_ids
    spec = self._spec(verify, num_draft, max_new_tokens, eos_token_ids, record_policy)
    tokens, lengths = pad_prompts(prompts, pad_id)
    _check_token_ids(tokens, lengths, self.target.config.vocab_size)
    cache_len = bucket_length(tokens.shape[1] + max_new_tokens + spec.num_draft + 2)
    if verify.method == "smc":
      return self._generate_smc(spec, tokens, lengths, cache_len, seed, batch_size)
    if verify.method == "ssd":
      return self._generate_ssd(spec, tokens, lengths, cache_len, seed)
    uses_draft = spec.num_draft > 0
    # One program per spec but for the rule's numbers, which it takes as arguments.
    kwargs = dict(spec=spec.program_key(), target_config=self.target.config,
                  draft=self.draft if uses_draft else None,
                  weight_fn=self.weight_fn if verify.method == "diversed" else None,
                  cache_len=cache_len, batch_size=batch_size, prefill_chunk=self.prefill_chunk)
    decode_fn = loop.decode
    if self.mesh is None:
      tail_rows, shard = (len(prompts) if batch_size is None else batch_size), 1
    elif batch_size is None:  # one batch split over 'data': it shrinks by whole shards
      tail_rows, shard = len(prompts), self._placement.size
    else:  # a queue: each device runs its own over its block of the prompts
      devices = split_queue.check_split(self.mesh, len(prompts), batch_size)
      tail_rows, shard = batch_size // devices, 1
      decode_fn, kwargs["mesh"] = split_queue.decode, self.mesh
    kwargs["tail_widths"] = (loop.default_tail_widths(tail_rows, shard) if self.shrink_tail
                             else ())
    target_params, draft_params = self._models
    args = (target_params, draft_params if uses_draft else None,
            self._placement.params(self.head_params if verify.method == "diversed" else None),
            *self._placement.rows((jnp.asarray(tokens), jnp.asarray(lengths))),
            jax.random.PRNGKey(seed),
            self._placement.params({name: jnp.float32(value) for name, value
                                    in spec.verify.traced_values().items()}))
    signature = (kwargs["spec"], tokens.shape, cache_len, batch_size, kwargs["tail_widths"])
    result, seconds, compile_seconds = self._run(decode_fn, args, kwargs, signature)
    return _generation(result, len(prompts), seconds, compile_seconds)

  def _compiled(self, fn, args, kwargs, signature):
    """`fn` compiled once per `signature` (and precision) for `args`: (the program,
    seconds spent compiling it now, 0 when it was compiled before)."""
    def compile_program():
      with jax.default_matmul_precision(self.matmul_precision):
        return fn.lower(*args, **kwargs).compile()

    start = time.perf_counter()
    program, compiled = self.programs.get((*signature, self.matmul_precision),
                                          compile_program)
    return program, time.perf_counter() - start if compiled else 0.0

  def _run(self, decode_fn, args, kwargs, signature):
    """Runs `decode_fn` compiled once per `signature` (and precision): (host result,
    seconds of the compiled call, seconds spent compiling it)."""
    program, compile_seconds = self._compiled(decode_fn, args, kwargs, signature)
    start = time.perf_counter()
    result = jax.block_until_ready(program(*args))
    seconds = time.perf_counter() - start
    return hosts.fetch(result), seconds, compile_seconds  # rows held by other hosts too

  def _generate_smc(self, spec: loop.LoopSpec, tokens, lengths, cache_len: int, seed: int,
                    batch_size: int | None) -> Generation:
    """SMC speculative decoding (`smc.decode`), `batch_size` prompts a call (the last call
    padded with copies of its last prompt, so all calls share one program), each call's
    key folded with its first prompt's index. The calls' rounds are stacked."""
    num_prompts = tokens.shape[0]
    size = num_prompts if batch_size is None else batch_size
    if self.mesh is not None and size % self._placement.size:
      raise ValueError(f"method 'smc' splits the {size} prompts of a call over "
                       f"{self._placement.size} devices: they must divide")
    kwargs = dict(spec=spec, target_config=self.target.config, draft=self.draft,
                  cache_len=cache_len, prefill_chunk=self.prefill_chunk)
    target_params, draft_params = self._models
    starts, results, seconds, compile_seconds = [], [], 0.0, 0.0
    for start in range(0, num_prompts, size):
      rows = np.minimum(np.arange(start, start + size), num_prompts - 1)
      args = (target_params, draft_params,
              *self._placement.rows((jnp.asarray(tokens[rows]), jnp.asarray(lengths[rows]))),
              jax.random.fold_in(jax.random.PRNGKey(seed), start))
      result, call_seconds, call_compile = self._run(
          smc.decode, args, kwargs, (spec, (size, tokens.shape[1]), cache_len))
      starts.append(start)
      results.append(result)
      seconds, compile_seconds = seconds + call_seconds, compile_seconds + call_compile
    return _generation(_stack_calls(starts, results, num_prompts), num_prompts, seconds,
                       compile_seconds)


  @functools.cached_property
  def draft_device(self):
    """Where method 'ssd' runs the draft: the second local device when there is one."""
    devices = jax.local_devices()
    return devices[1] if len(devices) > 1 else devices[0]

  @functools.cached_property
  def _ssd_models(self):
    """(target, draft, draft on `draft_device`) parameters for method 'ssd', copied to
    their devices once rather than at every call."""
    target_params, draft_params = jax.device_put(self._models, jax.local_devices()[0])
    return target_params, draft_params, jax.device_put(draft_params, self.draft_device)

  def _generate_ssd(self, spec: loop.LoopSpec, tokens, lengths, cache_len: int,
                    seed: int) -> Generation:
    """Speculative speculative decoding (`ssd.decode`): the target on the first local
    device, the draft on `draft_device`, one prompt at a time, each prompt's key folded
    with its index. Each program compiles once, before its first call, apart from the
    timed decoding."""
    if self.mesh is not None:
      raise ValueError("method 'ssd' places the target and the draft on a device each; "
                       "it does not run over a mesh")
    target_device = jax.local_devices()[0]
    target_params, draft_params, draft_params_d = self._ssd_models
    compile_seconds = 0.0

    def run(name, fn, args, kwargs):
      nonlocal compile_seconds
      program, seconds = self._compiled(fn, args, kwargs,
                                        ("ssd", name, spec, tokens.shape[1], cache_len))
      compile_seconds += seconds
      return program(*args)

    starts, results = [], []
    start = time.perf_counter()
    for prompt in range(tokens.shape[0]):
      result = ssd.decode(
          target_params, draft_params, jax.device_put(tokens[prompt:prompt + 1], target_device),
          jax.device_put(lengths[prompt:prompt + 1], target_device),
          jax.random.fold_in(jax.random.PRNGKey(seed), prompt), spec=spec,
          target_config=self.target.config, draft=self.draft, cache_len=cache_len,
          prefill_chunk=self.prefill_chunk, draft_device=self.draft_device,
          draft_params_on_device=draft_params_d, run=run)
      starts.append(prompt)
      results.append(jax.device_get(result))
    seconds = time.perf_counter() - start - compile_seconds
    return _generation(_stack_calls(starts, results, tokens.shape[0]), tokens.shape[0],
                       seconds, compile_seconds)


def _stack_calls(starts, results, num_prompts: int) -> loop.DecodeResult:
  """One DecodeResult from calls over consecutive blocks of the prompts, the blocks'
  first prompts `starts`. Rounds follow each other; `prompt_rb` indexes the whole list,
  and the last call's padding prompts are inactive (their time is the call's, their
  tokens none)."""
  trimmed = [jax.tree.map(lambda x, r=int(res.num_rounds): np.asarray(x)[:r], res.stats)
             for res in results]
  stats = jax.tree.map(lambda *xs: np.concatenate(xs), *trimmed)
  offsets = np.concatenate([np.full(int(res.num_rounds), start)
                            for start, res in zip(starts, results)])
  prompt_rb = stats.prompt_rb + offsets[:, None]
  # The padding of the last call is not output: its rounds count for no prompt.
  stats = stats.replace(prompt_rb=prompt_rb,
                        active_rb=stats.active_rb & (prompt_rb < num_prompts))
  return loop.DecodeResult(
      tokens_qn=np.concatenate([np.asarray(r.tokens_qn) for r in results])[:num_prompts],
      num_generated_q=np.concatenate([np.asarray(r.num_generated_q)
                                      for r in results])[:num_prompts],
      num_rounds=sum(int(r.num_rounds) for r in results), stats=stats)


def _generation(result: loop.DecodeResult, num_prompts: int, seconds: float,
                compile_seconds: float) -> Generation:
  """Host-side results of `num_prompts` prompts (the result may hold padding past them)."""
  rounds = int(result.num_rounds)
  stats = jax.tree.map(lambda x: np.asarray(x)[:rounds], result.stats)
  token_ids = [row[:n].tolist() for row, n in zip(result.tokens_qn[:num_prompts],
                                                   result.num_generated_q[:num_prompts])]
  accepted = [stats.num_accepted_rb[metrics.served_mask(stats, q)].tolist()
              for q in range(num_prompts)]
  policy = (None if result.policy is None else
            jax.tree.map(lambda x: np.asarray(x)[:num_prompts], result.policy))
  return Generation(token_ids=token_ids, rounds=rounds, accepted_per_round=accepted,
                    stats=stats, seconds=seconds, compile_seconds=compile_seconds,
                    policy=policy)
