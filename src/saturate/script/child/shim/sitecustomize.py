"""saturate's hook into every Python process of a command it runs (`saturate doctor -- CMD`).

Python imports `sitecustomize` at start-up from the first folder on sys.path that has one; saturate
puts this folder first on PYTHONPATH for the command. It does nothing until the process imports
torch, then installs saturate's hooks (saturate.script.child.hooks), so a launcher or a helper
process that never imports torch pays nothing. A sitecustomize the machine already had is run too.
When Transformers' `trainer` or `training_args` module, or Lightning's `trainer.trainer`, is imported,
the hooks are handed it once it has run, to wrap its `Trainer`/`TrainingArguments` (nothing of either
is imported eagerly).
"""

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_other_sitecustomize() -> None:
    path = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the machine's own sitecustomize failing is not ours to stop on
            print(f"saturate: the existing sitecustomize failed: {e}", file=sys.stderr)


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `torch` is imported, it wraps torch's loader to install the hooks after it.

    It stays first on sys.meta_path until torch has actually run: a library that only looks torch up
    (`datasets` calls `importlib.util.find_spec("torch")` at import time) gets a spec it throws away, and the
    import that follows is wrapped again. Each lookup is answered with a fresh spec from the finders after it."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != "torch":
            return None
        spec = _spec_from_others(self, name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            with contextlib.suppress(ValueError):  # torch runs once: nothing more to watch for
                sys.meta_path.remove(self)
            loader_exec(module)
            _install()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _spec_from_others(me, name, path, target):  # type: ignore[no-untyped-def]
    """The spec the finders after `me` on sys.meta_path give `name` (None: not found)."""
    for finder in list(sys.meta_path):
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


class _AfterTransformers(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when one of `WATCHED` is imported, hands it to the hooks once it has run."""

    WATCHED = ("transformers.trainer", "transformers.training_args", "lightning.pytorch.trainer.trainer",
               "pytorch_lightning.trainer.trainer")

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name not in self.WATCHED:
            return None
        spec = _spec_from_others(self, name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            loader_exec(module)
            _install()
            try:
                from saturate.script.child import hooks
            except Exception:  # already said by _install
                return
            hooks.imported(name, module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _tell_parent(line: str) -> None:
    """One line the parent prints as the error (`script/boundary.py`: ERRORS, `error-*.txt`)."""
    folder = os.environ.get("SATURATE_SCRIPT_DIR")
    if folder:
        with open(os.path.join(folder, f"error-{os.getpid()}.txt"), "w") as f:
            f.write(line)


def _install() -> None:
    try:
        from saturate.script.child import hooks
    except Exception as e:  # saturate or its dependencies missing in this Python: say so to the parent
        _tell_parent(f"saturate could not be imported in the script's Python ({sys.executable}): "
                     f"{type(e).__name__}: {e}")
        return
    try:
        hooks.install()
    except Exception as e:  # settings this saturate cannot read (another version's parent): stop, say why
        _tell_parent(f"saturate's hooks could not start in the script's Python ({sys.executable}): "
                     f"{type(e).__name__}: {e}")
        raise


_chain_other_sitecustomize()
if os.environ.get("SATURATE_SCRIPT_DIR"):
    if "torch" in sys.modules:
        _install()
    else:
        sys.meta_path.insert(0, _AfterTorch())
    sys.meta_path.insert(0, _AfterTransformers())
