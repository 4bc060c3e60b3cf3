"""Where a stream whose client never reads piles up, and when it ends: `python -m bench.lab.slow_reader`.

    python -m bench.lab.slow_reader --seconds 110
    LMSERVE_HAPROXY_SOCKET_BUFFER_BYTES=16384 LMSERVE_HAPROXY_TIMEOUT_CLIENT_S=15 python -m bench.lab.slow_reader

Starts `lmserve serve` of the default model as the attack suite does (bench/attack.py: HAProxy
in front of a direct-streaming replica, an API key), sends one streamed chat of 2000 tokens on a
raw socket with a 4 KiB receive buffer and never reads it, and every 5 s prints the kernel's
queues (`ss -tn`): the client's receive queue, HAProxy's send queue to the client, and the
queues of the connection between HAProxy and the replica (Serve's direct-ingress ports
30000-31000), so the output shows where the stream's bytes sit and when a side is closed.
LMSERVE_* variables in the environment reach the server.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from bench.attack import API_KEY, LmserveApi, chat, free_port


def queues(local_port: int) -> tuple[list, list]:
    """(`ss` rows of the client's connection, rows of HAProxy-replica connections with bytes queued)."""
    rows = [line.split() for line in subprocess.run(["ss", "-tnH"], capture_output=True, text=True).stdout.splitlines()]
    client = [r[:5] for r in rows if f":{local_port}" in r[3] or f":{local_port}" in r[4]]
    replica = [r[:5] for r in rows if r[1:3] != ["0", "0"]
               and any(30000 <= int(addr.rsplit(":", 1)[1]) <= 31000 for addr in r[3:5])]
    return client, replica


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=110)
    args = parser.parse_args()
    api = LmserveApi(Path(tempfile.mkdtemp(prefix="slow-reader-")), free_port())
    print(f"lmserve serve ready in {api.start():.0f} s", flush=True)
    try:
        body = json.dumps(chat(max_tokens=2000)).encode()
        request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   f"authorization: Bearer {API_KEY}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
        sock = socket.create_connection(("127.0.0.1", api.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(request)
        local_port = sock.getsockname()[1]
        start = time.monotonic()
        print("  s  state/recv-q/send-q of client<->HAProxy | HAProxy<->replica (queued bytes only)")
        while time.monotonic() - start < args.seconds:
            client, replica = queues(local_port)
            print(f"{time.monotonic() - start:3.0f}", " ".join("/".join(r[:3]) for r in client), "|",
                  " ".join("/".join(r[:3]) for r in replica), flush=True)
            time.sleep(5)
        sock.close()
    finally:
        api.stop()


if __name__ == "__main__":
    main()
