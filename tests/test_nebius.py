"""Nebius API instrumentation: the real SDK against the fake Nebius gRPC server, in fresh interpreters."""

from __future__ import annotations

import pytest

from conftest import attrs, latest_total, metric_points, otlp_items, run_python, run_scenario

ERROR = (2, "STATUS_CODE_ERROR")
INSTANCES = "nebius.compute.v1.InstanceService"


def nebius_spans(path):
    return [s for s in otlp_items(path, "spans") if s["name"].startswith("nebius.")]


def log_records(path):
    return [
        (record["body"]["stringValue"], record.get("traceId", ""), attrs(record)) for record in otlp_items(path, "logs")
    ]


@pytest.mark.parametrize("order", ["before", "after"])
def test_one_span_per_logical_call_with_status_attempts_and_ids(order, tmp_path):
    on = run_scenario("nebius_calls.py", str(tmp_path / "on"), order, "on", timeout=180)
    off = run_scenario("nebius_calls.py", str(tmp_path / "off"), order, "off", timeout=180)
    # The SDK returns and raises the same things with and without the instrumentation.
    assert {k: v for k, v in on.items() if k != "ids"} == {k: v for k, v in off.items() if k != "ids"}
    assert on["missing"] == ["raised", "RequestError", "NOT_FOUND"]
    assert not nebius_spans(tmp_path / "off" / "traces.jsonl")

    path = tmp_path / "on" / "traces.jsonl"
    spans = nebius_spans(path)
    parents = {s["spanId"]: s["name"] for s in otlp_items(path, "spans")}
    by_parent = {}
    for span in spans:
        by_parent.setdefault(parents.get(span.get("parentSpanId")), []).append(span)
    # Exactly one span per logical call, under the caller's span across the SDK's loop thread.
    assert {parent: sorted(s["name"] for s in group) for parent, group in by_parent.items()} == {
        "provision": ["nebius.common.v1.OperationService/Get", f"{INSTANCES}/Create"],
        "retried": [f"{INSTANCES}/Get"],
        "missing": [f"{INSTANCES}/Get"],
        "deadline": [f"{INSTANCES}/Get"],
        "cancelled": [f"{INSTANCES}/Get"],
        "disk": ["nebius.compute.v1.DiskService/Create"],
        "thread-0": [f"{INSTANCES}/Get"],
        "thread-1": [f"{INSTANCES}/Get"],
        "thread-2": [f"{INSTANCES}/Get"],
        "thread-3": [f"{INSTANCES}/Get"],
        "bridge": [f"{INSTANCES}/Delete"],
    }
    first = {parent: group[0] for parent, group in by_parent.items()}
    operation_id, resource_id = on["ids"]
    create = next(s for s in by_parent["provision"] if s["name"].endswith("/Create"))
    a = attrs(create)
    assert a["rpc.system"] == "grpc" and a["rpc.service"] == INSTANCES and a["rpc.method"] == "Create"
    assert a["rpc.grpc.status_code"] == "0" and a["stallwatch.nebius.attempts"] == "1"
    assert a["stallwatch.cloud.operation.id"] == operation_id and a["stallwatch.cloud.resource.id"] == resource_id
    assert a["stallwatch.nebius.request_id"].startswith("fakereq-") and len(a["stallwatch.nebius.trace_id"]) == 32
    assert create["kind"] in (3, "SPAN_KIND_CLIENT")
    retried = first["retried"]
    assert attrs(retried)["stallwatch.nebius.attempts"] == "2" and retried["status"].get("code") not in ERROR
    events = [attrs(e) for e in retried["events"]]
    assert [(e["attempt"], e["rpc.grpc.status_code"]) for e in events] == [("1", "14"), ("2", "0")]
    assert "backoff_seconds" in events[1]
    for parent, (error_type, code) in {
        "missing": ("NOT_FOUND", "5"), "deadline": ("timeout", "4"), "cancelled": ("cancelled", "1"),
    }.items():  # fmt: skip
        a = attrs(first[parent])
        assert (a["error.type"], a["rpc.grpc.status_code"]) == (error_type, code), parent
        assert first[parent]["status"].get("code") in ERROR
    delete = attrs(first["bridge"])
    assert delete["stallwatch.cloud.resource.id"] == resource_id and delete["rpc.grpc.status_code"] == "0"
    for span in spans:  # payloads are never recorded: no instance name, platform or preset
        assert not {"vm-1", "gpu-h200-sxm", "project-e00test"} & set(map(str, attrs(span).values()))
        duration = (int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])) / 1e9
        assert 0 < duration < 10

    metrics = tmp_path / "on" / "metrics.jsonl"
    created = "stallwatch.cloud.resources.created"
    assert latest_total(metrics, created, **{"stallwatch.cloud.resource.type": "compute.instance"}) == 1
    assert latest_total(metrics, created, **{"stallwatch.cloud.resource.type": "compute.disk"}) == 1
    assert latest_total(metrics, "stallwatch.cloud.resources.deleted") == 1
    assert latest_total(metrics, "stallwatch.nebius.calls.active") == 0
    codes = {
        attrs(p)["rpc.grpc.status_code"]
        for p in metric_points(metrics, "stallwatch.nebius.call.duration")
        if attrs(p)["rpc.method"] == "Get" and attrs(p)["rpc.service"] == INSTANCES
    }
    assert codes == {"0", "1", "4", "5"}

    # The ledger: intent before the call, outcome with every id, in the call's trace.
    records = [r for r in log_records(tmp_path / "on" / "logs.jsonl") if r[0].startswith("cloud resource")]
    assert [r[0] for r in records] == [
        "cloud resource create requested", "cloud resource created",
        "cloud resource create requested", "cloud resource created",
        "cloud resource delete requested", "cloud resource deleted",
    ]  # fmt: skip
    assert records[0][1] == records[1][1] == create["traceId"]
    assert records[1][2]["stallwatch.cloud.operation.id"] == operation_id
    assert records[1][2]["stallwatch.cloud.resource.id"] == resource_id
    assert records[4][2]["stallwatch.cloud.resource.id"] == resource_id  # known before the delete is sent


