"""Entry points run in process: `python -m MODULE ARGS` up to its main(), with its absl
flags parsed as app.run parses them (the CLI tests; a subprocess costs seconds each)."""

import contextlib
import copy
import importlib.util
import sys

import ml_collections
from absl import app, flags

_ENTRY_FLAGS = {}  # entry-point module -> the absl flags it defines, {name: Flag}


def _module_of_each_flag():
  return {id(flag): module for module, defined in flags.FLAGS.flags_by_module_dict().items()
          for flag in defined}


@contextlib.contextmanager
def entry_point(module_name, argv):
  """`python -m module_name *argv` up to its main(): yields (the module, the arguments
  app.run passes to main), its absl flags parsed from `argv` as app.run parses sys.argv.

  The entry points define their flags on absl's one FLAGS, where two of them collide
  (--target, --workdir, --config): within the block FLAGS holds this module's and no
  other package module's; after it, those come back, and this module's flags are unparsed
  (its inline config, e.g. --train's, gets its default values back)."""
  if importlib.util.find_spec(module_name).submodule_search_locations is not None:
    module_name += ".__main__"  # a package: what `python -m` runs
  registry = flags.FLAGS._flags()
  module_of = _module_of_each_flag()
  package = {name: flag for name, flag in registry.items()
             if module_of.get(id(flag), "").startswith("diversed_jax")}
  own = _ENTRY_FLAGS.get(module_name)
  if own is None and module_name in sys.modules:  # imported outside: its flags are FLAGS's
    own = {name: flag for name, flag in package.items()
           if module_of[id(flag)] == module_name}
  for name in package:
    del registry[name]
  saved_argv = sys.argv
  sys.argv = ["prog"]  # config flags read their overrides (--train.lam=...) from sys.argv
  inline = {}
  try:
    if own is None:
      importlib.import_module(module_name)
      module_of = _module_of_each_flag()
      own = {name: flag for name, flag in registry.items()
             if module_of.get(id(flag)) == module_name}
      _ENTRY_FLAGS[module_name] = own
    registry.update(own)
    module = sys.modules[module_name]
    sys.argv = [module_name, *argv]
    for name, flag in own.items():
      if isinstance(flag.default, ml_collections.ConfigDict):  # an inline config
        inline[flag] = copy.deepcopy(flag.default)
        # Parsed again, its default defines flags for the overrides in sys.argv.
        flags.FLAGS.set_default(name, flag.default)
    rest = flags.FLAGS(sys.argv)
    yield module, rest
  finally:
    sys.argv = saved_argv
    flags.FLAGS.unparse_flags()
    for flag, values in inline.items():
      flag.default.update(values)
    for name in list(registry):  # its flags and their --config.x overrides
      if name in own or name.partition(".")[0] in own:
        del registry[name]
    registry.update(package)


def usage_error(module_name, argv, monkeypatch, capsys):
  """The usage error that `python -m module_name *argv` ends with (a bad flag value, or
  main()'s app.UsageError), in process; it must come before any model loads."""
  from diversed_jax.models import loading

  def no_loading(spec, *args, **kwargs):
    raise AssertionError(f"loaded a model ({spec}) before the usage error")
  monkeypatch.setattr(loading, "load_model", no_loading)
  try:
    with entry_point(module_name, argv) as (module, rest):
      module.main(rest)
  except (flags.Error, app.UsageError) as error:
    assert "loading target" not in capsys.readouterr().out
    return str(error)
  raise AssertionError(f"{module_name} {argv}: no usage error")
