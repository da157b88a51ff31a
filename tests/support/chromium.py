"""Measure an HTML page in headless Chromium (Debian's `chromium`), with no Python dependency beyond the stdlib.

A copy of the page gets a script that, once loaded, writes its measurements as JSON into a
`<pre id="measure">`; `--dump-dom` prints the DOM after `--virtual-time-budget` has let it run.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium")
MISSING = "chromium is not installed (apt-get install chromium; tests/run.sh installs it as root)"

_SCRIPT = """<pre id="measure"></pre><script>
window.addEventListener("load", () => {
  document.getElementById("measure").textContent = JSON.stringify({
    scrollWidth: document.documentElement.scrollWidth,
    innerWidth: window.innerWidth,
    rows: [...document.querySelectorAll("tr[data-kind]")].map(row => row.dataset.kind),
    text: document.body.innerText,
  });
});
</script>"""


def measure(page: Path, width: int) -> dict[str, Any]:
    """The page's scrollWidth, innerWidth, row kinds in document order and text, in a `width` px window."""
    assert CHROMIUM, MISSING
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "page.html"
        copy.write_text(page.read_text(encoding="utf-8").replace("</body>", _SCRIPT + "</body>"), encoding="utf-8")
        proc = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={scratch}/profile",
             f"--window-size={width},2000", "--virtual-time-budget=5000", "--dump-dom", copy.as_uri()],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    found = re.search(r'<pre id="measure">(.*?)</pre>', proc.stdout, re.S)
    assert found and found.group(1), f"chromium printed no measurements ({proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))
