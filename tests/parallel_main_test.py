"""The main job on several devices and processes (fake CPU devices, tiny random models):
the rows of each call split over a 'data' mesh of one process's 4 devices give the
1-device run's results; two processes joined by jax.distributed on localhost run the same
job (also a queue, and head training to the 1-device run's head), only process 0 writes,
and both resume alike; object-store workdirs and rows that do not divide over the mesh are
refused."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from diversed_jax.evaluation import runner, tiny
from tests import two_processes as two_processes_lib
from tests import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ar and a draft-using ensemble at a temperature > 0: sampled tokens, acceptance, rewards.
JOB = ["--config=configs/gsm8k.py:tiny", "--config.methods.run=ar,static",
       "--config.methods.static_weights=(0.5,)", "--config.decode.temperature=0.5",
       "--config.decode.batch_size=4"]
FIELDS = ("completion", "num_tokens", "rounds", "accepted", "reward", "num_draft")
MESH_LINE = "mesh: 4 rows per call split over data=4 devices"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  # Written here, so that the jobs below find them and touch no device while their
  # config loads (jax.distributed.initialize must come first).
  return tiny.write_tiny_models(str(tmp_path_factory.mktemp("tiny") / "models"))


def _env(tiny_dir, devices=1, **extra):
  env = {k: v for k, v in os.environ.items() if k != "JAX_COORDINATOR_ADDRESS"}
  env.update(JAX_PLATFORMS="cpu", DIVERSED_TINY_DIR=tiny_dir, **extra)
  env["XLA_FLAGS"] = xla_flags.flags(devices)
  return env


def _run(args, env, cwd=ROOT, timeout=300):
  proc = subprocess.run([sys.executable, "-m", "diversed_jax.main", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)
  return proc.returncode, proc.stdout, proc.stderr


def _records(workdir):
  with open(os.path.join(workdir, "results.jsonl")) as f:
    return {(r["setting"], r["example_id"]): r for r in map(json.loads, f)}


def _assert_same_results(got, want):
  assert got.keys() == want.keys() and len(want) == 2 * 4
  for key, record in want.items():
    for field in FIELDS:
      assert got[key][field] == record[field], (key, field)
    assert got[key]["theory"] == pytest.approx(record["theory"], rel=1e-5)


@pytest.fixture(scope="module")
def one_device(tiny_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("one") / "run")
  code, out, err = _run([*JOB, f"--workdir={workdir}"], _env(tiny_dir))
  assert code == 0, err[-3000:]
  assert "mesh:" not in out  # one device: no mesh, nothing changes
  return _records(workdir)


def test_four_devices_split_the_rows_and_match_one_device(tiny_dir, one_device, tmp_path):
  workdir = str(tmp_path / "run")
  code, out, err = _run([*JOB, f"--workdir={workdir}"], _env(tiny_dir, devices=4))
  assert code == 0, err[-3000:]
  assert MESH_LINE + " (1 process)" in out
  _assert_same_results(_records(workdir), one_device)
  assert "| static(w=0.5) |" in out


def _two_processes(tiny_dir, workdirs, job=JOB):
  """Runs `job` as 2 processes of 2 fake devices each (workdirs[i] for process i)."""
  return two_processes_lib.run(
      lambda i: [sys.executable, "-m", "diversed_jax.main", *job, f"--workdir={workdirs[i]}"],
      _env(tiny_dir, devices=2), cwd=ROOT)


@pytest.fixture(scope="module")
def two_processes(tiny_dir, tmp_path_factory):
  """Each process has 2 devices: the mesh spans 4 over both, each holds 2 rows, and the
  decoder's results are all-gathered. Process 1 gets its own workdir (it must stay
  absent). Returns (workdirs, the processes' stdout)."""
  root = tmp_path_factory.mktemp("two")
  workdirs = [str(root / "p0"), str(root / "p1")]
  return workdirs, _two_processes(tiny_dir, workdirs)


def test_two_processes_run_the_same_job_and_only_process_0_writes(one_device,
                                                                  two_processes):
  workdirs, outs = two_processes
  for out in outs:
    assert MESH_LINE + " (2 processes)" in out
  assert "| static(w=0.5) |" in outs[0] and "| static(w=0.5) |" not in outs[1]
  assert not os.path.exists(workdirs[1])
  _assert_same_results(_records(workdirs[0]), one_device)
  assert {"config.json", "summary.json", "summary.md", "pareto.png"} <= set(
      os.listdir(workdirs[0]))


def test_two_processes_resume_alike(tiny_dir, two_processes):
  """A second run finds everything done: process 1, whose workdir is empty, learns it
  from process 0's file (broadcast), so neither decodes and both finish."""
  workdirs, _ = two_processes
  outs = _two_processes(tiny_dir, workdirs)
  for out in outs:
    assert "batch 1/1" not in out and "[2/2] static(w=0.5)" in out
  assert "| static(w=0.5) |" in outs[0]
  assert len(_records(workdirs[0])) == 2 * 4 and not os.path.exists(workdirs[1])


@pytest.mark.parametrize("url", ["gs://bucket/run", "s3://bucket/run", "file:///tmp/run"])
def test_object_store_workdirs_are_refused(url):
  with pytest.raises(ValueError, match="object-store URLs are not supported.*gcsfuse"):
    runner.check_workdir(url)
  assert runner.check_workdir("runs/gs_like:name") == "runs/gs_like:name"


def test_main_refuses_a_gs_workdir_before_loading_anything(tiny_dir, tmp_path):
  args = [f"--config={ROOT}/configs/gsm8k.py:tiny", "--workdir=gs://bucket/run"]
  env = _env(tiny_dir, PYTHONPATH=ROOT)
  code, out, err = _run(args, env, cwd=str(tmp_path), timeout=120)
  assert code != 0
  assert "workdir='gs://bucket/run': object-store URLs are not supported" in err
  assert "Traceback" not in err and "loading target" not in out
  assert os.listdir(tmp_path) == []  # no local ./gs: folder


def test_rows_that_do_not_divide_over_the_mesh_are_refused(tiny_dir, tmp_path):
  args = [*JOB, "--config.decode.batch_size=3", f"--workdir={tmp_path / 'run'}"]
  code, out, err = _run(args, _env(tiny_dir, devices=4), timeout=120)
  assert code != 0 and "Traceback" not in err
  assert "decode.batch_size=3: rows are split over the 4 devices" in err
  assert not os.path.exists(tmp_path / "run")


# Continuous batching: 8 examples a call (6 real, padded) through 4 rows; on 4 devices each
# runs its own queue of 2 through 1 row. Greedy, so the one-device records come back.
QUEUE_JOB = ["--config=configs/gsm8k.py:tiny", "--config.methods.run=ar,sd",
             "--config.decode.temperature=0.0", "--config.decode.batch_size=4",
             "--config.decode.queue=8", "--config.task.limit=6"]


def test_a_queue_split_over_processes_matches_one_device(tiny_dir, tmp_path):
  """Queues on one process's 4 devices are checked by tests/sharding_test.py (the decoder,
  with and without a shrinking tail) and the main job's one-process mesh by
  test_four_devices_split_the_rows_and_match_one_device."""
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  code, out, err = _run([*QUEUE_JOB, f"--workdir={one}"], _env(tiny_dir))
  assert code == 0, err[-3000:]
  want = _records(one)
  assert len(want) == 2 * 6
  for out in _two_processes(tiny_dir, [two, str(tmp_path / "p1")], job=QUEUE_JOB):
    assert ("mesh: a queue of 8 examples per call split over data=4 devices, 2 through 1 "
            "rows on each (2 processes)") in out
  got = _records(two)
  assert got.keys() == want.keys()
  for key, record in want.items():
    for field in FIELDS:
      assert got[key][field] == record[field], (key, field)


def test_a_queue_that_does_not_divide_over_the_mesh_is_refused(tiny_dir, tmp_path):
  args = [*QUEUE_JOB, "--config.decode.queue=6", f"--workdir={tmp_path / 'run'}"]
  code, out, err = _run(args, _env(tiny_dir, devices=4), timeout=120)
  assert code != 0 and "Traceback" not in err
  assert "decode.queue=6: each of the 4 devices of the mesh (decode.mesh_data=-1) runs its " \
         "own queue" in err
  assert not os.path.exists(tmp_path / "run")


def test_mesh_data_is_validated(tiny_dir, monkeypatch):
  from diversed_jax.evaluation import config_io, validate
  monkeypatch.setenv("DIVERSED_TINY_DIR", tiny_dir)
  config = config_io.load_config(os.path.join(ROOT, "configs", "gsm8k.py:tiny"),
                                 {"decode.mesh_data": 0})
  with pytest.raises(ValueError, match=r"decode.mesh_data=0: must be -1"):
    validate.validate(config)


# ------------------------------------------------------------------ head training

# 4 steps of 2 prompts x 2 rollouts (4 rows a step), a checkpoint every 2; decode's batch
# (the tiny config's 2) is not used by mode train, so it need not divide over the mesh.
TRAIN_JOB = ["--config=configs/gsm8k.py:tiny", "--config.mode=train",
             "--config.train.total_steps=4", "--config.train.checkpoint_every=2"]
TIMING = ("tokens_per_s", "rollout_seconds", "step_seconds", "compile_seconds")


def _metrics(workdir):
  with open(os.path.join(workdir, "train", "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def _head_params(workdir):
  with np.load(os.path.join(workdir, "train", "head", "params.npz")) as f:
    return {k: f[k] for k in f.files}


def _assert_same_training(workdir, want_metrics, want_params):
  got = _metrics(workdir)
  assert [m["step"] for m in got] == [1, 2, 3, 4]
  for g, w in zip(got, want_metrics):
    assert g == pytest.approx(w, rel=1e-4, abs=1e-6)
  params = _head_params(workdir)
  assert params.keys() == want_params.keys()
  for k, v in want_params.items():
    np.testing.assert_allclose(params[k], v, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def one_device_head(tiny_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("train_one") / "run")
  code, out, err = _run([*TRAIN_JOB, f"--workdir={workdir}"], _env(tiny_dir))
  assert code == 0, err[-3000:]
  assert "mesh:" not in out
  metrics = _metrics(workdir)
  assert len({m["w_mean"] for m in metrics}) > 1  # the head moved: the updates are compared
  return metrics, _head_params(workdir)


def test_two_processes_train_the_one_device_head_and_resume_from_process_0(
    tiny_dir, one_device_head, tmp_path):
  """Process 0 alone keeps the checkpoints and writes, and both evaluate its head
  (train_and_eval); after losing the last checkpoint both processes resume from process
  0's step-2 state and train steps 3-4 alike. (No one-process 4-device run: its mesh code
  is this one's, and its other branches, jax.process_count() == 1, one_device_head runs.)"""
  workdirs = [str(tmp_path / "p0"), str(tmp_path / "p1")]
  job = [*TRAIN_JOB, "--config.mode=train_and_eval", "--config.methods.run=ar,diversed",
         "--config.decode.batch_size=4"]
  outs = _two_processes(tiny_dir, workdirs, job=job)
  head = os.path.join(workdirs[0], "train", "head")
  for out in outs:
    assert "mesh: 4 rows a step split over data=4 devices (2 processes)" in out
    assert "step 4/4" in out and f"head={head}" in out
  assert "head written to" in outs[0] and "head written to" not in outs[1]
  assert "| diversed |" in outs[0] and "| diversed |" not in outs[1]
  assert not os.path.exists(workdirs[1])
  _assert_same_training(workdirs[0], *one_device_head)
  assert len(_records(workdirs[0])) == 2 * 4

  train_dir = os.path.join(workdirs[0], "train")
  shutil.rmtree(os.path.join(train_dir, "checkpoints", "4"))
  shutil.rmtree(os.path.join(train_dir, "head"))
  with open(os.path.join(train_dir, "metrics.jsonl")) as f:
    first_two = f.readlines()[:2]
  with open(os.path.join(train_dir, "metrics.jsonl"), "w") as f:
    f.writelines(first_two)
  outs = _two_processes(tiny_dir, workdirs, job=TRAIN_JOB)
  assert "resumed from" in outs[0] and "at step 2 (data position 4)" in outs[0]
  for out in outs:
    assert "step 1/4" not in out and "step 4/4" in out
  assert not os.path.exists(workdirs[1])
  _assert_same_training(workdirs[0], *one_device_head)


def test_training_rows_that_do_not_divide_over_the_mesh_are_refused(tiny_dir, tmp_path):
  args = [*TRAIN_JOB, "--config.train.prompts_per_step=3", f"--workdir={tmp_path / 'run'}"]
  code, out, err = _run(args, _env(tiny_dir, devices=4), timeout=120)
  assert code != 0 and "Traceback" not in err
  assert ("train.prompts_per_step * train.rollouts_per_prompt=6: rows are split over the "
          "4 devices of the mesh (train.mesh_data=-1)") in err
  assert not os.path.exists(tmp_path / "run")



_TOY_RUN = ("import sys\n"
            "from diversed_jax.parallel import hosts\n"
            "assert hosts.initialize_distributed()\n"
            "from diversed_jax.training import toy\n"
            "toy.run(sys.argv[1], progress=None, total_steps=3, checkpoint_every=3)\n")


def _toy_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def test_two_processes_update_with_process_0s_rewards(tmp_path):
  """The toy task's rewards vary (the tiny job's are all 0): a process that updated with
  other rewards than process 0's would move the head away from the one-device run's."""
  from diversed_jax.training import toy
  toy.run(str(tmp_path / "one"), progress=None, total_steps=3, checkpoint_every=3)
  want = _toy_metrics(str(tmp_path / "one"))
  assert len({m["reward"] for m in want}) > 1 and any(m["policy_loss"] for m in want)
  two_processes_lib.run(lambda i: [sys.executable, "-c", _TOY_RUN, str(tmp_path / f"p{i}")],
                        _env("", devices=2), cwd=ROOT)
  got = _toy_metrics(str(tmp_path / "p0"))
  assert len(got) == len(want) == 3
  for g, w in zip(got, want):
    assert g == pytest.approx(w, rel=1e-4, abs=1e-6)
  assert not os.path.exists(tmp_path / "p1")
