"""A real Prometheus server (the `prometheus` binary) scraping given targets, for one test."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

BINARY = shutil.which("prometheus") or "/usr/bin/prometheus"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PrometheusServer:
    """Prometheus on a free loopback port with `jobs` (job name → targets) scraped every `interval`,
    started with the feature flags `features`; `stop()` ends it."""

    def __init__(
        self, workdir: Path, jobs: dict[str, list[str]], interval: str, features: tuple[str, ...] = ()
    ) -> None:
        self.port = free_port()
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": t}]} for job, t in jobs.items()],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("w")
        command = [BINARY, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                   f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]  # fmt: skip
        command += [f"--enable-feature={feature}" for feature in features]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self._ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log_path.read_text()
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1).status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str | float) -> Any:
        """The `data` of a `/api/v1/<path>` answer."""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        return body["data"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self._log.close()
