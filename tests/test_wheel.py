"""The wheel ships the product: the runtime, the CLI and the demo, and none of the test machinery."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_the_demo_and_its_shared_scenarios_but_no_fake_cloud_server(tmp_path):
    # The build backend comes from the test extras: nothing is fetched from a package index.
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    proc = subprocess.run([*command, str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("stallwatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()

    assert "stallwatch/demo.py" in names and "stallwatch/demo_incidents.py" in names
    assert not [name for name in names if "fake" in name or name.startswith(("tests/", "support/"))], names
    shipped = "".join(zipfile.ZipFile(wheel).read(name).decode() for name in names if name.endswith(".py"))
    assert "FakeNebius" not in shipped and "support.fake_nebius" not in shipped
