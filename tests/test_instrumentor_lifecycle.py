"""Every instrumentor can be instrumented and uninstrumented any number of times: a library imported
afterwards carries exactly one layer of its wrappers, and uninstrument() leaves none. Importing the
instrumentation registers no after-fork handler. Each case is a fresh interpreter, so the library is
imported for the first time after the cycles, as in a host that imports it late."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import clean_env, run_python

pytestmark = pytest.mark.matrix

# instrumentor, its module, the library it needs, the import that comes late, the (owner, attribute)
# pairs its wrappers sit on, and the module whose functions those wrappers are.
CASES = {
    "subprocess": (
        "stallwatch.instrument.subprocess:SubprocessInstrumentor",
        "uvloop",
        "import uvloop",
        [
            ("uvloop.Loop", "subprocess_exec"),
            ("uvloop.Loop", "subprocess_shell"),
            ("subprocess.Popen", "__init__"),
            ("asyncio.subprocess.Process", "wait"),
        ],
        "stallwatch.instrument.subprocess",
    ),
    "nebius": (
        "stallwatch.instrument.nebius:NebiusInstrumentor",
        "nebius",
        "import nebius.aio.request",
        [("nebius.aio.request.Request", "_send"), ("nebius.aio.request.Request", "_request_with_authorization_loop")],
        "stallwatch.instrument.nebius",
    ),
    "paramiko": (
        "stallwatch.instrument.paramiko:ParamikoInstrumentor",
        "paramiko",
        "import paramiko",
        [("paramiko.SSHClient", "connect"), ("paramiko.Channel", "exec_command")],
        "stallwatch.instrument.paramiko",
    ),
    "ssh": (
        "stallwatch.instrument.ssh:SSHTunnelInstrumentor",
        "dstack",
        "import dstack._internal.core.services.ssh.tunnel",
        [
            ("dstack._internal.core.services.ssh.tunnel.SSHTunnel", "open"),
            ("dstack._internal.core.services.ssh.tunnel.SSHTunnel", "aclose"),
        ],
        "stallwatch.instrument.tunnels",
    ),
    "executor": (
        "stallwatch.instrument.executor:ExecutorInstrumentor",
        "concurrent",
        "import concurrent.futures",
        [("concurrent.futures.ThreadPoolExecutor", "__init__"), ("concurrent.futures.thread", "_worker")],
        "stallwatch.instrument.pools",
    ),
}

CYCLES = """
import importlib, json
import stallwatch
from support.layers import wrapper_layers_at

module_name, class_name = {instrumentor!r}.split(":")
instrumentor = getattr(importlib.import_module(module_name), class_name)()
settings = stallwatch.Settings.load()
for _ in range(3):
    instrumentor.instrument(settings=settings, skip_dep_check=True)
    instrumentor.uninstrument()
instrumentor.instrument(settings=settings, skip_dep_check=True)
{late_import}
on = wrapper_layers_at({targets!r}, {wrapper_module!r})
instrumentor.uninstrument()
off = wrapper_layers_at({targets!r}, {wrapper_module!r})
print(json.dumps({{"on": on, "off": off}}))
"""


@pytest.mark.parametrize("name", sorted(CASES))
def test_three_instrument_uninstrument_cycles_then_a_late_import_leave_one_wrapper_layer_and_uninstrument_none(name):
    layers = run_case(CYCLES, name)

    targets = len(CASES[name][3])
    assert layers == {"on": [1] * targets, "off": [0] * targets}, (name, layers)


_RETURNCODE_CYCLES = """
import asyncio.subprocess, json
import stallwatch
from stallwatch.instrument.subprocess import SubprocessInstrumentor

stock = asyncio.subprocess.Process.__dict__["returncode"]
instrumentor = SubprocessInstrumentor()
settings = stallwatch.Settings.load()
for _ in range(3):
    instrumentor.instrument(settings=settings, skip_dep_check=True)
    instrumentor.uninstrument()
