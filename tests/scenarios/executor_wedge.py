"""Scenario: incident 002 in its smallest form, on a 1-worker ThreadPoolExecutor (the demo's wedge stage).

Usage: python executor_wedge.py {guard|noguard} {heal|noheal} DIR
Runs `stallwatch.demo_incidents.executor_wedge`, the same scenario `stallwatch demo` shows, and prints
its JSON line: what the injection returned, what B and C gave, how long B took and B's trace id.
"""

import json
import os
import sys

from stallwatch.demo_incidents import executor_wedge

guard, heal, out = sys.argv[1] == "guard", sys.argv[2] == "heal", sys.argv[3]
print(json.dumps(executor_wedge(out, guard, heal, metric_export_interval_ms=200)))
sys.stdout.flush()
os._exit(0)  # a wedged pool would also hang interpreter exit (concurrent.futures joins its workers)
