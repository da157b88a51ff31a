"""What `stallwatch run` puts first on the command's PYTHONPATH: stallwatch starts before the command's imports.

Python imports `sitecustomize` once site-packages are on the path and before `__main__` runs, so the
command's own process does `import stallwatch.auto` (fork guard, then `setup()` from the environment)
before any of its modules. The launcher's PYTHONPATH entry is removed again first, so Python
processes the command starts (and stallwatch's own watchdog) do not load stallwatch a second time;
forked workers keep the parent's session through the fork guard. A `sitecustomize` further down the
path (the environment's own) still runs, after stallwatch.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_SAVED = "STALLWATCH_RUN_PYTHONPATH"  # the command's PYTHONPATH as the launcher found it ("" for unset)


def _restore_pythonpath() -> None:
    saved = os.environ.pop(_SAVED, None)
    if saved is None:
        return
    if not saved:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _HERE]


def _start_stallwatch() -> None:
    try:
        import stallwatch.auto  # noqa: F401  # optional: the command's interpreter may not have stallwatch
    except ImportError as error:
        print(
            f"stallwatch run: cannot import stallwatch in {sys.executable} ({error}); the command runs without it. "
            "Install stallwatch in that environment.",
            file=sys.stderr,
        )


def _chain_to_the_next_sitecustomize() -> None:
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_restore_pythonpath()
_start_stallwatch()
_chain_to_the_next_sitecustomize()
