"""A streamed completion whose client stops reading once the response has started.

The runtime holds a request's admission slot until its response is sent, so a client that does
not read keeps the request in flight for as long as it likes once the stream outgrows the socket
buffers: tests that need a request in flight get one without racing the engine (which finishes
the demo model's tokens in a second or two). A 4 KiB receive buffer and a stream of about 7 MB
(16 sequences of 1,000 tokens with logprobs; the server needs MAX_MODEL_LEN 2048) make sure the
sender blocks: the kernel buffers at most 4 MiB of it here (net.ipv4.tcp_wmem).
"""

from __future__ import annotations

import json
import socket


class HeldStream:
    BODY = {
        "model": "demo",
        "prompt": "Once upon a time",
        "max_tokens": 1000,
        "ignore_eos": True,
        "n": 16,
        "logprobs": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    TOKENS = BODY["n"] * BODY["max_tokens"]

    def __init__(
        self, url: str, headers: dict[str, str] | None = None, **body_overrides: object
    ) -> None:
        """``body_overrides``: fields of BODY to change (``n=32`` for a server whose MAX_N
        allows it; keep the stream well over 4 MiB)."""
        self.body = {**self.BODY, **body_overrides}
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(120)
        self.sock.connect((host, int(port)))
        body = json.dumps(self.body).encode()
        head = [
            "POST /v1/completions HTTP/1.1",
            f"host: {host}",
            "content-type: application/json",
            f"content-length: {len(body)}",
            "connection: close",
            *(f"{name}: {value}" for name, value in (headers or {}).items()),
        ]
        self.sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        self.received = self.sock.recv(4096)
        self.status = int(self.received.split(b" ", 2)[1])

    def finish(self) -> int:
        """Read the rest; return the completion tokens of the final usage chunk."""
        chunks = [self.received]
        while chunk := self.sock.recv(1 << 20):
            chunks.append(chunk)
        self.sock.close()
        self.events = [
            line[6:] for line in b"".join(chunks).split(b"\n") if line.startswith(b"data: ")
        ]
        tokens = 0
        for event in self.events:
            if event.startswith(b"{") and b'"usage":{' in event:
                tokens = json.loads(event)["usage"]["completion_tokens"]
        return tokens
