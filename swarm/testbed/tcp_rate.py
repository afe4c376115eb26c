"""A plain TCP transfer between testbed hosts (Python sockets run inside the namespaces): measured goodput.

``python -m swarm.testbed.tcp_rate recv ADDRESS SENDERS WARMUP SECONDS`` listens on ADDRESS (a free port, printed
as ``listening PORT``), accepts SENDERS connections, ignores the first WARMUP s (slow start, htb's burst), counts
the bytes of the next SECONDS s and prints ``{"bytes", "seconds", "bits_per_s"}``, then closes.
``... send ADDRESS PORT MAX_SECONDS`` sends until the receiver closes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarm.testbed.testbed import Host, Testbed

CHUNK = 1 << 20


def receive(address: str, senders: int, warmup: float, seconds: float) -> dict:
    server = socket.socket()
    server.bind((address, 0))
    server.listen(senders)
    print(f"listening {server.getsockname()[1]}", flush=True)
    server.settimeout(30)
    conns = [server.accept()[0] for _ in range(senders)]
    counts = [0] * senders

    def drain(k: int) -> None:
        buf = bytearray(CHUNK)
        try:
            while True:
                got = conns[k].recv_into(buf)
                if not got:
                    return
                counts[k] += got
        except OSError:
            return

    threads = [threading.Thread(target=drain, args=(k,), daemon=True) for k in range(senders)]
    for t in threads:
        t.start()
    time.sleep(warmup)
    t0, b0 = time.monotonic(), sum(counts)
    time.sleep(seconds)
    t1, b1 = time.monotonic(), sum(counts)
    for conn in conns:
        conn.close()
    return {"bytes": b1 - b0, "seconds": t1 - t0, "bits_per_s": (b1 - b0) * 8 / (t1 - t0)}


def send(address: str, port: int, max_seconds: float) -> None:
    conn = socket.create_connection((address, port), timeout=10)
    data = b"\0" * CHUNK
    end = time.monotonic() + max_seconds
    try:
        while time.monotonic() < end:
            conn.sendall(data)
    except OSError:
        pass  # the receiver closed: done


def measure(tb: Testbed, senders: Sequence[Host], receiver: Host, seconds: float = 2.0,
            warmup: float = 0.5) -> dict:
    """Goodput (bits/s) of ``senders`` sending at once to ``receiver`` over TCP, measured at the receiver."""
    python = sys.executable
    recv = tb.popen(receiver, [python, "-m", "swarm.testbed.tcp_rate", "recv", receiver.address, str(len(senders)),
                               str(warmup), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert recv.stdout is not None
    line = recv.stdout.readline().split()
    if len(line) != 2 or line[0] != "listening":
        recv.kill()
        raise RuntimeError(f"the TCP receiver in {receiver.name} did not start (printed {line!r})")
    port = line[1]
    sending = [tb.popen(s, [python, "-m", "swarm.testbed.tcp_rate", "send", receiver.address, port,
                            str(warmup + seconds + 20)]) for s in senders]
    out, _ = recv.communicate(timeout=warmup + seconds + 40)
    for proc in sending:
        try:
            proc.wait(10)
        except Exception:
            proc.kill()
    if recv.returncode != 0:
        raise RuntimeError(f"the TCP receiver in {receiver.name} failed (exit {recv.returncode}): {out[-500:]}")
    return json.loads(out.strip().splitlines()[-1])


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "recv" and len(argv) == 5:
        print(json.dumps(receive(argv[1], int(argv[2]), float(argv[3]), float(argv[4]))), flush=True)
        return 0
    if argv and argv[0] == "send" and len(argv) == 4:
        send(argv[1], int(argv[2]), float(argv[3]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
