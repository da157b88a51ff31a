"""File exporters: OTLP/JSON lines, one file per signal, readable with no collector.

Each export call appends one line holding one OTLP `Export*ServiceRequest` in the OTLP/JSON
encoding (lowerCamelCase fields, hex trace/span ids), the same shape the OpenTelemetry
Collector's file exporter writes, so `jq`, the Collector's `otlpjsonfile` receiver and
`stallwatch postmortem` can all read it. The SDK has no file exporter. Spans and log records,
the numerous ones, are written by `span_json` and `log_json` straight from the SDK's objects (cheaper
than the protobuf route, and checked field by field against it). Metrics (a batch a
minute by default), and the rare log batch holding something `log_json` does not write itself, take
that protobuf route: the SDK's OTLP encoder and protobuf's JSON printer (`otlp_json.to_otlp_json`), fixing
only the id encoding (protobuf prints bytes as base64, OTLP/JSON wants hex). Each line is a single
`writev()` (the line and its newline) on an `O_APPEND` descriptor, so a forked child that lives on
appends whole lines to the same file as its parent.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .otlp_json import to_otlp_json  # first: protobuf loads there, under its warnings filter

# isort: split
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk._logs import export as _log_export
from opentelemetry.sdk._logs.export import LogExportResult
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from .._private import make_directories
from .log_json import encode_logs_json
from .span_json import encode_spans_json

_log = logging.getLogger("stallwatch.export")

FILE_NAMES = {"traces": "traces.jsonl", "metrics": "metrics.jsonl", "logs": "logs.jsonl"}


class _AppendFile:
    def __init__(self, directory: Path, signal: str) -> None:
        make_directories(directory)
        self.path = directory / FILE_NAMES[signal]
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def append(self, line: str) -> bool:
        if self._fd is None:
            return False
        data = line.encode()  # the newline is written beside it, not appended to a copy of the line
        try:
            written = os.writev(self._fd, (data, b"\n"))
        except OSError:
            _log.warning("stallwatch: cannot write %s; check STALLWATCH_FILE_DIR", self.path, exc_info=True)
            return False
        return written == len(data) + 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class FileSpanExporter(SpanExporter):
    """Appends spans to `<directory>/traces.jsonl` as OTLP/JSON lines."""

    def __init__(self, directory: Path) -> None:
        self._file = _AppendFile(directory, "traces")

    @property
    def path(self) -> Path:
        return self._file.path

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        ok = self._file.append(encode_spans_json(spans))
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# The SDK renamed LogExporter to LogRecordExporter in 1.39; the old name warns there.
_LogExporterBase: Any = getattr(_log_export, "LogRecordExporter", None) or _log_export.LogExporter


class FileLogExporter(_LogExporterBase):
    """Appends log records to `<directory>/logs.jsonl` as OTLP/JSON lines."""

    def __init__(self, directory: Path) -> None:
        self._file = _AppendFile(directory, "logs")

    @property
    def path(self) -> Path:
        return self._file.path

    def export(self, batch: Sequence[Any]) -> LogExportResult:
        ok = self._file.append(encode_logs_json(batch))
        return LogExportResult.SUCCESS if ok else LogExportResult.FAILURE

    def shutdown(self) -> None:
        self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class FileMetricExporter(MetricExporter):
    """Appends metric batches to `<directory>/metrics.jsonl` as OTLP/JSON lines (cumulative)."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self._file = _AppendFile(directory, "metrics")

    @property
    def path(self) -> Path:
        return self._file.path

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        ok = self._file.append(to_otlp_json(encode_metrics(metrics_data)))
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._file.close()
