"""In-process guard and runner for sandboxed programs (the file `sandbox.py` starts).

`sandbox.py` copies this file next to each program and runs it as
`python -I -S -B runner.py PROGRAM WORKDIR DONE_FILE GUARD SITE_DIRS`. It must stay
stdlib-only and self-contained: the isolated interpreter does not import diversed_jax.

The guard stops the accidents a model completion can cause (os.system, a fork loop, writing
to /etc, deleting a file, opening a socket, killing its parent). It is NOT a security
boundary: a program that wants out can reach the untouched originals (`_io.FileIO`,
re-importing `posix` after deleting it from sys.modules, ...). The kernel-side layers in
`sandbox.py` (namespaces, rlimits, pids cgroup, process-group kill) are what contain a program
that bypasses it.
"""

import builtins
import io
import os
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# Anything that starts, replaces or signals a process, or changes identity or session: a
# completion never needs these, and exec would replace the guarded interpreter.
_PROCESS_CALLS = (
    "fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp",
    "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
    "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
    "kill", "killpg", "pidfd_open", "setsid", "setpgid", "setpgrp", "setuid", "seteuid",
    "setgid", "setegid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
    "chroot", "fchmod", "fchown", "unshare", "setns")

# Calls that change the file system, with (argument name, dir_fd keyword) per path argument
# and whether the call acts on the directory entry itself (unlink a symlink) or follows it.
_PATH_CALLS = {
    "remove": ((("path", "dir_fd"),), True),
    "unlink": ((("path", "dir_fd"),), True),
    "rmdir": ((("path", "dir_fd"),), True),
    "removedirs": ((("name", None),), True),
    "mkdir": ((("path", "dir_fd"),), True),
    "mkfifo": ((("path", "dir_fd"),), True),
    "mknod": ((("path", "dir_fd"),), True),
    "rename": ((("src", "src_dir_fd"), ("dst", "dst_dir_fd")), True),
    "renames": ((("old", None), ("new", None)), True),
    "replace": ((("src", "src_dir_fd"), ("dst", "dst_dir_fd")), True),
    "link": ((("src", "src_dir_fd"), ("dst", "dst_dir_fd")), True),
    "symlink": ((("dst", "dir_fd"),), True),
    "lchown": ((("path", None),), True),
    "lchmod": ((("path", None),), True),
    "chmod": ((("path", "dir_fd"),), False),
    "chown": ((("path", "dir_fd"),), False),
    "truncate": ((("path", None),), False),
    "utime": ((("path", "dir_fd"),), False),
    "setxattr": ((("path", None),), False),
    "removexattr": ((("path", None),), False),
}
# symlink(src, dst): the checked path is argument 1, not 0.
_ARG_INDEX = {("symlink", "dst"): 1}


def _deny(name):
  def denied(*args, **kwargs):
    raise PermissionError(f"sandbox: {name} is disabled")
  denied.__name__ = name
  return denied


def install(allowed_dir):
  """Restricts writes to `allowed_dir` and disables processes, signals, sockets, ctypes."""
  allowed = os.path.realpath(allowed_dir)
  real_os_open = os.open
  real_io_open = io.open

  def resolve(path, dir_fd, entry):
    path = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(path):
      path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
    if entry:  # the entry itself: resolve its parent only, so a symlink is not followed
      parent, name = os.path.split(os.path.abspath(path))
      return os.path.normpath(os.path.join(os.path.realpath(parent), name))
    return os.path.realpath(path)

  def inside(path, dir_fd=None, entry=False):
    if isinstance(path, int):
      return True  # an open descriptor: the call that opened it was checked
    try:
      resolved = resolve(path, dir_fd, entry)
    except (OSError, TypeError, ValueError):
      return False
    return resolved == allowed or resolved.startswith(allowed + os.sep)

  def refuse(path):
    raise PermissionError(f"sandbox: writing {path!r} outside the working directory")

  def guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not inside(file):
      refuse(file)
    return real_io_open(file, mode, *args, **kwargs)

  def guarded_os_open(path, flags, mode=0o777, *, dir_fd=None):
    if flags & _WRITE_FLAGS and not inside(path, dir_fd):
      refuse(path)
    return real_os_open(path, flags, mode, dir_fd=dir_fd)

  def path_guard(name, specs, entry):
    real = getattr(os, name)

    def guarded(*args, **kwargs):
      for position, (arg, fd_kw) in enumerate(specs):
        position = _ARG_INDEX.get((name, arg), position)
        path = args[position] if position < len(args) else kwargs.get(arg)
        if path is not None and not inside(path, kwargs.get(fd_kw) if fd_kw else None, entry):
          refuse(path)
      return real(*args, **kwargs)
    guarded.__name__ = name
    return guarded

  import _io
  import posix
  builtins.open = io.open = _io.open = guarded_open
  posix.open = os.open = guarded_os_open
  for name, (specs, entry) in _PATH_CALLS.items():
    if hasattr(os, name):
      guarded = path_guard(name, specs, entry)
      setattr(os, name, guarded)
      if hasattr(posix, name):
        setattr(posix, name, guarded)
  for module in (os, posix):
    for name in _PROCESS_CALLS:
      if hasattr(module, name):
        setattr(module, name, _deny(f"os.{name}"))

  import _posixsubprocess
  _posixsubprocess.fork_exec = _deny("subprocess")
  import resource
  resource.setrlimit = _deny("resource.setrlimit")
  resource.prlimit = _deny("resource.prlimit")
  import _socket

  class DeniedSocket(_socket.socket):
    # socket.py subclasses _socket.socket when first imported, so patching the C type here
    # covers socket.socket, create_connection and friends without importing socket.py.
    __slots__ = ()  # socket.py adds __weakref__ itself

    def __init__(self, *args, **kwargs):
      raise PermissionError("sandbox: sockets are disabled")
  _socket.socket = _socket.SocketType = DeniedSocket
  _socket.socketpair = _deny("socket.socketpair")
  if "socket" in sys.modules:
    sys.modules["socket"].socket = DeniedSocket
  # None in sys.modules makes `import ctypes` raise ImportError.
  sys.modules["ctypes"] = None
  sys.modules["_ctypes"] = None


def _exit(code=None):
  raise SystemExit(code)


def main(argv):
  program, workdir, done_file, guard, site_dirs = argv[1:6]
  # The interpreter runs with -S: executing site-packages' .pth files (editable installs,
  # certifi hooks) costs ~100 ms per program. Plain site-packages stay importable.
  sys.path.extend(d for d in site_dirs.split(os.pathsep) if d and d not in sys.path)
  import types
  real_open = io.open
  with io.open_code(program) as f:
    code = compile(f.read(), program, "exec")
  # The program runs as __main__ in a fresh module (what runpy.run_path does, without the
  # ~10 ms of imports runpy pulls in).
  module = types.ModuleType("__main__")
  module.__file__ = program
  module.__builtins__ = builtins
  sys.modules["__main__"] = module
  builtins.exit = builtins.quit = _exit  # site is skipped (-S), and it defines these
  sys.argv = [program]
  if guard == "1":
    install(workdir)
  exec(code, module.__dict__)
  # Reached only when the program ran to its end: sys.exit(0) or os._exit(0) in the middle
  # of a test file must not count as passing.
  with real_open(done_file, "w") as f:
    f.write("done")


if __name__ == "__main__":
  main(sys.argv)
