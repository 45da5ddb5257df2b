"""The WebSocket transport of `agent-gym serve` (agent_gym.serve.transport), over raw
sockets to a real server, since no client library sends such handshakes: bytes over 0x7F
in a header, and an offer of per-message deflate, which the server declines (its zlib state
per connection left the heap growing with every connection opened and closed)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("uvicorn")

from agent_gym.serve.transport import as_latin1
from tests.helpers.serve_process import ROOT, free_port

TOKEN = "s3cret"
UPGRADE = (b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
           b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
           b"Sec-WebSocket-Version: 13\r\n")


def listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


def handshake(port: int, *headers: bytes) -> bytes:
    """What the server sends within a second of an upgrade request with ``headers``."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(UPGRADE + b"".join(header + b"\r\n" for header in headers) + b"\r\n")
        received, deadline = b"", time.monotonic() + 1.0
        sock.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            if not chunk:
                break
            received += chunk
    return received


def test_handshakes_holding_non_ascii_bytes_or_a_deflate_offer_are_answered_without_error(
) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "agent_gym.cli", "serve", "agent_gym/GSM8K-v0", "--port",
         str(port), "--token-env", "SERVE_TOKEN"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SERVE_TOKEN": TOKEN})
    bearer = b"Authorization: Bearer " + TOKEN.encode()
    try:
        deadline = time.monotonic() + 90
        while not listening(port):
            assert process.poll() is None and time.monotonic() < deadline, "no server"
            time.sleep(0.1)
        for note in ("café".encode(), b"\xff\xfe", "日本".encode()):
            answer = handshake(port, bearer, b"X-Note: " + note)
            assert answer.startswith(b"HTTP/1.1 101 "), answer
            assert b"UNAUTHORIZED" not in answer
        for token in ("s3crét".encode(), "s3crét".encode("latin-1"), b"\x80"):
            answer = handshake(port, b"Authorization: Bearer " + token)
            # a wrong token on /ws: an error frame, then the close (as for any wrong token)
            assert answer.startswith(b"HTTP/1.1 101 ") and b"UNAUTHORIZED" in answer, answer
        answer = handshake(port, bearer, b"Sec-WebSocket-Extensions: permessage-deflate; "
                           b"client_max_window_bits")
        assert answer.startswith(b"HTTP/1.1 101 ") and b"deflate" not in answer.lower()
        answer = handshake(port, b"X-\xc3\xa9: 1", bearer)  # a header name is ASCII
        assert answer.startswith(b"HTTP/1.1 400 "), answer
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert "Traceback" not in output and "handshake failed" not in output, output
    assert "deprecated" not in output


@pytest.mark.parametrize(("read", "latin1"), [
    ("plain", "plain"),
    ("caf\udcc3\udca9", "caf\u00c3\u00a9"),  # websockets' legacy reading
    ("caf\u00c3\u00a9", "caf\u00c3\u00a9"),  # the reading websockets documents
])
def test_a_header_value_is_given_back_its_bytes_however_websockets_read_them(
        read: str, latin1: str) -> None:
    assert as_latin1(read) == latin1
