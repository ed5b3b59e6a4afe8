"""Base config of the main job: the embedded pair (SmolLM2-135M-Instruct and its shipped
draft and head) evaluated on a GSM8K slice. Task configs (gsm8k.py, cnndm.py, ...) start
from here; `:variant` picks a model preset (embedded, llama, qwen3, gemma3 or tiny; see
diversed_jax/evaluation/presets.py):

  python -m diversed_jax.main --config=configs/gsm8k.py
  python -m diversed_jax.main --config=configs/gsm8k.py:qwen3 --config.task.limit=200
  python -m diversed_jax.main --config=configs/cnndm.py --config.mode=train_and_eval \
      --config.decode.temperature=0.1
"""

import ml_collections

from diversed_jax.evaluation import presets
from diversed_jax.training import config as train_config


def get_config(variant: str = "") -> ml_collections.ConfigDict:
  return with_preset(base(), variant)


def with_preset(c: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
  """Applies the model preset named by the `:variant` argument (after task settings)."""
  presets.apply(c, variant)
  return c


def base() -> ml_collections.ConfigDict:
  """Every field, with the embedded pair and a GSM8K slice."""
  c = ml_collections.ConfigDict()
  c.mode = "eval"  # 'eval', 'train', 'train_and_eval', 'distill' or 'bench'
  c.workdir = "runs/main"  # outputs when --workdir is not given (results, reports, head)
  c.seed = 0  # base seed of every sampling stream (per batch: seed + first example index)

  c.model = ml_collections.ConfigDict()
  c.model.target = "smollm2-135m-instruct"  # registry name, model folder, .gguf or hub id
  c.model.draft = ""  # '' = the target's default draft; 'self:L', a model or a draft folder
  c.model.finetuned_draft = ""  # draft of method 'sd_finetuned' ('' = that method is skipped)
  c.model.tokenizer = ""  # tokenizer spec; '' = the target's
  c.model.chat = True  # wrap prompts in the chat template (instruction-tuned targets)

  c.head = ml_collections.ConfigDict()
  c.head.path = ""  # head folder; '' = WORKDIR/train/head, else the shipped head, else w = 0.5
  c.head.task = ""  # task of the shipped head when head.path is '' ('' = task.name)

  c.task = ml_collections.ConfigDict()
  c.task.name = "gsm8k"  # 'gsm8k', 'cnndm', 'xsum', 'mbpp' or 'humaneval'
  c.task.source = ""  # '' = the shipped sample; a local .jsonl/.json file; or a hub dataset name
  c.task.split = "test"  # split to evaluate (names the ids of a local file)
  c.task.offset = 0  # first example of the evaluated slice
  c.task.limit = 8  # examples in the slice (0 = all from offset)
  c.task.num_shots = 0  # few-shot examples from the train split in each prompt
  c.task.max_prompt_tokens = 1024  # longer prompts are shortened (article, then shots) inside
  # their template; one that cannot fit even so is cut from the left, with a warning
  c.task.fields = ml_collections.ConfigDict()  # field names in the data file ('' = task default)
  c.task.fields.id = ""  # example id
  c.task.fields.source_text = ""  # question / article / problem text
  c.task.fields.reference = ""  # answer / summary / test code
  c.task.fields.test_list = ""  # mbpp: list of assert lines
  c.task.fields.entry_point = ""  # humaneval: function name

  c.decode = ml_collections.ConfigDict()
  c.decode.temperature = 1.0  # sampling temperature of p and q (paper: 1.0 and 0.1; 0 = greedy)
  c.decode.top_p = 1.0  # nucleus truncation of p and q before verification (1 = off)
  c.decode.num_draft = 4  # K, drafted tokens per round
  c.decode.max_new_tokens = 96  # generated tokens per example at most
  c.decode.batch_size = 4  # rows decoded together (the last batch is padded to this size)
  # Examples per decoding call; > batch_size: continuous batching (finished rows take the
  # next queued example, so no row idles waiting for a batch's slowest). 0: batch_size.
  c.decode.queue = 0
  # Once no example is queued, continue with the unfinished rows only (B/2, B/4, ..., 1:
  # the slowest rows stop paying for finished ones). Each width compiles one more round
  # (~+10 s at batch 4 on CPU), so it pays for long calls (a large queue), not here.
  c.decode.shrink_tail = False
  # Precision of float32 products on GPUs/TPUs (jax.default_matmul_precision): "highest"
  # keeps exact methods exact (greedy SD == plain greedy); "default" (TF32 / bf16 passes)
  # is faster there but breaks that. CPU: no effect.
  c.decode.matmul_precision = "highest"
  # Devices a call's rows are split over ('data' mesh axis): -1 = all visible (every host's),
  # 1 = one device. With several, decode.batch_size (bench: bench.num_prompts) must divide
  # by it, and so must a queue (decode.queue > batch_size: each device runs its own over a
  # block of the call's examples). One device: no effect.
  c.decode.mesh_data = -1

  c.methods = ml_collections.ConfigDict()
  c.methods.run = "ar,sd,lossy,static,diversed"  # comma list of methods.FAMILIES
  c.methods.lenience = (0.3,)  # lossy SD grid of l in (0, 1]
  c.methods.static_weights = (0.25, 0.5, 0.75)  # static-ensemble grid of w (on the target)
  c.methods.static_rule = "static"  # 'static' (mixture of probabilities) or 'static_logit'
  c.methods.cascade_rules = ("opt",)  # SpecCascade deferral rules (chow diff opt v1 v2 v3)
  c.methods.cascade_alpha = 0.1  # SpecCascade lenience alpha
  c.methods.mentored_epsilon = (0.1,)  # mentored decoding grid of the budget epsilon
  c.methods.mentored_divergence = "tv"  # its budget's divergence D(pi || p): tv, kl, chi2
  c.methods.typical_epsilon = 0.3  # Medusa typical acceptance: hard threshold
  c.methods.typical_delta = 0.09  # Medusa typical acceptance: entropy-scaled threshold
  c.methods.smc_particles = (4,)  # SMC speculative decoding grid of particles per prompt
  c.methods.smc_ess_threshold = 0.5  # SMC: resample when ESS <= this x particles
  c.methods.ssd_fanout = 2  # speculative speculative decoding: guesses per accepted length
  c.methods.ssd_guess_budget = 0  # > 0: pre-draft only the likeliest this many of them
  c.methods.ssd_saguaro_scales = (1.0,)  # its grid of Saguaro scales C in (0, 1] (1 = off)

  c.eval = ml_collections.ConfigDict()
  c.eval.results_file = "results.jsonl"  # per-example results in the workdir (appended, resumable)
  c.eval.score_workers = 2  # parallel sandboxed programs when scoring code tasks
  c.eval.plot = True  # draw pareto.png

  c.bench = ml_collections.ConfigDict()
  c.bench.num_prompts = 4  # prompts per timed batch in mode 'bench'
  c.bench.repeats = 2  # timed repeats per setting (after one compile run)

  c.distill = ml_collections.ConfigDict()
  c.distill.config = "configs/distill_smollm2.py"  # config file of `python -m diversed_jax.distill`
  c.distill.mode = "train"  # its mode: 'data' or 'train' (export: run diversed_jax.distill)

  c.train = train_config.default_config()  # head training (diversed_jax.training), see there
  c.train.task = ""  # task whose examples train the head ('' = task.name)
  c.train.source = ""  # '' = the task's shipped sample; a local .jsonl/.json file or a hub name
  c.train.split = "train"  # split of train.source to train on
  c.train.limit = 0  # training prompts (0 = the whole split)
  return c
