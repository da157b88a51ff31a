"""incident 002: a stale async SystemExit kills an idle pooled worker, and the next request's
item is lost with it. Real threads, real sockets, real ctypes injection, fresh interpreters."""

from __future__ import annotations

import json

import pytest

from conftest import attrs, clean_env, latest_total, metric_points, otlp_items, run_python, run_scenario

pytestmark = pytest.mark.matrix


def test_by_default_the_stale_injection_is_refused_and_the_next_request_runs(telemetry_dir):
    result = run_scenario("executor_wedge.py", "guard", "noheal", str(telemetry_dir))

    assert result["set_async_exc_returned"] == 1  # what NDIF's kill_thread expects
    assert result["B"] == "B done"
    assert result["C"] == "C done"
    metrics = telemetry_dir / "metrics.jsonl"
    assert latest_total(metrics, "stallwatch.async_exception.refused") == 1
    assert latest_total(metrics, "stallwatch.executor.worker.deaths") == 0


def test_without_the_guard_the_worker_death_and_the_orphaned_item_are_reported(telemetry_dir):
    result = run_scenario("executor_wedge.py", "noguard", "noheal", str(telemetry_dir))

    assert result["B"] == "hung"  # the incident: B's future never completes
    metrics = telemetry_dir / "metrics.jsonl"
    assert latest_total(metrics, "stallwatch.executor.worker.deaths", **{"error.type": "SystemExit"}) == 1
    assert latest_total(metrics, "stallwatch.wedge.detected", **{"stallwatch.wedge.kind": "worker_died"}) == 1
    assert latest_total(metrics, "stallwatch.wedge.detected", **{"stallwatch.wedge.kind": "orphaned_item"}) == 1
    assert latest_total(metrics, "stallwatch.executor.orphaned", **{"stallwatch.executor.name": "runner"}) == 1
    # still waiting at shutdown: the ExecutorOrphanedItem alert fires for as long as this stays 1
    runner = {"stallwatch.executor.name": "runner"}
    assert latest_total(metrics, "stallwatch.executor.orphaned.outstanding", **runner) == 1
    logs = (telemetry_dir / "logs.jsonl").read_text()
    assert "wedge orphaned_item" in logs and "runner_0" in logs and "STALLWATCH_EXECUTOR_HEAL" in logs
    records = [r for r in otlp_items(telemetry_dir / "logs.jsonl", "logs") if "wedge" in r["body"]["stringValue"]]
    orphaned = [r for r in records if "wedge orphaned_item" in r["body"]["stringValue"]]
    assert [r["traceId"] for r in orphaned] == [result["B_trace"]]  # the lost request's trace, from Loki to Tempo
    from opentelemetry.sdk import metrics as sdk_metrics

    if hasattr(sdk_metrics, "Exemplar"):  # SDK 1.28+: the count's exemplar leads there too
        points = metric_points(metrics, "stallwatch.wedge.detected")
        orphan_points = [p for p in points if attrs(p).get("stallwatch.wedge.kind") == "orphaned_item"]
        assert {e["traceId"] for p in orphan_points for e in p.get("exemplars", [])} == {result["B_trace"]}


@pytest.mark.serial  # a time bound: not beside the other tests' load
def test_with_heal_the_lost_request_fails_fast_and_the_pool_recovers(telemetry_dir):
    result = run_scenario("executor_wedge.py", "noguard", "heal", str(telemetry_dir))

    assert result["B"].startswith("WorkerDied: executor worker runner_0 dequeued this item and died")
    # Fails fast: detection takes two check intervals (0.5 s each); unhealed, B never completes at all.
    assert result["B_seconds"] < 10.0
    assert result["C"] == "C done"
    metrics = telemetry_dir / "metrics.jsonl"
    assert latest_total(metrics, "stallwatch.executor.healed") == 1
    points = metric_points(metrics, "stallwatch.executor.orphaned.outstanding")
    runner = [point for point in points if attrs(point) == {"stallwatch.executor.name": "runner"}]
    assert runner and int(runner[-1].get("asInt", 0)) == 0  # healed: no request waits on it any more


