r"""Generate text with any verification method, for humans and scripts.

  python -m diversed_jax.generate --target=smollm2-135m-instruct \
      --prompt="Write a haiku about the sea." --max_new_tokens=64 --temperature=0 --seed=0
  python -m diversed_jax.generate --method=diversed --num_draft=4 --json --prompt=...

Without --draft a speculative method uses the target's default draft; --method=diversed
without --head uses the pair's shipped head for --task (default gsm8k), else a fixed w = 0.5
(with a warning).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging

from diversed_jax import cli
from diversed_jax import tokenizer as tokenizer_lib
from diversed_jax.evaluation import validate
from diversed_jax.models import loading
from diversed_jax.speculative import build, metrics, ssd, verification
from diversed_jax.speculative.decoder import MATMUL_PRECISIONS
from diversed_jax.speculative.types import CASCADE_RULES, DIVERGENCES, METHODS, VerifyParams
from diversed_jax.tasks.registry import get_task

_TARGET = flags.DEFINE_string("target", "smollm2-135m-instruct",
                              "Registry name, model folder, GGUF file or hub id.")
_DRAFT = flags.DEFINE_string("draft", None, "Draft: 'self:L', a model, or a draft folder "
                             "('nocopy:FOLDER': without its context-copy gate).")
_HEAD = flags.DEFINE_string("head", None, "Ensemble head folder for --method=diversed.")
_PROMPT = flags.DEFINE_string("prompt", None, "The prompt (a user turn for chat models).")
_NO_CHAT = flags.DEFINE_bool("raw", False, "Do not apply the chat template.")
_METHOD = flags.DEFINE_enum("method", "ar", METHODS, "Decoding / verification method.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus truncation of p and q.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_NUM_DRAFT = flags.DEFINE_integer("num_draft", 4, "K, drafted tokens per round.")
_LENIENCE = flags.DEFINE_float("lenience", 0.5, "Lossy SD lenience l in (0, 1].")
_WEIGHT = flags.DEFINE_float("weight", 0.5, "Static ensemble weight w on the target.")
_CASCADE_RULE = flags.DEFINE_enum("cascade_rule", "opt", CASCADE_RULES, "SpecCascade rule.")
_CASCADE_ALPHA = flags.DEFINE_float("cascade_alpha", 0.1, "SpecCascade lenience alpha.")
_EPSILON = flags.DEFINE_float("epsilon", 0.1, "Mentored decoding budget on --divergence.")
_DIVERGENCE = flags.DEFINE_enum("divergence", "tv", DIVERGENCES,
                                "Mentored decoding: the budget's divergence D(pi || p).")
_PARTICLES = flags.DEFINE_integer("particles", 4, "SMC speculative decoding: particles.")
_ESS_THRESHOLD = flags.DEFINE_float(
    "ess_threshold", 0.5, "SMC: resample when the effective sample size is at most this "
    "fraction of the particles.")
_FANOUT = flags.DEFINE_integer(
    "fanout", 2, "Speculative speculative decoding (ssd): token guesses per accepted length "
    "that the draft pre-drafts the next round after.")
_GUESS_BUDGET = flags.DEFINE_integer(
    "guess_budget", 0, "ssd: if > 0, pre-draft only this many of the (num_draft + 1) x "
    "--fanout guesses, the likeliest by the draft's law.")
_SAGUARO_SCALE = flags.DEFINE_float(
    "saguaro_scale", 1.0, "ssd: scale C in (0, 1] of the draft's top --fanout "
    "probabilities (Saguaro sampling; 1 = off).")
_TASK = flags.DEFINE_string("task", None, "Task whose shipped head to use (diversed; "
                            "default gsm8k).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of text.")
_PRECISION = flags.DEFINE_enum(
    "matmul_precision", "highest", MATMUL_PRECISIONS,
    "Precision of float32 products on GPU/TPU; 'highest' keeps exact methods exact.")


def verify_params_from_flags() -> VerifyParams:
  return VerifyParams(method=_METHOD.value, temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                      lenience=_LENIENCE.value, weight=_WEIGHT.value,
                      cascade_rule=_CASCADE_RULE.value, cascade_alpha=_CASCADE_ALPHA.value,
                      epsilon=_EPSILON.value, divergence=_DIVERGENCE.value,
                      particles=_PARTICLES.value, ess_threshold=_ESS_THRESHOLD.value,
                      fanout=_FANOUT.value, guess_budget=_GUESS_BUDGET.value,
                      saguaro_scale=_SAGUARO_SCALE.value)


def check_flags() -> VerifyParams:
  """The run's VerifyParams, after checking every flag before any model loads."""
  if _PROMPT.value is None:
    raise app.UsageError("--prompt is required")
  if _MAX_NEW.value < 1:
    raise app.UsageError(f"--max_new_tokens must be >= 1, got {_MAX_NEW.value}")
  speculative = _METHOD.value != "ar"
  if _NUM_DRAFT.value < int(speculative):
    raise app.UsageError(f"--num_draft must be >= {int(speculative)} with --method="
                         f"{_METHOD.value}, got {_NUM_DRAFT.value}")
  verify = verify_params_from_flags()
  with cli.usage_errors():
    verification.validate_params(verify, prefix="--")  # its fields are this program's flags
    if verify.method == "ssd":
      ssd.check_budget(verify, _NUM_DRAFT.value, prefix="--")
    _check_names(speculative)
  if not speculative and _DRAFT.value is not None:
    logging.warning("--method=ar decodes with the target alone; --draft=%s is not used.",
                    _DRAFT.value)
  return verify


