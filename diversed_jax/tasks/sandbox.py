"""Run untrusted Python (model-written code plus unit tests) in a contained subprocess.

Layers, outermost first; each is used where this machine allows it (see `isolation()`):
1. A subprocess per program (`python -I -S -B`), its own session and process group, in its
   own temporary directory (deleted afterwards), stdin closed, a minimal environment.
2. `unshare --net --pid --fork --kill-child` (plain as root, with `--map-root-user`
   otherwise): no network at all, and every process the program starts dies with it, because
   killing the init of a PID namespace kills the whole namespace.
3. A pids cgroup (v1, `/sys/fs/cgroup/pids`) capping processes plus threads at
   `max_processes`: the only thing that stops a fork bomb that got past the guard while it
   runs when everything runs as root (root ignores RLIMIT_NPROC).
4. rlimits set in `preexec_fn`: RLIMIT_AS (memory_mb), RLIMIT_CPU (cpu_s), RLIMIT_FSIZE
   (also bounds stdout/stderr, which go to files, not pipes, so a flood cannot fill the
   caller's memory), RLIMIT_NOFILE, RLIMIT_CORE=0, and RLIMIT_NPROC for non-root users.
5. `sandbox_guard.py`, run in the program's interpreter before it: writes only under the
   working directory, no fork/exec/kill/subprocess/socket/ctypes. A guard, not a boundary.
6. After the run, whatever the outcome: SIGKILL to the process group and to every process
   left in the cgroup, wait until they are gone, then remove the directories.
7. Passing needs exit status 0 AND the runner's "done" file, written after the program's last
   line: a completion that calls sys.exit(0) or os._exit(0) before the asserts fails. This
   stops accidental early exits, not a program that means to fake a pass: it runs in the
   runner's interpreter and can write the file itself (RL reward hacking could find that).

Limits, honestly: without namespaces and cgroups (a container without CAP_SYS_ADMIN, macOS)
only the guard, the rlimits and the process-group kill remain, and a program that bypasses
the guard can write wherever the user can, reach the network, and leave `setsid()` children
behind. Reading files is never restricted, and disk use is capped per file (RLIMIT_FSIZE),
not in total: parallel programs can fill the temporary directory's file system. Use a VM or
gVisor for adversarial code.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import math
import os
import pathlib
import resource
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Sequence

_GUARD_SOURCE = pathlib.Path(__file__).with_name("sandbox_guard.py")
_CGROUP_ROOT = "/sys/fs/cgroup/pids"
_CGROUP_PARENT = os.path.join(_CGROUP_ROOT, "diversed_jax_sandbox")
_TAIL_BYTES = 4096
_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class ExecResult:
  """Outcome of one program. passed: exit 0, not timed out, and ran to its last line."""
  passed: bool
  returncode: int | None
  timed_out: bool
  stdout_tail: str
  stderr_tail: str


@dataclasses.dataclass(frozen=True)
class Isolation:
  """Which kernel-side layers work here. unshare_argv: the prefix put before python."""
  unshare_argv: tuple[str, ...]
  network_namespace: bool
  pid_namespace: bool
  pids_cgroup: bool


@functools.lru_cache(maxsize=1)
def isolation() -> Isolation:
  """Probes once per process which layers this machine allows."""
  unshare_argv = ()
  unshare = shutil.which("unshare")
  if unshare and sys.platform.startswith("linux"):
    base = (unshare, "--net", "--pid", "--fork", "--kill-child")
    for argv in (base, base[:1] + ("--map-root-user",) + base[1:]):
      try:
        probe = subprocess.run(argv + (sys.executable, "-I", "-c", "pass"), timeout=10,
                               capture_output=True, check=False)
      except (OSError, subprocess.TimeoutExpired):
        continue
      if probe.returncode == 0:
        unshare_argv = argv
        break
  return Isolation(unshare_argv=unshare_argv, network_namespace=bool(unshare_argv),
                   pid_namespace=bool(unshare_argv), pids_cgroup=_cgroup_usable())


def _cgroup_usable() -> bool:
  probe = os.path.join(_CGROUP_PARENT, f"probe_{os.getpid()}")
  try:
    os.makedirs(probe, exist_ok=True)
    usable = os.path.exists(os.path.join(probe, "pids.max"))
    os.rmdir(probe)
    return usable
  except OSError:
    return False


@functools.lru_cache(maxsize=1)
def _site_dirs() -> str:
  paths = sysconfig.get_paths()
  return os.pathsep.join(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def _user_task_count() -> int:
  """Tasks (threads) of this user: RLIMIT_NPROC counts them all, not just ours."""
  uid, count = str(os.getuid()), 0
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
      if status["Uid"].split()[0] == uid:
        count += int(status["Threads"])
    except (OSError, KeyError, ValueError):
      continue
  return count


def _make_cgroup(max_processes: int) -> str | None:
  path = os.path.join(_CGROUP_PARENT, f"run_{os.getpid()}_{next(_counter)}")
  try:
    os.makedirs(path)
    with open(os.path.join(path, "pids.max"), "w") as f:
      f.write(str(max_processes))
    return path
  except OSError:
    _remove_cgroup(path)
    return None


def _cgroup_pids(path: str) -> list[int]:
  try:
    with open(os.path.join(path, "cgroup.procs")) as f:
      return [int(line) for line in f if line.strip()]
  except OSError:
    return []


def _remove_cgroup(path: str, deadline_s: float = 5.0) -> None:
  """Kills everything still in the cgroup, waits for it to empty, removes it."""
  end = time.monotonic() + deadline_s
  while time.monotonic() < end:
    pids = _cgroup_pids(path)
    for pid in pids:
      _signal(lambda: os.kill(pid, signal.SIGKILL))
    try:
      os.rmdir(path)  # fails with EBUSY while a task, even a zombie, is still inside
      return
    except FileNotFoundError:
      return
    except OSError:
      time.sleep(0.01)


def _signal(send) -> bool:
  """Sends a signal; False when the target no longer exists."""
  try:
    send()
    return True
  except ProcessLookupError:
    return False
  except PermissionError:
    return True


def _kill_group(pgid: int, deadline_s: float = 2.0) -> None:
  end = time.monotonic() + deadline_s
  while _signal(lambda: os.killpg(pgid, signal.SIGKILL)) and time.monotonic() < end:
    time.sleep(0.01)


def _wait_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
  """Waits for exit without reaping; True when it exited in time.

  A pidfd wakes up the moment the child exits; Popen.wait(timeout) polls with sleeps of up
  to 50 ms, which is most of the cost of a short unit test.
  """
  try:
    fd = os.pidfd_open(proc.pid)
  except (AttributeError, OSError):
    try:
      proc.wait(timeout=timeout_s)
      return True
    except subprocess.TimeoutExpired:
      return False
  try:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))
  finally:
    os.close(fd)


def _limits(memory_mb: int, cpu_s: int, file_size_mb: int, nproc: int | None):
  mb = 1024 * 1024
  limits = [(resource.RLIMIT_AS, memory_mb * mb), (resource.RLIMIT_CPU, cpu_s),
            (resource.RLIMIT_FSIZE, file_size_mb * mb), (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_NOFILE, 256)]
  if nproc is not None:
    limits.append((resource.RLIMIT_NPROC, nproc))
  return limits


def _tail(path: str) -> str:
  try:
    with open(path, "rb") as f:
      f.seek(max(0, os.path.getsize(path) - _TAIL_BYTES))
      return f.read().decode("utf-8", errors="replace")
  except OSError:
    return ""


def run_program(source: str, timeout_s: float = 5.0, memory_mb: int = 512,
                max_processes: int = 64, cpu_s: float | None = None, file_size_mb: int = 16,
                guard: bool = True, tmp_root: str | None = None) -> ExecResult:
  """Runs `source` as a Python script in a fresh contained subprocess.

  timeout_s: wall clock; the whole process group is killed when it runs out.
  memory_mb: RLIMIT_AS of every process. cpu_s: RLIMIT_CPU (default ceil(timeout_s) + 1).
  max_processes: pids cgroup cap on processes plus threads (and RLIMIT_NPROC above this
    user's current task count when not root). file_size_mb: RLIMIT_FSIZE, stdout included.
  guard: inject `sandbox_guard` (False only to test the kernel-side layers).
  tmp_root: where the temporary directory goes (default: the system temp dir).
  Returns an ExecResult; never raises for anything the program does.
  """
  iso = isolation()
  cpu_limit = math.ceil(cpu_s if cpu_s is not None else timeout_s + 1)
  nproc = None if os.geteuid() == 0 else _user_task_count() + max_processes
  limits = _limits(memory_mb, max(1, cpu_limit), file_size_mb, nproc)
  root = tempfile.mkdtemp(prefix="djx_sandbox_", dir=tmp_root)
  cgroup = _make_cgroup(max_processes) if iso.pids_cgroup else None
  procs_fd = None
  if cgroup is not None:
    try:  # opened here: the child only writes to it between fork and exec
      procs_fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY)
    except OSError:
      _remove_cgroup(cgroup)
      cgroup = None
  proc = None
  try:
    workdir = os.path.join(root, "work")
    os.mkdir(workdir)
    program, runner = os.path.join(root, "program.py"), os.path.join(root, "runner.py")
    done = os.path.join(root, "done")
    with open(program, "w") as f:
      f.write(source)
    shutil.copyfile(_GUARD_SOURCE, runner)

    def preexec():  # runs in the child between fork and exec: keep it to system calls
      if procs_fd is not None:
        try:
          os.write(procs_fd, b"0")  # "0" moves the writing process into the cgroup
        except OSError:
          pass
      for kind, value in limits:
        resource.setrlimit(kind, (value, value))

    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir,
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = list(iso.unshare_argv) + [sys.executable, "-I", "-S", "-B", runner, program,
                                     workdir, done, "1" if guard else "0", _site_dirs()]
    out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
      proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                              stdout=out, stderr=err, start_new_session=True,
                              preexec_fn=preexec)
    timed_out = not _wait_exit(proc, timeout_s)
    # Signal the group while its leader is unreaped, so its id cannot have been reused.
    _signal(lambda: os.killpg(proc.pid, signal.SIGKILL))
    returncode = proc.wait()
    passed = returncode == 0 and not timed_out and os.path.exists(done)
    return ExecResult(passed=passed, returncode=returncode, timed_out=timed_out,
                      stdout_tail=_tail(out_path), stderr_tail=_tail(err_path))
  finally:
    if proc is not None:
      _kill_group(proc.pid)  # stragglers that outlived the program, in any outcome
      if proc.poll() is None:
        proc.wait()
    if procs_fd is not None:
      os.close(procs_fd)
    if cgroup is not None:
      _remove_cgroup(cgroup)
    shutil.rmtree(root, onerror=_force_remove)


def _force_remove(func, path, _):
  """A program may leave read-only directories behind; make them writable and retry."""
  try:
    os.chmod(os.path.dirname(path), 0o700)
    os.chmod(path, 0o700)
    func(path)
  except OSError:
    pass


def run_many(programs: Sequence[str], workers: int | None = None,
             **kwargs) -> list[ExecResult]:
  """run_program over `programs` on a thread pool, results in input order.

  workers: concurrent subprocesses (default: the CPU count). kwargs go to run_program.
  """
  workers = workers or os.cpu_count() or 1
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    return list(pool.map(lambda source: run_program(source, **kwargs), programs))