instrumentor.instrument(settings=settings, skip_dep_check=True)
on = asyncio.subprocess.Process.__dict__["returncode"]
instrumentor.uninstrument()
print(json.dumps({"on": on.fget.__module__, "on_is_stock": on is stock,
                  "off_is_stock": asyncio.subprocess.Process.__dict__["returncode"] is stock}))
"""


def test_the_subprocess_instrumentor_replaces_the_returncode_property_of_asyncio_processes_once_and_restores_it():
    proc = run_python(_RETURNCODE_CYCLES)

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "on": "stallwatch.instrument.subprocess.loops", "on_is_stock": False, "off_is_stock": True}  # fmt: skip


def run_case(script: str, name: str, env: dict[str, str] | None = None) -> dict:
    """`script` filled in with the case `name`, run in a fresh interpreter: the JSON of its last line
    (skips without the case's library)."""
    instrumentor, library, late_import, targets, wrapper_module = CASES[name]
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"needs {library} (the test extras)")
    code = script.format(
        instrumentor=instrumentor, late_import=late_import, targets=targets, wrapper_module=wrapper_module
    )
    proc = run_python(code, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_the_instrumentation_registers_no_after_fork_handler():
    proc = run_python(
        """
        import json, os
        registered = []
        original = os.register_at_fork

        def recording(**handlers):
            registered.extend(getattr(fn, "__wrapped__", fn).__module__ for fn in handlers.values())
            return original(**handlers)

        os.register_at_fork = recording  # before stallwatch's guard captures it
        import stallwatch
        before = list(registered)
        import stallwatch.instrument.child_fate, stallwatch.instrument.executor, stallwatch.instrument.nebius
        import stallwatch.instrument.paramiko, stallwatch.instrument.ssh, stallwatch.instrument.subprocess
        print(json.dumps([module for module in registered[len(before):] if module.startswith("stallwatch.")]))
        """
    )

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_after_fork_handlers_are_registered_once_however_often_the_instrumentors_run():
    proc = run_python(
        """
        import json, os
        registered = []
        original = os.register_at_fork

        def recording(**handlers):
            registered.extend(getattr(fn, "__wrapped__", fn).__qualname__ for fn in handlers.values())
            return original(**handlers)

        os.register_at_fork = recording  # stallwatch's guard wraps it: `__wrapped__` is the handler given
        import stallwatch
        from stallwatch.instrument.nebius import NebiusInstrumentor
        from stallwatch.instrument.subprocess import SubprocessInstrumentor
        before = len(registered)
        for _ in range(3):
            for instrumentor in (SubprocessInstrumentor(), NebiusInstrumentor()):
                instrumentor.instrument(skip_dep_check=True)
                instrumentor.uninstrument()
        print(json.dumps(sorted(name for name in registered[before:] if name.startswith("_forget"))))
        """
    )

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [
        "_forget_the_parents_calls",
        "_forget_the_parents_children",
        "_forget_the_parents_children",
    ]  # nebius's calls; subprocess's children and child_fate's signalled pids


def test_paramikos_channel_request_handler_is_wrapped_once_per_instrument_and_restored_by_uninstrument():
    pytest.importorskip("paramiko")
    proc = run_python(
        """
        import json
        import paramiko
        import stallwatch
        from stallwatch.instrument.paramiko import ParamikoInstrumentor

        table, key = paramiko.Transport._channel_handler_table, paramiko.common.MSG_CHANNEL_REQUEST
        original = table[key]
        instrumentor = ParamikoInstrumentor()
        depths = []
        for _ in range(3):
            instrumentor.instrument(settings=stallwatch.Settings.load())
            handler, depth = table[key], 0
            while handler is not original and hasattr(handler, "__wrapped__"):
                handler, depth = handler.__wrapped__, depth + 1
            depths.append(depth)
            instrumentor.uninstrument()
        print(json.dumps({"depths": depths, "restored": table[key] is original}))
        """
    )

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"depths": [1, 1, 1], "restored": True}