def test_interrupt_thread_is_scoped_to_the_running_item():
    proc = run_python(
        """
        import json, threading, time
        import stallwatch
        stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none")
        from concurrent.futures import ThreadPoolExecutor
        from stallwatch import interrupt
        pool = ThreadPoolExecutor(max_workers=1)
        running = threading.Event()
        idents = {}

        def spin():
            idents["spin"] = threading.get_ident()
            running.set()
            while True:
                pass

        def park():
            idents["park"] = threading.get_ident()
            running.set()
            time.sleep(1.5)
            return "slept"

        busy = pool.submit(spin)
        running.wait(); running.clear()
        delivered = stallwatch.interrupt_thread(idents["spin"])
        parked = pool.submit(park)
        running.wait()
        revoked = stallwatch.interrupt_thread(idents["park"], timeout=0.2)
        park_result = parked.result(timeout=30)
        deadline = time.monotonic() + 30
        while idents["park"] in interrupt.RUNNING:  # the item's end is past: the worker is idle
            assert time.monotonic() < deadline
            time.sleep(0.01)
        idle = stallwatch.interrupt_thread(idents["park"])
        after = pool.submit(lambda: "after").result(timeout=5)
        print(json.dumps({"delivered": delivered, "busy": type(busy.exception(timeout=5)).__name__,
                          "revoked": revoked, "park": park_result, "idle": idle,
                          "gone": stallwatch.interrupt_thread(2**40), "after": after}))
        """
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result == {
        "delivered": "delivered",
        "busy": "Interrupted",
        "revoked": "revoked",
        "park": "slept",  # the C call returned after the revoke: nothing fired later
        "idle": "refused_idle",
        "gone": "no_such_thread",
        "after": "after",  # the worker survived all of it
    }


# `WorkItem.run` replicates the stock `_WorkItem.run` of CPython 3.10-3.13 and ends an item's
# scope before its future completes; on another `run` it wraps the stock one and ends the scope after
# (`worker._STOCK_RUN`). Both are tested here, whichever this interpreter uses.
_PATHS = {"replicated": True, "stock": False}
_HELD_BACK = """
import json, sys, threading, time
import stallwatch
stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none")
from concurrent.futures import ThreadPoolExecutor
from stallwatch import interrupt
from stallwatch.instrument import worker
worker._STOCK_RUN = {replicated}
pool = ThreadPoolExecutor(max_workers=1)
ident = pool.submit(threading.get_ident).result(timeout=5)
ran = threading.Event()
with interrupt.LOCK:  # as interrupt_thread() holds it, between its look-up and SetAsyncExc
    interrupt.DELIVERING.add(ident)
    first = pool.submit(lambda: ran.set() or "first")
    second = pool.submit(lambda: "second")
    deadline = time.monotonic() + 30
    while getattr(sys._current_frames().get(ident), "f_code", None) is not worker.WorkItem._end_scope.__code__:
        assert time.monotonic() < deadline, "the item never reached its end"
        time.sleep(0.01)  # until the worker waits for this lock, at the end of the first item
    seen = {{"ran": ran.is_set(), "first_done": first.done(), "second_done": second.done()}}
    interrupt.DELIVERING.discard(ident)
seen["results"] = [first.result(timeout=30), second.result(timeout=30)]
with interrupt.LOCK:  # no delivery under way: items end without the lock
    seen["free"] = [pool.submit(lambda: "free").result(timeout=30) for _ in range(3)]
print(json.dumps(seen))
"""


@pytest.mark.parametrize("path", _PATHS)
def test_an_item_ending_while_a_delivery_may_be_under_way_waits_for_it(path: str):
    """An item ends without interrupt.LOCK unless a delivery concerns it or may be under way
    (interrupt.DELIVERING): then it settles under that lock, after the delivery. The replicated `run`
    settles before the future completes, the stock one after."""
    proc = run_python(_HELD_BACK.format(replicated=_PATHS[path]))

    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen.pop("results") == ["first", "second"]
    assert seen.pop("free") == ["free"] * 3
    # The work ran, and its end waited for the lock: the worker is held, so the second item waits too.
    assert seen == {"ran": True, "first_done": path == "stock", "second_done": False}


@pytest.mark.parametrize("instrumented", [True, False])
def test_instrumentation_keeps_results_exceptions_and_order(instrumented):
    proc = run_python(
        f"""
        import asyncio, json
        import stallwatch
        if {instrumented}:
            stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none")
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(max_workers=2)
        order = []
        def work(i):
            order.append(i)
            if i % 3 == 0:
                raise ValueError(i)
            return i * i
        futures = [pool.submit(work, i) for i in range(30)]
        outcomes = [repr(f.exception()) if f.exception() else f.result() for f in futures]
        async def main():
            return await asyncio.to_thread(work, 4), await asyncio.get_running_loop().run_in_executor(None, work, 5)
        print(json.dumps({{"outcomes": outcomes, "order": sorted(order), "asyncio": asyncio.run(main())}}))
        """
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["outcomes"] == [repr(ValueError(i)) if i % 3 == 0 else i * i for i in range(30)]
    assert result["order"] == list(range(30))
    assert result["asyncio"] == [16, 25]


def test_pools_built_before_instrument_run_untouched_and_uninstrument_restores_the_work_item_class():
    proc = run_python(
        """
        import json
        from concurrent.futures import ThreadPoolExecutor, thread
        original = thread._WorkItem
        before = ThreadPoolExecutor(max_workers=1, thread_name_prefix="before")
        from stallwatch.instrument.executor import ExecutorInstrumentor
        from stallwatch.instrument.worker import current_item
        import threading

        def probe(tag):
            item = current_item(threading.get_ident())
            return [tag, None if item is None else item.executor.name]

        instrumentor = ExecutorInstrumentor()
        instrumentor.instrument()
        during = ThreadPoolExecutor(max_workers=1, thread_name_prefix="during")
        seen = [before.submit(probe, "before").result(), during.submit(probe, "during").result()]
        replaced = thread._WorkItem is not original
        instrumentor.uninstrument()
        after = ThreadPoolExecutor(max_workers=1, thread_name_prefix="after")
        seen += [during.submit(probe, "during, after uninstrument").result(), after.submit(probe, "after").result()]
        print(json.dumps({"seen": seen, "replaced": replaced, "restored": thread._WorkItem is original}))
        """
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["replaced"] and result["restored"]
    assert result["seen"] == [
        ["before", None],  # a pool built before instrument(): its items are not accounted
        ["during", "during"],
        ["during, after uninstrument", None],  # uninstrument() ends the per-item work in every pool
        ["after", None],
    ]


def test_queue_and_run_durations_and_workers_are_recorded(telemetry_dir):
    proc = run_python(
        f"""
        import asyncio, time
        from concurrent.futures import ThreadPoolExecutor
        import stallwatch
        stallwatch.setup(file_dir={str(telemetry_dir)!r})
        async def main():
            await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.05) for _ in range(3)))
        asyncio.run(main())
        pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="renderer")
        list(pool.map(time.sleep, [0.01] * 3))
        stallwatch.shutdown(timeout=5)
        """
    )

    assert proc.returncode == 0, proc.stderr
    metrics = telemetry_dir / "metrics.jsonl"
    runs = {attrs(p)["stallwatch.executor.name"]: p for p in metric_points(metrics, "stallwatch.executor.run.duration")}
    assert int(runs["asyncio-default"]["count"]) == 3
    assert float(runs["asyncio-default"]["sum"]) >= 0.15
    assert int(runs["renderer"]["count"]) == 3
    assert metric_points(metrics, "stallwatch.executor.queue.duration")
    assert latest_total(metrics, "stallwatch.executor.max_workers", **{"stallwatch.executor.name": "renderer"}) == 3
    assert 1 <= latest_total(metrics, "stallwatch.executor.workers", **{"stallwatch.executor.name": "renderer"}) <= 3


OTHER_RUNTIME_CONTEXT = """
import contextvars
from opentelemetry.context.context import Context, _RuntimeContext

ATTACHED = []


class OtherRuntimeContext(_RuntimeContext):
    \"\"\"A runtime context that keeps the context elsewhere than the API's own one.\"\"\"

    def __init__(self):
        self._elsewhere = contextvars.ContextVar("other_runtime_context", default=Context())

    def attach(self, context):
        ATTACHED.append(context)
        return self._elsewhere.set(context)

    def get_current(self):
        return self._elsewhere.get()

    def detach(self, token):
        self._elsewhere.reset(token)
"""


@pytest.fixture(params=["api_contextvar", "other_runtime_context"])
def runtime_context(request, tmp_path) -> dict[str, str]:
    """The environment for the API's own runtime context, or for another one chosen with
    OTEL_PYTHON_CONTEXT (installed here as a real `opentelemetry_context` entry point), which the
    executor reaches through the API instead of its ContextVar."""
    if request.param == "api_contextvar":
        return clean_env()
    site = tmp_path / "site"
    dist_info = site / "other_context-0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: other-context\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text(
        "[opentelemetry_context]\nother_context = other_context:OtherRuntimeContext\n"
    )
    (site / "other_context.py").write_text(OTHER_RUNTIME_CONTEXT)
    return clean_env(OTEL_PYTHON_CONTEXT="other_context", PYTHONPATH=str(site))


def test_submission_span_only_inside_a_trace_and_context_reaches_the_worker(telemetry_dir, runtime_context):
    proc = run_python(
        f"""
        import asyncio, contextvars, functools, json, os
        import stallwatch
        stallwatch.setup(file_dir={str(telemetry_dir)!r})
        from opentelemetry import trace
        from stallwatch import sdk_compat
        from stallwatch.instrument import worker
        if os.environ.get("OTEL_PYTHON_CONTEXT"):
            import other_context
        if os.environ.get("OTEL_PYTHON_CONTEXT") or not sdk_compat.fast_paths():
            assert worker._context_var is worker._ContextApi, worker._context_var
        else:
            assert worker._context_var is not worker._ContextApi
        tracer = trace.get_tracer("app")

        from opentelemetry import baggage, context

        def seen_from_worker():
            current = trace.get_current_span().get_span_context()
            return format(current.trace_id, "032x"), format(current.span_id, "016x"), baggage.get_baggage("tenant")

        async def main():
            with tracer.start_as_current_span("request") as request:
                token = context.attach(baggage.set_baggage("tenant", "t-1"))
                inside, inside_span, inside_baggage = await asyncio.to_thread(seen_from_worker)
                # run_in_executor runs the function in the worker's own contextvars, unlike to_thread
                _, plain_span, plain_baggage = await asyncio.get_running_loop().run_in_executor(None, seen_from_worker)
                # a contextvars copy of the caller's own, as to_thread runs its function in, and again afterwards
                held = contextvars.copy_context()
                held_run = functools.partial(held.run, seen_from_worker)
                _, held_span, _ = await asyncio.get_running_loop().run_in_executor(None, held_run)
                _, held_after, _ = held.run(seen_from_worker)
                context.detach(token)
                trace_id = format(request.get_span_context().trace_id, "032x")
                request_span = format(request.get_span_context().span_id, "016x")
            outside, _, outside_baggage = await asyncio.to_thread(seen_from_worker)  # no trace: no span, no context
            token = context.attach(baggage.set_baggage("tenant", "t-2"))  # a context without a trace: no span
            _, _, to_thread_baggage = await asyncio.to_thread(seen_from_worker)
            _, _, plain_baggage_only = await asyncio.get_running_loop().run_in_executor(None, seen_from_worker)
            context.detach(token)
            return {{"inside": inside, "trace_id": trace_id, "outside": outside,
                     "context_only": [to_thread_baggage, plain_baggage_only],
                     "item_spans": [inside_span, plain_span, held_span],
                     "held_after": held_after, "request_span": request_span,
                     "baggage": [inside_baggage, plain_baggage, outside_baggage]}}

        result = asyncio.run(main())
        if os.environ.get("OTEL_PYTHON_CONTEXT"):
            result["attached_by_other_runtime_context"] = len(other_context.ATTACHED)
        stallwatch.shutdown(timeout=5)
        print(json.dumps(result))
        """,
        env=runtime_context,
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    if "OTEL_PYTHON_CONTEXT" in runtime_context:
        assert result["attached_by_other_runtime_context"] >= 2  # the request span, and the traced item in the worker
    assert result["inside"] == result["trace_id"]
    assert result["outside"] == "0" * 32
    spans = otlp_items(telemetry_dir / "traces.jsonl", "spans")
    work = [s for s in spans if s["name"] == "asyncio-default work item"]
    assert len(work) == 3
    parent = next(s for s in spans if s["name"] == "request")
    for item in work:
        assert item["traceId"] == result["trace_id"]
        assert item["parentSpanId"] == parent["spanId"]
    # each item's span is the current span in its worker, for every way of running the function
    assert sorted(item["spanId"] for item in work) == sorted(result["item_spans"])
    # and no longer in the caller's context the item ran its function in, once the item is over
    assert result["held_after"] == result["request_span"] == parent["spanId"]
    assert result["baggage"] == ["t-1", "t-1", None]  # the rest of the submitter's context came along, and only there
    assert result["context_only"] == ["t-2", "t-2"]  # to_thread's in its contextvars copy, the other set by the worker
    for item in work:  # durations of whole nanoseconds (monotonic_ns), written as such: 0.000102933, not 0.00010293299…
        durations = [attrs(item)[f"stallwatch.executor.{name}_seconds"] for name in ("queue", "run")]
        assert all(0 < value < 60 and value == round(value * 1e9) / 1e9 for value in durations), durations
        assert all(len(repr(value)) < 17 for value in durations), durations


def test_an_item_span_ended_by_the_items_own_code_is_not_changed_after_it_was_handed_over(telemetry_dir):
    """Code run by the item may end the current span itself: the span reaches the processors then, and
    its attributes must not change afterwards (an export thread may be reading them)."""
    proc = run_python(
        f"""
        import json
        from concurrent.futures import ThreadPoolExecutor
        import stallwatch
        stallwatch.setup(file_dir={str(telemetry_dir)!r})
        from opentelemetry import trace
        from opentelemetry.sdk.trace import SpanProcessor

        class Snapshots(SpanProcessor):  # what each span's attributes were when it was handed over
            ended = []
            def on_end(self, span):
                self.ended.append((span, dict(span.attributes)))

        trace.get_tracer_provider().add_span_processor(Snapshots())
        with trace.get_tracer("app").start_as_current_span("request"):
            with ThreadPoolExecutor(1) as pool:
                pool.submit(lambda: trace.get_current_span().end()).result()
        ((span, handed),) = [(s, a) for s, a in Snapshots.ended if s.name.endswith("work item")]
        print(json.dumps({{"handed": sorted(handed), "now": sorted(span.attributes)}}))
        stallwatch.shutdown(timeout=5)
        """
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["now"] == result["handed"] == ["stallwatch.executor.name"]


def test_a_pool_with_no_live_worker_is_reported_stalled_and_sent_to_sentry(telemetry_dir):
    proc = run_python(
        f"""
        import ctypes, json, os, sys, threading, time
        import sentry_sdk
        from sentry_sdk.transport import Transport
        import stallwatch

        events = []
        class Capture(Transport):  # a transport that keeps events in memory: nothing leaves the host
            def capture_envelope(self, envelope):
                events.extend(item.payload.json for item in envelope.items if item.payload.json)

        sentry_sdk.init(dsn="http://key@127.0.0.1:9/1", transport=Capture)
        stallwatch.setup(file_dir={str(telemetry_dir)!r}, guard_async_exc=False, queue_stall_seconds=0.5)
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="solo")
        ident = pool.submit(threading.get_ident).result()

        def wait_until(predicate, what):
            deadline = time.monotonic() + 30
            while not predicate():
                assert time.monotonic() < deadline, what
                time.sleep(0.01)

        worker_frame = lambda: getattr(sys._current_frames().get(ident), "f_code", None)
        wait_until(lambda: worker_frame() and worker_frame().co_name == "_worker", "the worker waits for items")
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(SystemExit))
        lost = pool.submit(lambda: "lost")  # the worker dies dequeuing it
        wait_until(lambda: ident not in sys._current_frames(), "the worker died")
        waiting = pool.submit(lambda: "waiting")  # no worker will ever start: max_workers is used up
        kinds = lambda: {{e.get("tags", {{}}).get("stallwatch.kind") for e in events}}
        wait_until(lambda: {{"queue_stalled", "orphaned_item"}} <= kinds(), "both wedges were sent to Sentry")
        sentry_sdk.flush()
        print(json.dumps({{"lost": lost.done(), "waiting": waiting.done(),
                           "sentry": [e.get("tags", {{}}).get("stallwatch.kind") for e in events]}}))
        os._exit(0)
        """
    )

    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result == {"lost": False, "waiting": False, "sentry": result["sentry"]}
    assert "queue_stalled" in result["sentry"] and "orphaned_item" in result["sentry"]
    logs = (telemetry_dir / "logs.jsonl").read_text() if (telemetry_dir / "logs.jsonl").exists() else ""
    assert "wedge queue_stalled" in proc.stderr + logs


def test_the_oldest_pending_item_age_is_reported_per_executor(telemetry_dir):
    proc = run_python(
        f"""
        import threading, time
        from concurrent.futures import ThreadPoolExecutor
        import stallwatch
        stallwatch.setup(file_dir={str(telemetry_dir)!r}, watchdog=False, metric_export_interval_ms=3600000)
        release = threading.Event()
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="busy")
        idle = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idle")
        idle.submit(lambda: None).result()
        pool.submit(release.wait)
        waiting = pool.submit(lambda: "second")
        time.sleep(1.2)
        stallwatch.shutdown(10)  # collects while the second item still waits
        release.set()
        print(waiting.result())
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["second"]
    ages = {attrs(p)["stallwatch.executor.name"]: p["asDouble"] for p in
            metric_points(telemetry_dir / "metrics.jsonl", "stallwatch.executor.pending.oldest_age")}  # fmt: skip
    assert 1.1 <= ages["busy"] < 30 and ages["idle"] == 0


def test_a_worker_death_is_reported_without_the_secrets_its_exception_carries(caplog):
    # The exception that kills a worker is the host's: its text may hold anything (here an option with a
    # password, and a thread named after a URL with user-info). The wedge report goes to the host's log.
    import threading
    import weakref
    from concurrent.futures import ThreadPoolExecutor

    from secrets_corpus import leaked
    from stallwatch.detect import wedge
    from stallwatch.instrument import executor as executor_module
    from stallwatch.instrument.work_item import ExecutorState

    with ThreadPoolExecutor(thread_name_prefix="pool") as pool:
        state = ExecutorState(executor_module.executor_name(pool), weakref.ref(pool))
        thread = threading.Thread(name="https://deploy:UrlUserinfoPw-8101@host/x", target=lambda: None)
        with caplog.at_level("WARNING", logger="stallwatch"):
            wedge.worker_died(state, thread, SystemExit("kill --password=ExecutorKwPw-8602 now"), None)
    (record,) = [r for r in caplog.records if "wedge worker_died" in r.getMessage()]
    assert "SystemExit" in record.getMessage() and "[REDACTED]" in record.getMessage()
    assert not leaked(record.getMessage()), record.getMessage()


def test_a_finished_item_keeps_nothing_it_was_given_alive():
    proc = run_python(
        """
        import asyncio, json, weakref
        import stallwatch
        stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none")
        from concurrent.futures import ThreadPoolExecutor

        class Payload:
            pass

        def work(payload, *, also):
            return type(payload).__name__

        pool = ThreadPoolExecutor(max_workers=1)
        payload, also = Payload(), Payload()
        refs = [weakref.ref(payload), weakref.ref(also)]
        result = pool.submit(work, payload, also=also).result()
        del payload, also
        # The item is still the last one the pool's accounting logged: no submit or check came since.
        alive = {"submit": [ref() is not None for ref in refs]}

        async def main():
            payload = Payload()
            ref = weakref.ref(payload)
            await asyncio.to_thread(work, payload, also=None)
            del payload
            return ref() is not None

        alive["to_thread"] = asyncio.run(main())
        print(json.dumps({"result": result, "alive": alive}))
        """
    )

    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"result": "Payload", "alive": {"submit": [False, False], "to_thread": False}}