def test_a_failed_create_is_a_ledger_warning_with_the_status(tmp_path):
    proc = run_python(
        f"""
        import asyncio
        import stallwatch
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)
        import grpc
        from nebius.aio.service_error import RequestError
        from nebius.api.nebius.common.v1 import ResourceMetadata
        from nebius.api.nebius.compute.v1 import CreateInstanceRequest, InstanceServiceClient
        from support.fake_nebius import INSTANCE_SERVICE, FakeNebius, sdk_for

        async def main(fake):
            async with sdk_for(fake.address) as sdk:
                fake.fail_next(INSTANCE_SERVICE + "/Create", grpc.StatusCode.PERMISSION_DENIED)
                try:
                    await InstanceServiceClient(sdk).create(
                        CreateInstanceRequest(metadata=ResourceMetadata(name="x", parent_id="p")), timeout=5)
                except RequestError as error:
                    print(error.status.code.name)

        with FakeNebius() as fake:
            asyncio.run(main(fake))
        stallwatch.shutdown(10)
        """,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["PERMISSION_DENIED"]
    records = [r for r in log_records(tmp_path / "logs.jsonl") if r[0].startswith("cloud resource")]
    assert [r[0] for r in records] == ["cloud resource create requested", "cloud resource create failed"]
    assert records[1][2]["stallwatch.cloud.status"] == "PERMISSION_DENIED"
    (span,) = nebius_spans(tmp_path / "traces.jsonl")
    assert attrs(span)["error.type"] == "PERMISSION_DENIED" and records[1][1] == span["traceId"]
    assert latest_total(tmp_path / "metrics.jsonl", "stallwatch.cloud.resources.created") == 0


def test_an_sdk_whose_private_names_changed_is_left_untouched_with_one_warning(tmp_path):
    proc = run_python(
        f"""
        import asyncio
        import stallwatch
        from nebius.aio.request import Request

        # A future SDK where the wrapped coroutine method became a plain function returning a coroutine:
        # the SDK still works, but it is not the structure the instrumentation knows.
        original = Request._request_with_authorization_loop
        Request._request_with_authorization_loop = lambda self: original(self)
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)
        from nebius.api.nebius.compute.v1 import GetInstanceRequest, InstanceServiceClient
        from nebius.aio.service_error import RequestError
        from support.fake_nebius import FakeNebius, sdk_for

        async def main(fake):
            async with sdk_for(fake.address) as sdk:
                try:
                    await InstanceServiceClient(sdk).get(GetInstanceRequest(id="computeinstance-x"), timeout=5)
                except RequestError as error:
                    print(error.status.code.name)

        with FakeNebius() as fake:
            asyncio.run(main(fake))
        print(stallwatch.doctor(probe=False).nebius)
        stallwatch.shutdown(10)
        """,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "NOT_FOUND"
    assert lines[1].startswith("UNSUPPORTED nebius 0.6.") and "_request_with_authorization_loop" in lines[1]
    assert proc.stderr.count("STALLWATCH_INSTRUMENT_NEBIUS=false silences this") == 1
    assert not nebius_spans(tmp_path / "traces.jsonl")


def test_an_instrumentation_fault_never_reaches_the_sdk_caller(tmp_path):
    proc = run_python(
        f"""
        import asyncio
        import stallwatch
        from stallwatch.journal import ledger
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)

        class Broken:
            def intent(self, intent):
                raise OSError(28, "No space left on device")
            def outcome(self, intent, outcome):
                raise OSError(28, "No space left on device")

        ledger.set_recorder(Broken())
        from nebius.api.nebius.common.v1 import ResourceMetadata
        from nebius.api.nebius.compute.v1 import CreateInstanceRequest, InstanceServiceClient
        from support.fake_nebius import FakeNebius, sdk_for

        async def main(fake):
            async with sdk_for(fake.address) as sdk:
                for name in ("a", "b"):
                    op = await InstanceServiceClient(sdk).create(
                        CreateInstanceRequest(metadata=ResourceMetadata(name=name, parent_id="p")), timeout=5)
                    print(op.resource_id.startswith("computeinstance-"))

        with FakeNebius() as fake:
            asyncio.run(main(fake))
        stallwatch.shutdown(10)
        """,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
    assert proc.stderr.count("STALLWATCH_INSTRUMENT_NEBIUS=false") == 1
    metrics = tmp_path / "metrics.jsonl"
    # Intent and outcome of each create failed; both spans still ended.
    assert latest_total(metrics, "stallwatch.instrumentation.errors", **{"stallwatch.component": "nebius"}) == 4
    assert len(nebius_spans(tmp_path / "traces.jsonl")) == 2
    assert latest_total(metrics, "stallwatch.nebius.calls.active") == 0


def test_unit_resource_type_names():
    proc = run_python(
        """
        from stallwatch.instrument.nebius import resource_type
        print(resource_type("nebius.compute.v1.InstanceService"), resource_type(".nebius.vpc.v1.SubnetService"),
              resource_type("Odd"))
        """
    )
    assert proc.stdout.split() == ["compute.instance", "vpc.subnet", "odd"], proc.stderr


@pytest.mark.parametrize("within", ["timer", "shutdown"])
def test_a_call_is_completed_off_the_callers_path_and_never_lost(within, tmp_path):
    """A call's metrics and log records are completed while the next call waits on the network, else
    by the loop's timer (`COMPLETE_WITHIN`), else at shutdown; each span ended with its call."""
    proc = run_python(
        f"""
        import asyncio, time
        import stallwatch
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)
        from nebius.api.nebius.compute.v1 import GetInstanceRequest, InstanceServiceClient
        from nebius.aio.service_error import RequestError
        from opentelemetry import trace
        from support.fake_nebius import FakeNebius, sdk_for
        from stallwatch.instrument import nebius

        nebius.COMPLETE_WITHIN = {0.05 if within == "timer" else 3600}

        async def call(sdk, label):
            with trace.get_tracer("test").start_as_current_span(label):
                try:
                    await InstanceServiceClient(sdk).get(GetInstanceRequest(id="computeinstance-x"), timeout=5)
                except RequestError:
                    pass
            return len(nebius._waiting)

        async def main(fake):
            async with sdk_for(fake.address) as sdk:
                print(await call(sdk, "first"), await call(sdk, "second"))
                # The timer completes it, however loaded the machine; an hour's timer does not within 0.5 s.
                deadline = time.monotonic() + {30 if within == "timer" else 0.5}
                while nebius._waiting and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                print(len(nebius._waiting))

        with FakeNebius() as fake:
            asyncio.run(main(fake))
        stallwatch.shutdown(10)
        """,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    # After each call its own completion waits; the second call completed the first.
    assert proc.stdout.splitlines() == ["1 1", "0" if within == "timer" else "1"]
    path = tmp_path / "traces.jsonl"
    callers = {s["spanId"]: s for s in otlp_items(path, "spans") if s["name"] in ("first", "second")}
    spans = {callers[s["parentSpanId"]]["name"]: s for s in nebius_spans(path)}
    assert sorted(spans) == ["first", "second"]
    for label, span in spans.items():  # the span ends when the call did, inside its caller's span
        assert int(span["endTimeUnixNano"]) <= int(callers[span["parentSpanId"]]["endTimeUnixNano"]), label
    assert int(spans["first"]["endTimeUnixNano"]) <= int(spans["second"]["startTimeUnixNano"])


def test_a_fork_child_that_lives_on_never_completes_its_parents_calls(tmp_path):
    proc = run_python(
        f"""
        import asyncio, os, sys
        import stallwatch
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)
        from nebius.api.nebius.compute.v1 import GetInstanceRequest, InstanceServiceClient
        from nebius.aio.service_error import RequestError
        from support.fake_nebius import FakeNebius, sdk_for
        from stallwatch.instrument import nebius

        nebius.COMPLETE_WITHIN = 3600  # the call waits to be completed when the process forks

        async def main(fake):
            async with sdk_for(fake.address) as sdk:
                try:
                    await InstanceServiceClient(sdk).get(GetInstanceRequest(id="computeinstance-x"), timeout=5)
                except RequestError:
                    pass
                pid = os.fork()
                if pid == 0:
                    stallwatch.shutdown(5)  # as at the fork child's exit
                    os._exit(0)
                print(os.waitpid(pid, 0)[1], len(nebius._waiting))

        with FakeNebius() as fake:
            asyncio.run(main(fake))
        stallwatch.shutdown(10)
        """,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "1"]
    assert [s["name"] for s in nebius_spans(tmp_path / "traces.jsonl")] == [f"{INSTANCES}/Get"]


def test_uninstrument_restores_the_sdk_and_instrumenting_again_wraps_it_once(tmp_path):
    proc = run_python(
        f"""
        import asyncio
        import stallwatch
        from nebius.aio.request import Request
        from stallwatch.instrument.nebius import NebiusInstrumentor

        names = ("_request_with_authorization_loop", "_send", "_await_native_call")
        originals = [vars(Request)[name] for name in names]
        stallwatch.setup(file_dir={str(tmp_path)!r}, watchdog=False)
        from nebius.api.nebius.compute.v1 import GetInstanceRequest, InstanceServiceClient
        from nebius.aio.service_error import RequestError
        from opentelemetry import trace
        from support.fake_nebius import FakeNebius, sdk_for

        async def call(sdk, label):
            with trace.get_tracer("test").start_as_current_span(label):
                try:
                    await InstanceServiceClient(sdk).get(GetInstanceRequest(id="computeinstance-x"), timeout=5)
                except RequestError as error:
                    return error.status.code.name

        async def main(fake):
            instrumentor = NebiusInstrumentor()
            async with sdk_for(fake.address) as sdk:
                print(await call(sdk, "on"))
                instrumentor.uninstrument()
                print([vars(Request)[name] is original for name, original in zip(names, originals)])
                print(await call(sdk, "off"))
                for _ in range(3):
                    instrumentor.instrument()
                    instrumentor.uninstrument()
                instrumentor.instrument()
                print(await call(sdk, "again"))
                instrumentor.uninstrument()
                print([vars(Request)[name] is original for name, original in zip(names, originals)])

        with FakeNebius() as fake:
            asyncio.run(main(fake))
        stallwatch.shutdown(10)
        """,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    restored = "[True, True, True]"
    assert proc.stdout.splitlines() == ["NOT_FOUND", restored, "NOT_FOUND", "NOT_FOUND", restored]
    path = tmp_path / "traces.jsonl"
    parents = {s["spanId"]: s["name"] for s in otlp_items(path, "spans")}
    under = sorted(parents.get(s.get("parentSpanId")) for s in nebius_spans(path))
    # One span per call while instrumented, none in between: re-instrumenting never stacks a second layer.
    assert under == ["again", "on"]
