"""Model presets of the main job, chosen by the `:variant` of a config file.

  embedded  SmolLM2-135M-Instruct with its shipped draft and head (the default; CPU-sized)
  llama     Llama-3.2-1B-Instruct drafting for Llama-3.1-8B-Instruct (the paper's pair)
  qwen3     Qwen3-0.6B drafting for Qwen3-8B
  gemma3    Gemma-3-4B-it drafting for Gemma-3-12B-it
  tiny      tiny random models written to a temporary folder (tests, CI, the notebook)

The paper pairs are hub ids (downloaded on first use); point `model.target` and
`model.draft` at local folders instead on an offline machine. They also widen the method
grids to the paper's sweep and evaluate the whole slice.
"""

from __future__ import annotations

import ml_collections

# name -> (target, draft): hub ids or local paths, anything `loading.load_model` reads.
PAIRS = {
    "llama": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    "qwen3": ("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B"),
    "gemma3": ("google/gemma-3-12b-it", "google/gemma-3-4b-it"),
}
VARIANTS = ("", "embedded", "tiny") + tuple(PAIRS)


def _paper_grids(c: ml_collections.ConfigDict) -> None:
  c.methods.run = "ar,sd,sd_finetuned,lossy,cascade,static,diversed,mentored,typical,smc"
  c.methods.lenience = (0.1, 0.3, 0.5, 0.7, 0.9)
  c.methods.static_weights = (0.1, 0.3, 0.5, 0.7, 0.9)
  c.methods.cascade_rules = ("chow", "diff", "opt")
  c.methods.mentored_epsilon = (0.05, 0.1, 0.2, 0.4)
  c.methods.smc_particles = (4, 8)
  c.task.limit = 0
  c.decode.batch_size = 16


def apply(c: ml_collections.ConfigDict, variant: str) -> None:
  """Sets the model fields (and sizes) of preset `variant` on config `c`, in place.

  Raises:
    ValueError: an unknown variant, listing the known ones.
  """
  variant = (variant or "").strip()
  if variant not in VARIANTS:
    raise ValueError(f"config variant {variant!r} is not one of {list(VARIANTS)} "
                     "(use --config=configs/NAME.py:VARIANT)")
  if variant in ("", "embedded"):
    return
  if variant in PAIRS:
    c.model.target, c.model.draft = PAIRS[variant]
    # The fine-tuned draft is produced by `diversed_jax.distill` for these pairs; set
    # model.finetuned_draft to its folder to add 'sd_finetuned'.
    _paper_grids(c)
    c.workdir = c.workdir + "_" + variant
    return
  from diversed_jax.evaluation import tiny  # writes small files: only when asked for
  folder = tiny.write_tiny_models()
  c.model.target = folder + "/target"
  c.model.draft = folder + "/draft"
  c.model.finetuned_draft = folder + "/draft_finetuned"
  c.model.chat = True
  c.workdir = c.workdir + "_tiny"
  c.task.limit = 4
  c.task.max_prompt_tokens = 96
  c.decode.max_new_tokens = 8
  c.decode.batch_size = 2
  c.decode.num_draft = 2
  c.methods.run = "ar,sd,sd_finetuned,lossy,static,diversed"
  c.methods.lenience = (0.5,)
  c.methods.static_weights = (0.3, 0.7)
  c.bench.num_prompts = 2
  c.bench.repeats = 1
  tiny.shrink_train(c.train)
