"""Fork-aware OpenTelemetry SDK: no thread starts in an after-fork handler, lazy restart on first use.

The one place that knows how each opentelemetry-sdk version (1.27 → newest) handles fork. The SDK
registers `WeakMethod(self._at_fork_reinit)` (or a bound method before 1.28/1.32) with
`os.register_at_fork` as each object is built, binding the function found on the class *then*; a
wrapt wrapper would be bypassed. So the methods are replaced on the classes, at `import stallwatch`,
before anything is built; objects built earlier keep the stock behaviour (`preexisting_objects()`).

Inside an after-fork handler (the guard sets `STATE.in_child_handler`), a patched method only
resets what the child inherited (locks, queues) and defers the thread start; outside one (the
SDK's own pid check on the first span/log, or our check on the first metric measurement) it
restarts every deferred worker, the sentry-sdk model. What each version patches: `_targets()`.

It also knows how each opentelemetry-exporter-prometheus version (0.48b0 → newest) can put resource
attributes on every series (`labelled_prometheus_reader`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import logging
import re
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, TypeVar

from .guard import STATE, defer, is_deferred, restart_pending

_log = logging.getLogger("stallwatch.forksafe")

Method = Callable[..., Any]


class _Patch:
    def __init__(self, cls: type, name: str, original: Method) -> None:
        self.cls = cls
        self.name = name
        self.original = original


_PATCHES: list[_Patch] = []


def _patch(cls: type, name: str, make: Callable[[Method], Method]) -> None:
    original = cls.__dict__[name]
    replacement = make(original)
    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    replacement.__qualname__ = f"{cls.__qualname__}.{name}"
    replacement.__name__ = name
    setattr(cls, name, replacement)
    _PATCHES.append(_Patch(cls, name, original))


def _reinit_patch(reset: Callable[[Any], None], drain: Callable[[Any], object]) -> Callable[[Method], Method]:
    """A replacement `_at_fork_reinit`: defer in a handler, restart everything on first use.

    `drain` exports what the object holds on the calling thread, for a fork child whose
    telemetry starts at interpreter exit, where Python 3.12 refuses the restart's thread.
    """

    def make(original: Method) -> Method:
        def _at_fork_reinit(self: Any) -> None:
            if STATE.child_exec_bound:
                return
            if STATE.in_child_handler:
                reset(self)
                defer(self, original, drain)
                return
            deferred_here = is_deferred(self)
            restart_pending()
            if not deferred_here and not STATE.exiting:
                original(self)  # a fork whose handlers never ran (C-level fork): the stock restart

        return _at_fork_reinit

    return make


def _reset_batch_processor(self: Any) -> None:
    from opentelemetry.util._once import Once

    self._export_lock = threading.Lock()
    self._worker_awaken = threading.Event()
    self._queue.clear()
    self._bsp_reset_once = Once()  # so the SDK's pid check triggers our lazy restart in grandchildren


def _reset_legacy_span_processor(self: Any) -> None:
    from opentelemetry.sdk.trace import export
    from opentelemetry.util._once import Once

    self.condition = threading.Condition(threading.Lock())
    self.queue.clear()
    export._BSP_RESET_ONCE = Once()  # type: ignore[attr-defined]


def _reset_legacy_log_processor(self: Any) -> None:
    from opentelemetry.sdk._logs._internal import export
    from opentelemetry.util._once import Once

    if hasattr(self, "_export_lock"):  # 1.33 (`_export_lock`, `_worker_awaken`)
        self._export_lock = threading.Lock()
        self._worker_awaken = threading.Event()
    else:  # up to 1.32
        self._condition = threading.Condition(threading.Lock())
    self._queue.clear()
    export._BSP_RESET_ONCE = Once()  # type: ignore[attr-defined]


def _drain_legacy_log_processor(self: Any) -> None:
    drain = getattr(self, "_drain_queue", None)  # up to 1.32; 1.33's force_flush exports inline
    if drain is not None:
        drain()
    else:
        self.force_flush()


def renew_metric_reader(reader: Any) -> None:
    """A new export lock for a `PeriodicExportingMetricReader` in a fork child: the parent's thread may have
    held it at the fork. The SDK renews it only for a reader with its own thread (`_at_fork_reinit`); a
    reader without one (`export.batching.SharedThreadMetricReader`) is renewed by its lane."""
    if hasattr(reader, "_export_lock"):
        reader._export_lock = threading.Lock()


def _handle_fork_patch(original: Method) -> Method:
    """Replacement provider `_handle_fork`: reset locks now, refresh the resource on first use."""

    def _handle_fork(self: Any) -> None:
        if STATE.child_exec_bound:
            return
        if not STATE.in_child_handler:
            original(self)
            return
        with _no_process_resource(original):
            original(self)  # resets the provider's locks; merges an empty resource
        defer(self, _refresh_process_resource)

    return _handle_fork


@contextlib.contextmanager
def _no_process_resource(original: Method) -> Iterator[None]:
    from opentelemetry.sdk.resources import Resource

    namespace = original.__globals__
    detect = namespace["_get_process_dependent_resource"]
    namespace["_get_process_dependent_resource"] = Resource.get_empty  # the child is single-threaded here
    try:
        yield
    finally:
        namespace["_get_process_dependent_resource"] = detect


def _refresh_process_resource(provider: Any) -> None:
    """What the SDK's `_handle_fork` detects, without its thread pool."""
    provider._update_resource(process_resource())


