"""Loopback TCP on a fresh connection, default socket buffers against the KV socket's explicit
ones (nxdi_common.serving.kv_socket.SOCKET_BUFFER_BYTES), alternating within one run.

    python bench/bench_socket_buffers.py [--pairs 20]

Each transfer is what one 1024-token prompt of the bundled model moves over the KV socket (30
frames of 786,476 bytes) on a new connection, sender pinned to CPU 0 and receiver to CPU 1 as
bench_kv_transfer.py places them. A new connection's buffers start at the tcp_rmem / tcp_wmem
defaults and autotuning grows them as the transfer goes; setting them before connecting skips
that ramp. Prints the median of each and the median of the per-pair ratios."""
from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nxdi_common.serving.kv_socket import SOCKET_BUFFER_BYTES  # noqa: E402

FRAMES, FRAME_BYTES = 30, 786_476


def _sender(ports, configs) -> None:
    os.sched_setaffinity(0, {0})
    listener = socket.create_server(("127.0.0.1", 0))
    ports.put(listener.getsockname()[1])
    frame = os.urandom(FRAME_BYTES)
    while (explicit := configs.get()) is not None:
        conn, _ = listener.accept()
        with conn:
            if explicit:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            for _ in range(FRAMES):
                conn.sendall(frame)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # wait for the receiver to close


def _receive(port: int, explicit: bool, buf: bytearray) -> float:
    """Bytes/s of one transfer on a new connection."""
    sock = socket.socket()
    with sock:
        if explicit:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        start = time.perf_counter()
        sock.connect(("127.0.0.1", port))
        view, total = memoryview(buf), 0
        while n := sock.recv_into(view):
            total += n
        return total / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=20)
    args = parser.parse_args(argv)
    ports, configs = multiprocessing.Queue(), multiprocessing.Queue()
    sender = multiprocessing.Process(target=_sender, args=(ports, configs), daemon=True)
    sender.start()
    port = ports.get()
    os.sched_setaffinity(0, {1})
    buf, rates = bytearray(FRAME_BYTES), {False: [], True: []}
    for pair in range(args.pairs + 1):  # the first pair is warm-up
        for explicit in ((False, True) if pair % 2 else (True, False)):
            configs.put(explicit)
            rate = _receive(port, explicit, buf)
            if pair:
                rates[explicit].append(rate)
    configs.put(None)
    sender.join()
    med = statistics.median
    ratio = med(e / d for d, e in zip(rates[False], rates[True]))
    print(f"{args.pairs} pairs: default buffers {med(rates[False]) / 1e9:.2f} GB/s, "
          f"{SOCKET_BUFFER_BYTES >> 20} MiB buffers {med(rates[True]) / 1e9:.2f} GB/s, "
          f"per-pair ratio {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
