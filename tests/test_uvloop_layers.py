"""uvloop's spawn methods carry stallwatch's layers in one stated order (`forksafe.uvloop_layers`):
recording outermost, then the fork guard, then the vfork route, whatever order the parts were
installed in and whenever uvloop was imported; taking one part off leaves the others working.
Each case is a fresh interpreter with real uvloop spawns."""

from __future__ import annotations

import json

import pytest

from conftest import clean_env, run_python

pytestmark = pytest.mark.matrix
pytest.importorskip("uvloop")

RECORD = "stallwatch.instrument.subprocess.loops"
GUARD = "stallwatch.forksafe.guard"
ROUTE = "stallwatch.forksafe.uvloop_spawn"
STATED_ORDER = [RECORD, GUARD, ROUTE]

# The route is installed by `import stallwatch`; with STALLWATCH_FORK_GUARD=false the guard is not,
# so the script installs the guard and the recording itself, in the order given.
INSTALL_ORDER = """
import json
{uvloop_first}
import stallwatch
from stallwatch.forksafe import guard
from stallwatch.instrument.subprocess import SubprocessInstrumentor
from support.layers import spawn_layer_modules
{uvloop_between}
parts = {{"guard": guard.install, "record": lambda: SubprocessInstrumentor().instrument(skip_dep_check=True)}}
for part in {parts!r}:
    parts[part]()
import uvloop
methods = ("subprocess_exec", "subprocess_shell")
composed = [spawn_layer_modules(uvloop.Loop, name) for name in methods]
SubprocessInstrumentor().uninstrument()
print(json.dumps([composed, [spawn_layer_modules(uvloop.Loop, name) for name in methods]]))
"""


@pytest.mark.parametrize("uvloop_imported", ["before stallwatch", "before the parts", "after the parts"])
@pytest.mark.parametrize("parts", [("guard", "record"), ("record", "guard")], ids="-then-".join)
def test_uvloops_spawn_layers_are_in_the_stated_order_whatever_order_the_parts_came_in_and_uninstrument_takes_its_own(
    parts, uvloop_imported
):
    code = INSTALL_ORDER.format(
        parts=parts,
        uvloop_first="import uvloop" if uvloop_imported == "before stallwatch" else "",
        uvloop_between="import uvloop" if uvloop_imported == "before the parts" else "",
    )
    proc = run_python(code, env=clean_env(STALLWATCH_FORK_GUARD="false"))

    assert proc.returncode == 0, proc.stderr
    composed, uninstrumented = json.loads(proc.stdout.strip().splitlines()[-1])
    assert composed == [STATED_ORDER, STATED_ORDER]
    assert uninstrumented == [[GUARD, ROUTE], [GUARD, ROUTE]]


@pytest.mark.parametrize("uvloop_imported", ["before stallwatch", "after setup"])
def test_a_host_that_calls_setup_gets_the_stated_order_whenever_it_imports_uvloop(uvloop_imported, tmp_path):
    first, late = ("import uvloop", "") if uvloop_imported == "before stallwatch" else ("", "import uvloop")
    proc = run_python(
        f"""
        import json
        {first}
        import stallwatch
        from support.layers import spawn_layer_modules
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)
        {late}
        import uvloop
        print(json.dumps([spawn_layer_modules(uvloop.Loop, name) for name in ("subprocess_exec", "subprocess_shell")]))
        """
    )

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [STATED_ORDER, STATED_ORDER]


# One routed or native spawn under uvloop, and what each layer did to it: a span recorded (and the
# method it reports), the fork guard's exec-bound mark seen when the protocol is made (inside every
# layer), the exec-bound forks the guard counted, and whether the child came through Popen's vfork.
TAKE_ONE_OFF = """
import asyncio, json, sys
import uvloop
import stallwatch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from stallwatch.forksafe import guard, uvloop_layers, uvloop_spawn
from stallwatch.instrument.subprocess import SubprocessInstrumentor

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
recording = SubprocessInstrumentor()
recording.instrument(tracer_provider=provider, skip_dep_check=True)


class Probe(asyncio.SubprocessProtocol):
    def __init__(self):
        self.exec_bound = guard._exec_bound.get()  # the guard's mark, as a fork inside this call sees it
        self.exited = asyncio.get_running_loop().create_future()

    def process_exited(self):
        self.exited.set_result(None)


async def spawn():
    loop = asyncio.get_running_loop()
    transport, probe = await loop.subprocess_exec(Probe, "true", stdin=None, stdout=None, stderr=None)
    await asyncio.wait_for(probe.exited, 30)
    routed = isinstance(transport, uvloop_spawn._PidfdSubprocessTransport)
    transport.close()
    return probe.exec_bound, routed


def exec_bound_forks():
    return sum(count for (kind, _, _), count in guard.fork_counts() if kind == "exec_bound")


def observe():
    exporter.clear()
    forks = exec_bound_forks()
    exec_bound, routed = uvloop.run(spawn())
    methods = [span.attributes.get("stallwatch.spawn.method") for span in exporter.get_finished_spans()]
    return {{"methods": methods, "exec_bound": exec_bound, "forks": exec_bound_forks() - forks, "routed": routed}}


print(json.dumps({{"off": {off!r}, "all": observe(), "without": ({take_off}, observe())[1]}}))
"""

TAKE_OFF = {
    "record": "recording.uninstrument()",
    "guard": "uvloop_layers.remove('guard')",
    "route": "uvloop_layers.remove('route')",
}
WITH_EVERY_LAYER = {"methods": ["vfork"], "exec_bound": True, "forks": 0, "routed": True}
WITHOUT = {
    "record": {"methods": [], "exec_bound": True, "forks": 0, "routed": True},
    "guard": {"methods": ["vfork"], "exec_bound": False, "forks": 0, "routed": True},
    "route": {"methods": ["fork"], "exec_bound": True, "forks": 1, "routed": False},
}


@pytest.mark.parametrize("off", sorted(TAKE_OFF))
def test_taking_one_layer_off_uvloops_spawn_leaves_the_others_working(off):
    proc = run_python(TAKE_ONE_OFF.format(off=off, take_off=TAKE_OFF[off]))

    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {"off": off, "all": WITH_EVERY_LAYER, "without": WITHOUT[off]}
