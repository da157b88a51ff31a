"""Scenario: incident 002's race, randomised: a stale async SystemExit against a pooled worker.

Usage: [STOCK_RUN=1] python executor_stress.py {naive|guard|api} TRIALS SEED
Each trial: a 1-worker pool; item A parks in recv on a socket; after a random 0-4 ms gap the
peer is closed cleanly (EOF) or with a reset (RST), and SystemExit is injected into A's worker
before or after that (random order) -- with raw ctypes as NDIF's kill_thread does (naive: no
stallwatch; guard: stallwatch defaults) or with stallwatch.interrupt_thread (api). Then item B is
submitted. A trial wedges when A or B is not done within 1 s. Prints one JSON line of counts.
"""

import ctypes
import json
import os
import random
import socket
import struct
import sys
import threading
import time

mode, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode != "naive":
    import stallwatch

    stallwatch.setup(traces_exporter="none", metrics_exporter="none", logs_exporter="none")
    if os.environ.get("STOCK_RUN") == "1":  # the path for a `_WorkItem.run` stallwatch does not replicate
        from stallwatch.instrument import worker

        worker._STOCK_RUN = False

from concurrent.futures import ThreadPoolExecutor, wait


def pair(reset: bool) -> tuple[socket.socket, socket.socket]:
    if not reset:
        return socket.socketpair()
    server = socket.create_server(("127.0.0.1", 0))
    near = socket.create_connection(server.getsockname())
    far, _ = server.accept()
    server.close()
    far.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
    return near, far


def inject(ident: int) -> None:
    if mode == "api":
        threading.Thread(target=stallwatch.interrupt_thread, args=(ident, SystemExit, 1.0)).start()
    else:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(SystemExit))


def trial(rng: random.Random) -> dict:
    reset, kill_first = rng.random() < 0.4, rng.random() < 0.5
    pool = ThreadPoolExecutor(max_workers=1)
    near, far = pair(reset)
    started = threading.Event()
    ident = {}

    def item_a() -> bytes:
        ident["a"] = threading.get_ident()
        started.set()
        return near.recv(10)

    a = pool.submit(item_a)
    started.wait(1)
    time.sleep(rng.uniform(0, 0.004))
    if kill_first:
        inject(ident["a"])
        far.close()
    else:
        far.close()
        time.sleep(rng.uniform(0, 0.004))
        inject(ident["a"])
    b = pool.submit(lambda: "B")
    done, _ = wait([a, b], timeout=1.0)
    alive = any(t.is_alive() for t in pool._threads)
    near.close()
    return {"wedged": len(done) < 2, "worker_died": not alive, "reset": reset, "kill_first": kill_first}


rng = random.Random(seed)
results = [trial(rng) for _ in range(trials)]
print(
    json.dumps(
        {
            "trials": trials,
            "wedged": sum(r["wedged"] for r in results),
            "worker_died": sum(r["worker_died"] for r in results),
            "rst_trials": sum(r["reset"] for r in results),
            "kill_first_trials": sum(r["kill_first"] for r in results),
        }
    )
)
sys.stdout.flush()
os._exit(0)  # wedged pools would hang interpreter exit
