"""Summary rows from per-example records, and the report files of a workdir.

  summary.json  a list of rows, one per method setting (COLUMNS, plus setting / params)
  summary.csv   the same rows
  summary.md    a Markdown table (printed at the end of a run)
  pareto.png    acceptance rate and speed-up against task quality; the static-ensemble,
                lenience and mentored grids as lines, the other methods as labelled points
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Sequence

import numpy as np

from diversed_jax import atomic_files
from diversed_jax.evaluation.methods import CURVES

COLUMNS = ("method", "setting", "params", "dataset", "n_examples", "acceptance_rate",
           "tokens_per_round", "mean_accepted", "expected_accepted_theory", "mean_weight",
           "mean_ess", "hit_rate", "quality_metric", "quality", "quality_stderr",
           "tokens_per_second", "speedup_vs_ar", "seconds")


def _row(setting, records: Sequence[dict], extra: dict, dataset: str, metric: str) -> dict:
  n = len(records)
  rounds = sum(r["rounds"] for r in records)
  proposed = sum(r["rounds"] * r["num_draft"] for r in records)
  accepted = sum(r["accepted"] for r in records)
  tokens = sum(r["num_tokens"] for r in records)
  seconds = sum(r["seconds"] for r in records)
  rewards = np.asarray([r["reward"] for r in records], np.float64)
  weights = [r["weight"] for r in records if "weight" in r]
  ess = [r["ess"] for r in records if "ess" in r]  # method 'smc' only
  hits = [(r["hits"], r["rounds"] - 1) for r in records if "hits" in r]  # 'ssd' only
  return {
      "method": setting.family, "setting": setting.name,
      "params": {**setting.params_dict, **extra}, "dataset": dataset, "n_examples": n,
      "acceptance_rate": accepted / proposed if proposed else 0.0,
      "tokens_per_round": tokens / rounds if rounds else 0.0,
      "mean_accepted": accepted / rounds if rounds else 0.0,
      "expected_accepted_theory": sum(r["theory"] for r in records) / rounds if rounds else 0.0,
      "mean_weight": float(np.mean(weights)) if weights else None,
      "mean_ess": float(np.mean(ess)) if ess else None,
      # Each prompt's first round has nothing before it to be pre-drafted in.
      "hit_rate": (sum(h for h, _ in hits) / max(1, sum(n for _, n in hits))
                   if hits else None),
      "quality_metric": metric, "quality": float(rewards.mean()) if n else None,
      "quality_stderr": float(rewards.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
      "tokens_per_second": tokens / seconds if seconds else 0.0,
      "speedup_vs_ar": None, "seconds": seconds,
  }


def summarize(per_setting, dataset: str, metric: str) -> list[dict]:
  """Rows from [(MethodSetting, records, extra params)]; speedup_vs_ar is the ratio of
  tokens per second to the 'ar' row's (None without one)."""
  rows = [_row(s, recs, extra, dataset, metric) for s, recs, extra in per_setting]
  ar = next((r for r in rows if r["method"] == "ar" and r["tokens_per_second"]), None)
  for r in rows:
    if ar is not None:
      r["speedup_vs_ar"] = r["tokens_per_second"] / ar["tokens_per_second"]
  return rows


def _fmt(value) -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.3f}"
  if isinstance(value, dict):
    return json.dumps(value, sort_keys=True)
  return str(value)


def markdown_table(rows: Sequence[dict]) -> str:
  """A Markdown table of the rows (one per setting)."""
  metric = rows[0]["quality_metric"] if rows else "quality"
  heads = ("setting", "n", "acceptance", "tokens/round", "accepted/round", "theory",
           metric, "tokens/s", "speed-up")
  keys = ("setting", "n_examples", "acceptance_rate", "tokens_per_round", "mean_accepted",
          "expected_accepted_theory", "quality", "tokens_per_second", "speedup_vs_ar")
  lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
  for r in rows:
    cells = [_fmt(r[k]) for k in keys]
    if r.get("quality_stderr") is not None:
      cells[6] += f" ± {r['quality_stderr']:.3f}"
    lines.append("| " + " | ".join(cells) + " |")
  dataset = rows[0]["dataset"] if rows else ""
  return f"Dataset {dataset}.\n\n" + "\n".join(lines) + "\n"


_SHORT = {"lenience": "l", "weight": "w", "epsilon": "eps"}


def _param_value(row: dict) -> float:
  params = row["params"]
  return next((float(v) for k, v in params.items() if isinstance(v, (int, float))), 0.0)


def _param_label(row: dict) -> str:
  key = next((k for k, v in row["params"].items() if isinstance(v, (int, float))), "")
  return f"{_SHORT.get(key, key)}={_param_value(row):g}"


def plot_pareto(rows: Sequence[dict], path: str) -> str:
  """Two panels against task quality: acceptance rate, and speed-up over 'ar'."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  panels = (("acceptance_rate", "acceptance rate"), ("speedup_vs_ar", "speed-up vs AR"))
  metric = rows[0]["quality_metric"] if rows else "quality"
  for ax, (key, label) in zip(axes, panels):
    for family in CURVES:
      curve = sorted((r for r in rows if r["method"] == family and r[key] is not None
                      and r["quality"] is not None), key=_param_value)
      if curve:
        ax.plot([r["quality"] for r in curve], [r[key] for r in curve], "o-",
                label=family, alpha=0.8)
        for r in curve:
          ax.annotate(_param_label(r), (r["quality"], r[key]), fontsize=7,
                      textcoords="offset points", xytext=(3, 3))
    for r in rows:
      if r["method"] in CURVES or r[key] is None or r["quality"] is None:
        continue
      marker = "*" if r["method"] == "diversed" else "s"
      ax.plot([r["quality"]], [r[key]], marker, markersize=11 if marker == "*" else 6)
      ax.annotate(r["setting"], (r["quality"], r[key]), fontsize=8,
                  textcoords="offset points", xytext=(4, -10))
    ax.set_xlabel(f"task quality ({metric})")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  if axes[0].get_legend_handles_labels()[0]:  # a grid family was run
    axes[0].legend(fontsize=8, loc="best")
  fig.suptitle(rows[0]["dataset"] if rows else "")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def write_reports(rows: Sequence[dict], workdir: str, plot: bool = True) -> dict[str, str]:
  """Writes summary.json/.csv/.md (and pareto.png); returns their paths by name."""
  os.makedirs(workdir, exist_ok=True)
  paths = {name: os.path.join(workdir, name)
           for name in ("summary.json", "summary.csv", "summary.md")}
  atomic_files.write_json(paths["summary.json"], list(rows), indent=1)
  with atomic_files.replacing(paths["summary.csv"]) as tmp, open(tmp, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=COLUMNS)
    writer.writeheader()
    for r in rows:
      writer.writerow({k: json.dumps(r[k], sort_keys=True) if isinstance(r[k], dict)
                       else ("" if r[k] is None else r[k]) for k in COLUMNS})
  atomic_files.write_text(paths["summary.md"], markdown_table(rows))
  if plot and rows:
    paths["pareto.png"] = plot_pareto(rows, os.path.join(workdir, "pareto.png"))
  return paths