def process_resource() -> Any:
    """The process-dependent part of the resource, as this process's providers merge it after a
    fork (SDK 1.45's `service.instance.id`, new in each fork child); empty on SDKs without it."""
    from opentelemetry.sdk import resources

    resource = resources.Resource.get_empty()
    for detector in getattr(resources, "_build_resource_detectors", list)():
        if detector.is_process_dependent():
            try:
                resource = resource.merge(detector.detect())
            except Exception:  # a detector failing must not break the host's first span
                _log.debug("stallwatch: resource detector %r failed after fork", detector, exc_info=True)
    return resource


def _first_measurement_patch(original: Method) -> Method:
    def consume_measurement(self: Any, measurement: Any) -> None:
        if STATE.pending:
            restart_pending()
        original(self, measurement)

    return consume_measurement


def _targets() -> list[tuple[str, str, str, Callable[[Method], Method]]]:
    """(module, class, method, patch maker) for the installed SDK version.

    - 1.34+: `_shared_internal.BatchProcessor` backs both batch processors (`_export_lock`,
      `_worker_awaken`, `_queue`, per-object `_bsp_reset_once`).
    - up to 1.33: `BatchSpanProcessor` (`condition`, `queue`) and `BatchLogRecordProcessor`
      (`_condition`, `_queue`) each with a module-level `_BSP_RESET_ONCE`.
    - every version: `PeriodicExportingMetricReader._at_fork_reinit` starts the ticker.
    - 1.44+: `TracerProvider`/`MeterProvider`/`LoggerProvider._handle_fork` reset locks and rerun
      process-dependent resource detection on a thread pool; we reset the locks in the handler and
      run the detectors later, in the calling thread.
    """
    targets: list[tuple[str, str, str, Callable[[Method], Method]]] = []
    try:
        shared = hasattr(importlib.import_module("opentelemetry.sdk._shared_internal"), "BatchProcessor")
    except ImportError:
        shared = False
    if shared:
        targets.append(
            (
                "opentelemetry.sdk._shared_internal",
                "BatchProcessor",
                "_at_fork_reinit",
                _reinit_patch(_reset_batch_processor, lambda processor: processor.force_flush()),  # inline
            )
        )
    else:
        targets.append(
            (
                "opentelemetry.sdk.trace.export",
                "BatchSpanProcessor",
                "_at_fork_reinit",
                _reinit_patch(_reset_legacy_span_processor, lambda processor: processor._drain_queue()),
            )
        )
        targets.append(
            (
                "opentelemetry.sdk._logs._internal.export",
                "BatchLogRecordProcessor",
                "_at_fork_reinit",
                _reinit_patch(_reset_legacy_log_processor, _drain_legacy_log_processor),
            )
        )
    targets.append(
        (
            "opentelemetry.sdk.metrics._internal.export",
            "PeriodicExportingMetricReader",
            "_at_fork_reinit",
            _reinit_patch(renew_metric_reader, lambda reader: reader.collect()),
        )
    )
    targets.append(
        (
            "opentelemetry.sdk.metrics._internal.measurement_consumer",
            "SynchronousMeasurementConsumer",
            "consume_measurement",
            _first_measurement_patch,
        )
    )
    for module, cls in (
        ("opentelemetry.sdk.trace", "TracerProvider"),
        ("opentelemetry.sdk.metrics._internal", "MeterProvider"),
        ("opentelemetry.sdk._logs._internal", "LoggerProvider"),
    ):
        if "_handle_fork" in vars(getattr(importlib.import_module(module), cls)):
            targets.append((module, cls, "_handle_fork", _handle_fork_patch))
    return targets


_HOOKED_CLASSES: list[type] = []


