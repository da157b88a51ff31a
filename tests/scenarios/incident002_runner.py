"""Runner child for tests/scenarios/incident002.py: a stand-in for NDIF's per-request sandbox runner.

Usage: python incident002_runner.py SOCKET_PATH
Listens on SOCKET_PATH and serves exactly one request (incident 002 in docs/incidents.md): reads a
header frame {"id", "sleep_s", "trailer_bytes"}, runs the "user block" (sleeps sleep_s), only then
reads the trailer bytes, answers {"id", "result"} and exits.

Reading the trailer after the block is what --mode rst relies on: Linux resets the peer of a Unix
socket that is closed with unread data in its receive queue, so a runner terminated mid-block makes
the host's recv() raise ConnectionResetError (SO_LINGER has no effect on AF_UNIX sockets).

The framing (8-byte big-endian length prefix, `recvn` raising ConnectionError on EOF, as in NDIF's
sandbox/protocol.py) lives here and the host imports it, so both ends speak one definition.
A runner whose parent is gone exits on its own: a replay ends with os._exit and leaves none behind.
"""

import json
import os
import socket
import struct
import sys
import time

LENGTH = struct.Struct(">Q")


def frame(data: bytes) -> bytes:
    return LENGTH.pack(len(data)) + data


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(frame(data))


def recv_frame(sock: socket.socket) -> bytes:
    (size,) = LENGTH.unpack(recvn(sock, LENGTH.size))
    return recvn(sock, size)


def recvn(sock: socket.socket, n: int) -> bytes:
    buffer = bytearray()
    while len(buffer) < n:
        chunk = sock.recv(n - len(buffer))
        if not chunk:
            raise ConnectionError("connection closed before message complete")
        buffer.extend(chunk)
    return bytes(buffer)


def exit_if_orphaned(parent: int) -> None:
    if os.getppid() != parent:
        os._exit(1)


def accept_one(path: str, parent: int) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(0.1)
    while True:
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            exit_if_orphaned(parent)
            continue
        listener.close()
        connection.settimeout(None)
        return connection


def run_block(seconds: float, parent: int) -> None:
    """The user's block: a sleep, in short steps so an orphaned runner notices and exits."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))
        exit_if_orphaned(parent)


def serve(path: str) -> None:
    parent = os.getppid()
    connection = accept_one(path, parent)
    header = json.loads(recv_frame(connection))
    run_block(header["sleep_s"], parent)
    recvn(connection, header["trailer_bytes"])
    reply = {"id": header["id"], "result": f"request {header['id']} done"}
    send_frame(connection, json.dumps(reply).encode())
    connection.close()


if __name__ == "__main__":
    try:
        serve(sys.argv[1])
    except ConnectionError:  # the host went away before sending a request: nothing to serve
        sys.exit(0)
