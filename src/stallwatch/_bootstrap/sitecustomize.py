"""What `stallwatch run` puts first on the command's PYTHONPATH: stallwatch starts before the command's imports.

Python imports `sitecustomize` once site-packages are on the path and before `__main__` runs, so the
command's own process does `import stallwatch.auto` (fork guard, then `setup()` from the environment)
before any of its modules. The launcher's PYTHONPATH entry is removed again first, so Python
processes the command starts (and stallwatch's own watchdog) do not load stallwatch a second time;
forked workers keep the parent's session through the fork guard. The interpreters multiprocessing
starts afresh run the command's own code (`uvicorn --workers`, a process pool of the spawn or
forkserver context), so their command line imports `stallwatch.auto` before it (`_in_fresh_workers`);
its resource tracker is left alone. A `sitecustomize` further down the path (the environment's own)
still runs, after stallwatch.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

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


def _start_stallwatch() -> bool:
    try:
        import stallwatch.auto  # noqa: F401  # optional: the command's interpreter may not have stallwatch
    except ImportError as error:
        print(
            f"stallwatch run: cannot import stallwatch in {sys.executable} ({error}); the command runs without it. "
            "Install stallwatch in that environment.",
            file=sys.stderr,
        )
        return False
    return True


# The `-c` programs of multiprocessing's fresh interpreters that run the command's code (CPython 3.10-3.13).
_WORKER_PROGRAMS = ("from multiprocessing.spawn import", "from multiprocessing.forkserver import")


def _in_fresh_workers() -> None:
    """Make `multiprocessing.util.spawnv_passfds`, which starts every fresh interpreter of the spawn
    and forkserver contexts, begin a worker's `-c` program with `import stallwatch.auto`."""
    import wrapt

    def stallwatch_first(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        command = args[1] if len(args) == 3 else None
        if isinstance(command, list) and "-c" in command[:-1]:
            program = command.index("-c") + 1
            if isinstance(command[program], str) and command[program].startswith(_WORKER_PROGRAMS):
                command = [*command[:program], "import stallwatch.auto; " + command[program], *command[program + 1 :]]
                args = (args[0], command, args[2])
        return wrapped(*args, **kwargs)

    def wrap(module: Any) -> None:
        try:
            wrapt.wrap_function_wrapper(module, "spawnv_passfds", stallwatch_first)
        except Exception as error:  # a Python that renamed it: the command's import of multiprocessing goes on
            print(f"stallwatch run: fresh multiprocessing workers run without stallwatch ({error})", file=sys.stderr)

    wrapt.register_post_import_hook(wrap, "multiprocessing.util")


def _chain_to_the_next_sitecustomize() -> None:
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_restore_pythonpath()
if _start_stallwatch():
    _in_fresh_workers()
_chain_to_the_next_sitecustomize()
