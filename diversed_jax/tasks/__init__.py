"""Benchmark tasks: data, prompts, rewards and the code sandbox.

Modules: datasets (Example, load_examples), prompts (build_prompt, fit_prompt_ids; token
ids through diversed_jax.tokenizer.encode_prompt),
gsm8k / summarization / code (rewards), sandbox (run_program, run_many), registry (get_task).
"""

from diversed_jax.tasks.code import build_program, extract_code, humaneval_program, mbpp_program
from diversed_jax.tasks.datasets import Example, load_examples
from diversed_jax.tasks.gsm8k import extract_answer, gsm8k_reward
from diversed_jax.tasks.prompts import build_prompt, fit_prompt_ids, load_shots
from diversed_jax.tasks.registry import TASK_NAMES, Task, get_task
from diversed_jax.tasks.sandbox import ExecResult, run_many, run_program
from diversed_jax.tasks.summarization import rouge2, rouge_scores, summarization_reward