def install() -> list[str]:
    """Patch the installed SDK; return the patched `Class.method` names."""
    if _PATCHES:
        return patched_names()
    for module_name, class_name, method, make in _targets():
        cls = getattr(importlib.import_module(module_name), class_name)
        _patch(cls, method, make)
        if method != "consume_measurement":
            _HOOKED_CLASSES.append(cls)
    return patched_names()


def patched_names() -> list[str]:
    """`Class.method` names currently replaced."""
    return [f"{p.cls.__qualname__}.{p.name}" for p in _PATCHES]


def preexisting_objects(sdk_loaded_before: bool) -> dict[str, int]:
    """SDK objects with fork handlers that were built before `import stallwatch`, by class.

    Their handlers captured the stock methods and still start threads in fork children. Scanning
    the heap costs time, so it runs only when the SDK was imported before stallwatch.
    """
    if not sdk_loaded_before or not _HOOKED_CLASSES:
        return {}
    hooked = tuple(_HOOKED_CLASSES)
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, hooked):
            name = type(obj).__qualname__
            counts[name] = counts.get(name, 0) + 1
    return counts


Reader = TypeVar("Reader")


def labelled_prometheus_reader(reader_class: type[Reader], resource_labels: Collection[str]) -> Reader:
    """A `reader_class()` (a `PrometheusMetricReader`) whose every series, target_info included, carries the
    resource attributes named in `resource_labels` as labels, named as Prometheus allows (`service.name` ->
    `service_name`); a label a series already has keeps its own value.

    exporter-prometheus 0.66b0+ does this itself (`resource_attribute_filter`). Before it the reader
    registers its `_collector` with prometheus_client's default registry in `__init__`, feeds it through
    `add_metrics_data` and unregisters it in `shutdown`: the collector is swapped for `_LabellingCollector`.
    """
    if "resource_attribute_filter" in inspect.signature(reader_class.__init__).parameters:
        return reader_class(resource_attribute_filter=frozenset(resource_labels).__contains__)  # type: ignore[call-arg]
    # optional: the prometheus extra
    from prometheus_client import REGISTRY

    reader = reader_class()
    stock = reader._collector  # type: ignore[attr-defined]
    REGISTRY.unregister(stock)
    reader._collector = _LabellingCollector(stock, frozenset(resource_labels))  # type: ignore[attr-defined]
    REGISTRY.register(reader._collector)  # type: ignore[attr-defined]
    return reader


def transform_prometheus_families(reader: Reader, transform: Callable[[Iterable[Any]], Iterable[Any]]) -> None:
    """Pass every scrape of `reader` (a `PrometheusMetricReader`, labelled or not) through `transform`, which
    takes and returns prometheus_client metric families; nothing happens for a reader without a collector."""
    collector = getattr(reader, "_collector", None)  # the one prometheus_client collector of the reader
    if collector is not None and callable(getattr(collector, "collect", None)):
        stock_collect = collector.collect
        collector.collect = lambda: transform(stock_collect())


class _LabellingCollector:
    """The exporter's collector, its samples labelled with the attributes of the last resource it was fed.

    A scrape runs `collect()`, whose stock collector calls back into the reader, which feeds
    `add_metrics_data` in the same thread before any sample is yielded: the labels are those of that data.
    """

    def __init__(self, stock: Any, resource_labels: frozenset[str]) -> None:
        self._stock, self._resource_labels = stock, resource_labels
        self._labels: dict[str, str] = {}

    def add_metrics_data(self, metrics_data: Any) -> None:
        for resource_metrics in metrics_data.resource_metrics:
            attributes = resource_metrics.resource.attributes
            self._labels = {
                re.sub(r"[^A-Za-z0-9_]", "_", key): str(value)
                for key, value in attributes.items()
                if key in self._resource_labels
            }
        self._stock.add_metrics_data(metrics_data)

    def describe(self) -> list[Any]:
        """Nothing: the registry would otherwise call `collect()` to learn the names, a scrape before any."""
        return []

    def collect(self) -> Iterable[Any]:
        for family in self._stock.collect():
            family.samples = [sample._replace(labels={**self._labels, **sample.labels}) for sample in family.samples]
            yield family


def logging_handler_provider(handler: logging.Handler) -> Any | None:
    """The logger provider an OpenTelemetry logging handler exports through, or None for any other handler.

    Both handler classes keep it as `_logger_provider`: the SDK's `opentelemetry.sdk._logs.LoggingHandler`
    (every version) and `opentelemetry.instrumentation.logging.handler.LoggingHandler` (0.61b0+, where the
    SDK's moved; dstack's `DSTACK_OTEL_LOGS_ENABLED` uses it). Their public `flush()` cannot be waited for.
    """
    if not type(handler).__module__.startswith("opentelemetry."):
        return None
    return getattr(handler, "_logger_provider", None)
