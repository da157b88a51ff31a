"""What every instrumentor shares: instruments built from the telemetry contract, and fault
containment (a failure inside stallwatch is counted and logged once, never passed to the host)."""

from __future__ import annotations

import contextvars
import logging
import os
import signal
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import wrapt
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.trace import get_current_span

from .. import telemetry
from .._version import __version__
from . import histograms

_log = logging.getLogger("stallwatch")


def meter(meter_provider: Any = None) -> Meter:
    """stallwatch's meter, from the given provider or the global (proxy) one."""
    return metrics.get_meter(telemetry.INSTRUMENTATION_SCOPE, __version__, meter_provider=meter_provider)


def instrument(
    meter_: Meter, metric: telemetry.Metric, callback: Callable[[CallbackOptions], Iterable[Observation]] | None = None
) -> Any:
    """Create the OTel instrument that `metric` describes."""
    common: dict[str, Any] = {"name": metric.name, "unit": metric.unit, "description": metric.description}
    if metric.kind == "counter":
        return meter_.create_counter(**common)
    if metric.kind == "updowncounter":
        return meter_.create_up_down_counter(**common)
    if metric.kind == "histogram":
        try:
            return meter_.create_histogram(**common, explicit_bucket_boundaries_advisory=list(metric.buckets or ()))
        except TypeError:  # opentelemetry-api before 1.30 has no bucket advisory
            return meter_.create_histogram(**common)
    callbacks = [callback] if callback else []
    if metric.kind == "observable_counter":
        return meter_.create_observable_counter(**common, callbacks=callbacks)
    if metric.kind == "observable_updowncounter":
        return meter_.create_observable_up_down_counter(**common, callbacks=callbacks)
    return meter_.create_observable_gauge(**common, callbacks=callbacks)