def _check_names(speculative: bool) -> None:
  """The model, draft, head and task names, as the main job's config checks them: a typo
  would otherwise fail after the target loads, or (--task) silently give w = 0.5."""
  validate.check_model("--target", _TARGET.value)
  if speculative and _DRAFT.value is not None:
    validate.check_model("--draft", _DRAFT.value, allow_self=True)
  head = _HEAD.value
  if head is not None and not os.path.isfile(os.path.join(os.path.expanduser(head),
                                                          "head.json")):
    raise ValueError(f"--head={head!r}: not a head folder (no head.json)")
  if _TASK.value is not None:
    try:
      get_task(_TASK.value)
    except ValueError as err:
      raise ValueError(f"--task={_TASK.value!r}: {err}") from None


def main(argv):
  del argv
  verify = check_flags()
  target = loading.load_model(_TARGET.value)
  tokenizer = tokenizer_lib.load_tokenizer(_TARGET.value)
  decoder, info = build.build_decoder(target, _DRAFT.value, _HEAD.value, _TASK.value,
                                      need_draft=verify.method != "ar",
                                      matmul_precision=_PRECISION.value)
  if verify.method == "diversed" and info.get("head") == build.FIXED_HEAD:
    logging.warning(build.fixed_weight_warning(target.name, info["draft"], _TASK.value))
  prompt_ids = tokenizer_lib.encode_prompt(tokenizer, _PROMPT.value, chat=not _NO_CHAT.value)
  out = decoder.generate([prompt_ids], verify, num_draft=_NUM_DRAFT.value,
                         max_new_tokens=_MAX_NEW.value, seed=_SEED.value)
  ids = out.token_ids[0]
  text = tokenizer.decode(ids, skip_special_tokens=True)
  summary = metrics.summarize_generation(out, verify.method != "ar")
  if _JSON.value:
    record = {"text": text, "token_ids": ids, "num_tokens": len(ids),
              "tokens_per_second": len(ids) / out.seconds if out.seconds else 0.0,
              "seconds": out.seconds, "compile_seconds": out.compile_seconds,
              "method": verify.method, **info, **summary}
    print(json.dumps(record))
  else:
    print(text)
    hits = f", hit rate {summary['hit_rate']:.3f}" if "hit_rate" in summary else ""
    print(f"[{len(ids)} tokens, {len(ids) / out.seconds:.1f} tokens/s, "
          f"{summary['rounds']} rounds, acceptance {summary['acceptance_rate']:.3f}{hits}]",
          file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