BAD_SETTING = """
import importlib, json, logging
from support.layers import wrapper_layers_at

errors = []
handler = logging.Handler()
handler.emit = lambda record: errors.append(record.getMessage())
logging.getLogger("stallwatch").addHandler(handler)
module_name, class_name = {instrumentor!r}.split(":")
instrumentor = getattr(importlib.import_module(module_name), class_name)()
instrumentor.instrument(skip_dep_check=True)
{late_import}
layers = wrapper_layers_at({targets!r}, {wrapper_module!r})
print(json.dumps({{"errors": errors, "layers": layers}}))
"""


@pytest.mark.parametrize("name", ["executor", "paramiko", "subprocess"])
def test_an_instrumentor_reading_an_invalid_setting_says_it_stays_off_and_wraps_nothing(name):
    result = run_case(BAD_SETTING, name, env=clean_env(STALLWATCH_STRICT="true", STALLWATCH_RECORD_ARGS="perhaps"))

    (error,) = result["errors"]
    assert "STALLWATCH_RECORD_ARGS" in error and error.endswith(f"; {name} instrumentation stays off."), error
    assert result["layers"] == [0] * len(CASES[name][3])


@pytest.mark.parametrize("fast_paths", ["true", "false"])
def test_setup_installs_without_loading_base_instrumentor_and_each_instrumentor_then_says_so_and_can_undo_it(
    fast_paths,
):
    """`setup()` installs the subprocess, executor and tunnel instrumentations without loading
    `BaseInstrumentor` (its module loads `packaging`), or with the fast paths off through it; either
    way their instrumentors report them as instrumented, and their `uninstrument()` takes off what
    `setup()` put on, once."""
    spawning = CASES["subprocess"][3][2:]  # the targets that exist without uvloop
    targets = [*spawning, *CASES["executor"][3]]
    n = len(spawning)
    proc = run_python(
        f"""
        import json, sys, stallwatch
        from support.layers import wrapper_layers_at
        stallwatch.setup(watchdog=False)
        base_loaded = "opentelemetry.instrumentation.instrumentor" in sys.modules
        from stallwatch.instrument.executor import ExecutorInstrumentor
        from stallwatch.instrument.ssh import SSHTunnelInstrumentor
        from stallwatch.instrument.subprocess import SubprocessInstrumentor
        instrumentors = [SubprocessInstrumentor(), ExecutorInstrumentor(), SSHTunnelInstrumentor()]
        said = [instrumentor.is_instrumented_by_opentelemetry for instrumentor in instrumentors]
        on = wrapper_layers_at({targets[:n]!r}, "stallwatch.instrument.subprocess") + wrapper_layers_at(
            {targets[n:]!r}, "stallwatch.instrument.pools")
        for instrumentor in instrumentors:
            instrumentor.instrument(skip_dep_check=True)  # already on: no second layer
        twice = wrapper_layers_at({targets[:n]!r}, "stallwatch.instrument.subprocess") + wrapper_layers_at(
            {targets[n:]!r}, "stallwatch.instrument.pools")
        for instrumentor in instrumentors:
            instrumentor.uninstrument()
        off = wrapper_layers_at({targets[:n]!r}, "stallwatch.instrument.subprocess") + wrapper_layers_at(
            {targets[n:]!r}, "stallwatch.instrument.pools")
        print(json.dumps({{"base_loaded": base_loaded, "said": said, "on": on, "twice": twice, "off": off,
                          "after": [i.is_instrumented_by_opentelemetry for i in instrumentors]}}))
        stallwatch.shutdown(timeout=0.5)
        """,
        env=clean_env(
            OTEL_TRACES_EXPORTER="none",
            OTEL_METRICS_EXPORTER="none",
            OTEL_LOGS_EXPORTER="none",
            STALLWATCH_FAST_PATHS=fast_paths,
        ),
    )

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "base_loaded": fast_paths == "false",
        "said": [True, True, True],
        "on": [1] * len(targets),
        "twice": [1] * len(targets),
        "off": [0] * len(targets),
        "after": [False, False, False],
    }
