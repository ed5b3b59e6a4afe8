"""Draft distillation for SmolLM2-135M-Instruct (issue 4).

  python -m diversed_jax.distill --config=configs/distill_smollm2.py                # train
  python -m diversed_jax.distill --config=configs/distill_smollm2.py --config.mode=data
  python -m diversed_jax.distill --config=configs/distill_smollm2.py \
      --config.train.init_from=diversed_jax/assets/drafts/smollm2-135m-feature \
      --config.train.loss=tvd --config.train.lr=3e-4   # fine-tune (how the shipped one was)
  python -m diversed_jax.distill --config=configs/distill_smollm2.py --config.mode=shrink_vocab \
      --config.train.init_from=FOLDER --config.draft.vocab_keep=8192 --config.export_dir=OUT
  python -m diversed_jax.distill --config=configs/distill_smollm2.py --config.mode=fit_copy_gate \
      --config.train.init_from=FOLDER --config.export_dir=OUT --config.data.seed=10 \
      --config.data.continuations_dir=distill/smollm2_target_s10  # context copying
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.mode = "train"  # data (write target shards), train, export (best -> asset folder),
  # shrink_vocab (train.init_from with draft.vocab_keep of its ids -> export_dir)
  # or fit_copy_gate (train.init_from with a fitted context-copy gate -> export_dir)
  c.target = "smollm2-135m-instruct"  # registry name, folder or GGUF of the target
  c.workdir = "runs/distill_smollm2"  # checkpoints, logs; git-ignored
  c.export_dir = ""  # for modes export, shrink_vocab, fit_copy_gate: the folder to write

  c.data = ml_collections.ConfigDict()
  c.data.dir = "runs/distill_ref_smollm2"  # shard folder shared by data and train modes
  # More shard folders for training (not data mode): every shard, except sequences whose
  # prompt is a held-out shard's (another data plan puts it under another index).
  c.data.extra_train_dirs = ()
  c.data.continuation = "reference"  # 'reference' (dataset answers) or 'target' (generated)
  # 'target' only: folder keeping the generated ids (absolute, or under diversed_jax/data;
  # small, committed), from which lost shards are rebuilt by teacher forcing. '' = not kept.
  c.data.continuations_dir = ""
  c.data.continuations_only = False  # write only the kept ids (about half a shard's cost)
  # JSONL files (relative paths: under diversed_jax/data). Train/validation splits only.
  c.data.gsm8k_path = ("distill/gsm8k_train.jsonl",)  # records with 'question'
  c.data.cnndm_path = ("cnndm/train.jsonl", "cnndm/train_more.jsonl")  # with 'article'
  c.data.max_chars = 1800  # CNN/DM article character budget (keeps prompts < 512 tokens)
  # Which max_chars windows of each CNN/DM article are prompts: 0 is its start (as in the
  # evaluation); (1, 2) gives new prompts from the rest of long articles (target
  # continuations only: the reference summary belongs to the whole article).
  c.data.cnndm_windows = (0,)
  c.data.pattern = ("gsm8k", "cnndm", "gsm8k", "cnndm")  # source of consecutive shards
  c.data.batch = 16  # prompts per shard (one generation batch)
  c.data.num_shards = 260  # shards to write (resumes: existing shards are skipped)
  c.data.temperatures = (1.0, 0.0)  # generation temperature, alternating per pattern cycle
  c.data.max_new_tokens = 160  # GSM8K continuation length
  c.data.max_new_tokens_cnndm = 112  # CNN/DM continuation length
  c.data.top_k = 32  # target probabilities stored per position
  c.data.seed = 0  # prompt shuffle and sampling seed
  c.data.tokenizer = ""  # tokenizer spec; empty: the target's

  c.draft = ml_collections.ConfigDict()
  c.draft.kind = "feature"  # 'feature' (EAGLE-style) or 'independent'
  c.draft.num_layers = 1  # decoder layers of the draft
  c.draft.hidden_size = 576  # width (forced to the target width for 'feature')
  # Heads and MLP width of 'independent' ('feature' copies the target's last layers, so
  # it takes their geometry).
  c.draft.num_heads = 9  # query heads
  c.draft.num_kv_heads = 3  # key/value heads
  c.draft.intermediate_size = 1536  # MLP width
  c.draft.vocab_keep = 8192  # kept vocabulary of the truncated head (most frequent ids)

  c.train = ml_collections.ConfigDict()
  c.train.steps = 200_000  # total optimiser steps (runs are resumable; stop any time)
  c.train.batch = 6  # windows per step
  c.train.mesh_data = -1  # devices a step's windows are split over ('data'; -1: all, 1: one)
  c.train.window = 256  # tokens per window (a GSM8K record fits whole; 128 cut off the question)
  c.train.lr = 1e-3  # peak AdamW learning rate
  c.train.warmup = 100  # linear warm-up steps
  c.train.decay_steps = 20_000  # cosine decay length to 0.1 * lr, then constant
  c.train.weight_decay = 0.0  # AdamW weight decay
  c.train.clip = 1.0  # global gradient-norm clip
  # 'kl' (forward KL on the target's top-k) or 'tvd' (sum over the top-k of max(p - q, 0):
  # the top-k mass minus the acceptance sum min(p, q)).
  # kl trains from scratch; tvd fine-tunes a trained draft better (benchmarks/DRAFTS.md,
  # session 16), while its gradient ~q(1-q) is slow from a poor start.
  c.train.loss = "kl"
  c.train.feature_weight = 0.1  # weight of the smooth-L1 feature regression ('feature' only)
  # Weight of -log q(argmax p), the cross-entropy to the token a greedy round accepts, added
  # to the main loss (the T = 1 losses above leave greedy agreement behind; DRAFTS.md
  # session 42).
  c.train.argmax_weight = 0.0
  c.train.unroll = 2  # drafting steps simulated per window ('feature' only)
  c.train.prompt_weight = 0.2  # loss weight of prompt positions (generated positions: 1)
  c.train.checkpoint_every = 50  # steps between orbax checkpoints
  c.train.keep_checkpoints = 2  # checkpoints kept
  c.train.log_every = 10  # steps between progress lines
  c.train.eval_every = 100  # steps between held-out evaluations (0: never)
  # Held-out metric that picks the exported best draft: 'accept1' (one-step acceptance at
  # T = 1) or 'top11' (one-step greedy agreement, for greedy-targeted runs).
  c.train.select_by = "accept1"
  # Shard indices of data.dir held out for evaluation: never trained on, nor are their
  # prompts in any other training shard.
  c.train.eval_shards = (0, 1)
  c.train.min_shards = 4  # wait until this many shards exist before training
  c.train.rescan_every = 50  # steps between rescans of the shard folder
  c.train.seed = 0  # init and batch sampling seed
  # Draft folder to fine-tune from ('' = fresh): an asset folder or a run's <workdir>/best.
  c.train.init_from = ""
  c.train.grow_layers = 0  # with init_from: layers appended, starting as the identity
  # With init_from: choose the kept vocabulary (draft.vocab_keep ids) anew from the training
  # shards instead of keeping the folder's; the head rows are the target's frozen embedding,
  # so nothing trained depends on which ids are kept.
  c.train.reselect_vocab = False

  # mode=fit_copy_gate (diversed_jax/distill/copy_gate.py): fitted on the kept ids of the
  # data plan given by `data` (for the shipped draft: data.seed=10,
  # data.continuations_dir=distill/smollm2_target_s10).
  c.copy = ml_collections.ConfigDict()
  c.copy.max_ngram = 6  # longest context suffix looked up
  c.copy.unroll = 3  # drafting steps fitted on (step j > 1 reads the draft's own features)
  c.copy.lam_step = 0.05  # grid of the blend weight lam: 0, lam_step, ..., max_lam
  c.copy.max_lam = 0.95  # largest lam the gate gives (a multiple of lam_step)
  c.copy.l2 = 1e-5  # L2 penalty on the gate's weights
  c.copy.fit_steps = 2000  # Adam steps, each on all the positions
  c.copy.learning_rate = 3e-3
  # T = 1 shards of the seed-10 plan (T alternates every 4 shards). 0 and 1 are the
  # distillation's held-out shards, on which a gate fitted on shards 2, 3, 8 and 9 was
  # checked (benchmarks/DRAFTS.md, session 30).
  c.copy.shards = (0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19)
  return c