class Faults:
    """Counts stallwatch's own failures per component and logs the first of each at WARNING."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._counter: Any = None
        self._provider: Any = None

    def bind(self, meter_provider: Any = None) -> None:
        """Count on `meter_provider` (default: the global one, perhaps still a proxy) from now on.

        Binding the same provider again does nothing: `setup()` and each instrumentor bind, and
        SDKs up to 1.33 warn on stderr when an instrument is created twice.
        """
        provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
        if provider is self._provider:
            return
        self._counter = instrument(meter(provider), telemetry.INSTRUMENTATION_ERRORS)
        self._provider = provider

    def record(
        self, component: str, setting: str, problem: str | None = None, count: int = 1, off: str = "false"
    ) -> None:
        """Call from an `except Exception` block inside a wrapper, or with `problem` saying what failed;
        `count`: how many failed items this one failure stands for; `setting=off` turns the part off."""
        with self._lock:
            first = component not in self._warned
            self._warned.add(component)
        if first and problem is None:
            _log.warning(
                "stallwatch: %s instrumentation failed; the host's call went ahead unchanged. "
                "Set %s=%s to turn this part off.",
                component,
                setting,
                off,
                exc_info=True,
            )
        elif first:
            _log.warning(
                "stallwatch: %s: %s. Set %s=%s to turn this part off.",
                component,
                problem,
                setting,
                off,
                exc_info=sys.exc_info()[0] is not None,
            )
        self.count(component, count)

    def count(self, component: str, count: int = 1) -> None:
        """Count failures of `component` without logging them: for a part that logs its failures
        itself (the freeze watchdog's polls, on its own stderr lines)."""
        counter = self._counter
        if counter is not None:
            try:
                counter.add(count, {telemetry.INSTRUMENTATION_COMPONENT.name: component})
            except Exception:  # the meter itself failing must not reach the host either
                _log.debug("stallwatch: cannot count an instrumentation error", exc_info=True)


FAULTS = Faults()

_first_record_checks: list[Callable[[], bool]] = []


def on_first_record(check: Callable[[], bool]) -> None:
    """Run `check` at the first span or measurement stallwatch records through a provider that is not
    an SDK's (so far only the host's, with STALLWATCH_PROVIDERS=host), and at each later one until it
    returns True (decided)."""
    _first_record_checks.append(check)


def first_record() -> None:
    """Where stallwatch records through a provider that may not be an SDK's: the undecided checks."""
    undecided = []
    while _first_record_checks:
        try:
            check = _first_record_checks.pop()  # atomic: two threads never run the same check
        except IndexError:
            break
        if not check():
            undecided.append(check)
    _first_record_checks.extend(undecided)


# How a Sentry user turns stallwatch's events off, as `Faults.record`'s `setting` and `off`.
SENTRY_COMPONENT, SENTRY_SETTING, SENTRY_OFF = "sentry", "disabled_integrations", "[StallwatchIntegration()]"


def to_sentry(kind: str, tags: dict[str, Any], context: dict[str, Any], trace_id: str = "", span_id: str = "") -> None:
    """Send an incident to Sentry (`stallwatch.sentry.capture`) when the host has imported sentry_sdk;
    never imports it otherwise, never raises."""
    if "sentry_sdk" not in sys.modules:
        return
    try:
        # optional: sentry-sdk, once the host has imported it
        from .. import sentry

        sentry.capture(kind, tags, context, trace_id, span_id)
    except Exception:  # an odd sentry-sdk version must not break detection
        FAULTS.record(SENTRY_COMPONENT, SENTRY_SETTING, off=SENTRY_OFF)


SPAWN_OBSERVER: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar(
    "stallwatch_spawn_observer", default=None
)
"""Set by an enclosing operation (e.g. an SSH tunnel close) to learn its children's return codes:
the subprocess instrumentation calls it with each child's return code when the child is reaped."""


def unwrap_method(owner: type, name: str) -> None:
    """Remove the wrapt wrapper set on `owner.name`, leaving exactly what was there before.

    OpenTelemetry's `unwrap` reads the attribute through the class, which gives a bound wrapper. For
    a method `owner` inherits, e.g. uvloop's `Loop.subprocess_exec` (defined on its Cython base), it
    then sets an object on `owner` that is not the original, and a later `instrument()` stacks a
    second wrapper. Here the wrapper is read from the class's own namespace; a method that was
    inherited is inherited again.
    """
    wrapper = vars(owner).get(name)
    if not isinstance(wrapper, wrapt.FunctionWrapper):
        return
    original = wrapper.__wrapped__
    if any(vars(base).get(name) is original for base in owner.__mro__[1:]):
        delattr(owner, name)
    else:
        setattr(owner, name, original)


def signal_name(number: int) -> str:
    """`SIGSEGV` for 11; `SIG<n>` for a number Python has no name for."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


class Counts:
    """Counter or up-down counter values kept as plain integers, read by an observable instrument.

    A dict update under a lock instead of an SDK `Counter.add` (attribute hashing, locks, every
    reader's storage) on each hot path (one per child process, one per executor item): they add
    here, and the SDK reads the totals at collection time, as cumulative sums. `before` runs first
    in each collection (e.g. `Deferred.drain`).
    """

    def __init__(self, meter_: Meter, metric: telemetry.Metric, before: Callable[[], None] | None = None) -> None:
        self._keys = tuple(attribute.name for attribute in metric.attributes)
        self._values: dict[tuple[Any, ...], int] = {}
        self._lock = threading.Lock()
        self._before = before
        instrument(meter_, metric, self._observe)

    def add(self, amount: int, *key: Any) -> None:
        """Add `amount` for the attribute values `key`, in the metric's attribute order (None: absent)."""
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        if self._before is not None:
            self._before()
        with self._lock:
            items = list(self._values.items())
        return [
            Observation(value, {name: v for name, v in zip(self._keys, key, strict=True) if v is not None})
            for key, value in items
        ]


_live: weakref.WeakSet[Deferred] = weakref.WeakSet()
_retired = [0]  # what the Deferreds already collected had dropped: the total never goes down


def dropped_values() -> int:
    """Histogram values dropped so far, in this process, because more than a `Deferred`'s `limit`
    waited for a collection."""
    return _retired[0] + sum(deferred.dropped for deferred in list(_live))


class Deferred:
    """Histogram values recorded on a hot path by a list or deque append, aggregated at collection.

    They go to stallwatch's own histogram (`histograms`) when its pipeline takes those, else to the
    SDK's. `drain()` runs before each collection (from `histograms.collect()`, or inside an
    observable instrument's callback, which the SDK calls before it reads the synchronous
    instruments' storages), so every value is in the same export. Two ways in: `record(value,
    attributes)`, or, on the hottest paths, a plain `list.append` to `values_for(attributes)` (one
    list per attribute set, aggregated in C at drain, see `OwnHistogram.record_values`). At most
    `limit` values wait per way in (per list); past that they are dropped and counted in `dropped`
    (`dropped_values()` sums them: `stallwatch.telemetry.dropped` {metrics, queue_full}).
    A histogram that raises is a fault of `owner` (component, setting that turns it off; default
    the metric's component, `stallwatch.<component>.…`, and `STALLWATCH_INSTRUMENT_<COMPONENT>`),
    counted per value; it never stops the collection.
    """

    def __init__(
        self, meter_: Meter, metric: telemetry.Metric, limit: int = 100_000, owner: tuple[str, str] | None = None
    ) -> None:
        # stallwatch's own aggregation when its pipeline takes it (see `histograms`), else the SDK's.
        self._own = histograms.register(metric, self.drain) if histograms.active() else None
        self._histogram = instrument(meter_, metric) if self._own is None else None
        self._pending: deque[tuple[float, dict[str, Any]]] = deque()
        self._lists: dict[tuple[tuple[str, Any], ...], tuple[dict[str, Any], list[float]]] = {}
        self._lock = threading.Lock()  # serialises drains: two must not take the same list values
        self._pid = os.getpid()
        self.limit = limit
        self.dropped = 0  # hot paths add to it (`+=`)
        _live.add(self)
        component = metric.name.split(".")[1]
        self._owner = owner or (component, f"STALLWATCH_INSTRUMENT_{component.upper()}")

    def __del__(self) -> None:
        retired = _retired  # None once the interpreter clears this module's globals at exit
        if retired is not None:
            retired[0] += getattr(self, "dropped", 0)  # 0: `__init__` failed before it was set

    def record(self, value: float, attributes: dict[str, Any]) -> None:
        if len(self._pending) < self.limit:
            self._pending.append((value, attributes))
        else:
            self.dropped += 1

    def record_now(self, value: float, attributes: dict[str, Any]) -> None:
        """Aggregate `value` at once: for rare values (a freeze, a tunnel, an overrun) that no
        collection may drain first. Made inside a sampled span, it may become an exemplar linking
        to that span (own histograms: its bucket's; the SDK's: as its exemplar filter decides)."""
        if self._own is not None:
            current = get_current_span().get_span_context()
            offered = os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based")  # as the SDK reads it
            sampled = current.trace_flags.sampled
            if current.is_valid and (offered == "always_on" or (offered != "always_off" and sampled)):
                try:
                    self._own.record_exemplar(value, attributes, current.trace_id, current.span_id)
                except Exception:
                    FAULTS.record(*self._owner)
                return
        self._hand_over([value], attributes)

    def zero(self, attributes: dict[str, Any]) -> None:
        """Make the series of `attributes` exist at count 0 before its first value (stallwatch's own
        aggregation only: the SDK's API cannot)."""
        if self._own is not None:
            self._own.zero(attributes)

    def values_for(self, attributes: dict[str, Any]) -> list[float]:
        """The list a hot path appends values with these attributes to, while it holds fewer than
        `limit` (else it adds to `dropped`). Only `drain()` removes from it."""
        key = tuple(attributes.items())
        with self._drain_lock():
            entry = self._lists.get(key)
            if entry is None:
                entry = self._lists[key] = (dict(attributes), [])
        return entry[1]

    def _drain_lock(self) -> threading.Lock:
        if self._pid != os.getpid():  # a fork child: the parent's lock may have been held by a thread
            self._pid, self._lock = os.getpid(), threading.Lock()
        return self._lock

    def drain(self) -> None:
        with self._drain_lock():
            for attributes, values in list(self._lists.values()):
                count = len(values)  # appends go on meanwhile, past `count`; `del` is one C call
                batch = values[:count]
                del values[:count]
                self._hand_over(batch, attributes)
            pending = self._pending
            while pending:
                batch_pairs = [pending.popleft() for _ in range(min(len(pending), 4096))]
                if self._own is not None:
                    try:
                        self._own.record_many(batch_pairs)
                    except Exception:
                        FAULTS.record(*self._owner, count=len(batch_pairs))
                else:
                    for value, attributes in batch_pairs:
                        self._hand_over([value], attributes)

    def _hand_over(self, values: list[float], attributes: dict[str, Any]) -> None:
        if not values:
            return
        if self._own is not None:
            try:
                self._own.record_values(values, attributes)
            except Exception:
                FAULTS.record(*self._owner, count=len(values))
            return
        record = self._histogram.record  # type: ignore[union-attr]  # set whenever `_own` is None
        for value in values:
            try:
                record(value, attributes)
            except Exception:
                FAULTS.record(*self._owner)
