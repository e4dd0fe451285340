"""KV chunks over a direct TCP connection: the data path a Prefill stream may hand its KV to.

The Prefill stream stays the control path (fingerprint check, first token, done, cancellation);
only the chunk bytes move to a plain TCP connection, because Python gRPC carries bulk bytes at
about a quarter of what loopback TCP does on this machine class (HTTP/2 framing, flow-control
window updates that wait on busy event loops, a Python object per message), which the issue's
transfer target (half of raw TCP) is above. Frames hold exactly the serialized PrefillEvent
bytes the stream would have carried, so the receiver validates every chunk the same way.

Protocol (also in serving.proto, message KVSocket): the prefill worker offers a one-time 16-byte
token on the stream; the decode worker connects to the offered port on the host it reached the
prefill worker at, sends ``HELLO`` then the token, and reads frames (little-endian uint32 length,
then the event) until the prefill worker closes the connection. A connection presenting anything
else is closed. If nobody claims an offer within the accept timeout, the prefill worker sends the
chunks on the stream after all, so a blocked port costs time, never the request.

Both ends move bytes on a worker thread with a blocking socket (the event loop keeps serving
other streams); cancelling the awaiting coroutine shuts the socket down and waits for the thread,
so nothing touches the KV (or, on the decode worker, the sequence's blocks) after it returns."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from nxdi_common import kv_transfer
from nxdi_common.kv_transfer import KVChunkError
from nxdi_common.serving import thread_priority

log = logging.getLogger(__name__)

HELLO = b"NXDIKV01"
TOKEN_BYTES = 16
FRAME = struct.Struct("<I")
DEFAULT_ACCEPT_TIMEOUT_SECONDS = 2.0  # the decode worker connects within ms; this is a fallback
# Payloads below this go on the stream: a connection costs ~1.5 ms more than the stream's
# messages for a 16-token prompt's 0.37 MB and saves ~1 ms at 128 tokens' 2.9 MB (SmolLM2, bf16,
# bench/bench_kv_transfer.py --short-prompts, Zen 4 VM).
DEFAULT_MIN_PAYLOAD_BYTES = 1 << 20
HANDSHAKE_TIMEOUT_SECONDS = 5.0  # an accepted connection must present its token within this
# Every transfer is a new connection, whose buffers start at the system defaults (16 KiB send,
# 128 KiB receive here) and grow only as autotuning catches up; setting them at once moved a
# prompt's 23.6 MB 1.05-1.07x faster (bench/bench_socket_buffers.py, Zen 4 VM).
SOCKET_BUFFER_BYTES = 4 << 20
IO_TIMEOUT_SECONDS = 60.0  # a peer that stops reading or sending for this long is dropped
# Threads that move KV bytes, apart from asyncio's default executor so that many open transfers
# (each waits on its socket most of the time) never hold up other work sent to threads; one
# pool per OS nice value the transfers run at (receive's ``nice``).
MAX_TRANSFER_THREADS = 32
_executors: dict[int | None, ThreadPoolExecutor] = {}
_executor_lock = threading.Lock()


def check_nice(nice: int | None) -> int | None:
    """ValueError naming the setting unless ``nice`` is None or an OS nice value in NICE_RANGE."""
    return thread_priority.check_nice(nice, "KV receive nice", "the process's own")


def _transfer_thread(nice: int | None) -> None:
    """A transfer thread's start: the kernel's default slice (thread_priority.mark_bulk_thread)
    and, if given, nice ``nice`` (Linux: per thread); a warning where the OS refuses it."""
    thread_priority.mark_bulk_thread()
    if nice is None:
        return
    try:
        thread_priority.set_thread_priority(nice)
    except (OSError, AttributeError) as exc:
        log.warning("KV socket threads keep their nice value: setting %d failed: %s", nice, exc)


def _transfer_executor(nice: int | None = None) -> ThreadPoolExecutor:
    with _executor_lock:
        if nice not in _executors:
            _executors[nice] = ThreadPoolExecutor(
                MAX_TRANSFER_THREADS,
                thread_name_prefix="kv-socket" if nice is None else f"kv-socket-nice{nice}",
                initializer=_transfer_thread, initargs=(nice,))
        return _executors[nice]


class KVSocketClosed(ConnectionError):
    """The peer closed the connection or a cancellation shut it down."""


def split_host(address: str) -> str:
    """The host of "host:port" or "[v6]:port" (brackets removed)."""
    return _unbracket(address.rsplit(":", 1)[0] if ":" in address else address)


def _unbracket(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


# --------------------------------------------------------------------------- sending (prefill)


@dataclass
class Offer:
    """One transfer's claim ticket: ``token`` to send on the stream, ``claimed`` resolves to the
    connected socket."""

    token: bytes
    claimed: asyncio.Future = field(repr=False)


class KVSocketServer:
    """The prefill worker's listener: hands each connection to the offer whose token it shows."""

    def __init__(self, accept_timeout: float = DEFAULT_ACCEPT_TIMEOUT_SECONDS):
        if accept_timeout <= 0:
            raise ValueError(f"accept_timeout must be > 0 seconds, got {accept_timeout}")
        self.accept_timeout = accept_timeout
        self.port = 0
        self._offers: dict[bytes, Offer] = {}
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on host:port (0: a free port; an IPv6 host bare or bracketed); returns the
        bound port."""
        host = _unbracket(host)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), family=family, backlog=64)
        listener.setblocking(False)
        self._listener, self.port = listener, listener.getsockname()[1]
        self._spawn(self._accept_loop(listener))
        return self.port

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for offer in list(self._offers.values()):
            self.withdraw(offer)

    def offer(self) -> Offer:
        """A new one-time token; withdraw it when done with it (claimed or not)."""
        token = secrets.token_bytes(TOKEN_BYTES)
        offer = Offer(token, asyncio.get_running_loop().create_future())
        self._offers[token] = offer
        return offer

    def withdraw(self, offer: Offer) -> None:
        """Forget ``offer``; a connection that claimed it and was not taken is closed."""
        self._offers.pop(offer.token, None)
        if offer.claimed.done() and not offer.claimed.cancelled():
            offer.claimed.result().close()
        else:
            offer.claimed.cancel()

    async def claimed(self, offer: Offer) -> socket.socket | None:
        """The socket that claimed ``offer``, or None when none did within the accept timeout
        (the offer is withdrawn either way; a claim racing the timeout still counts)."""
        try:
            await asyncio.wait_for(asyncio.shield(offer.claimed), self.accept_timeout)
        except asyncio.TimeoutError:
            pass
        except BaseException:
            self.withdraw(offer)
            raise
        self._offers.pop(offer.token, None)
        if offer.claimed.done() and not offer.claimed.cancelled():
            return offer.claimed.result()
        offer.claimed.cancel()
        return None

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError:
                if self._listener is None:
                    return  # stopped
                log.exception("KV socket accept failed")
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._handshake(conn))

    async def _handshake(self, conn: socket.socket) -> None:
        """Read HELLO + token; give the socket to its offer, else close it."""
        conn.setblocking(False)
        try:
            hello = await asyncio.wait_for(_read_async(conn, len(HELLO) + TOKEN_BYTES),
                                           HANDSHAKE_TIMEOUT_SECONDS)
        except (OSError, asyncio.TimeoutError):  # KVSocketClosed is an OSError
            conn.close()
            return
        offer = self._offers.get(hello[len(HELLO):]) if hello[:len(HELLO)] == HELLO else None
        if offer is None or offer.claimed.done():
            log.warning("KV socket: closed a connection with an unknown or used token")
            conn.close()
            return
        self._offers.pop(offer.token, None)
        offer.claimed.set_result(conn)


async def _read_async(conn: socket.socket, size: int) -> bytes:
    loop, buf = asyncio.get_running_loop(), bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = await loop.sock_recv_into(conn, view[got:])
        if n == 0:
            raise KVSocketClosed("peer closed the connection during the handshake")
        got += n
    return bytes(buf)


def _chunk_frame(chunk: kv_transfer.KVChunkData) -> list:
    """The frame of one chunk as buffers for sendmsg: length, event header, K, V prefix, V."""
    parts = kv_transfer.chunk_event_parts(chunk)
    return [FRAME.pack(sum(len(p) for p in parts)), *parts]


def _send_all(conn: socket.socket, buffers: list) -> None:
    """sendmsg until every byte of ``buffers`` is sent (no copies on our side)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = conn.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]


def send_chunks(conn: socket.socket, chunks: Iterable[kv_transfer.KVChunkData],
                on_sent: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Send every chunk as a frame, then close the write side (blocking; run it on a thread).
    Returns (chunks, payload bytes); ``on_sent(payload)`` after each chunk."""
    conn.setblocking(True)
    conn.settimeout(IO_TIMEOUT_SECONDS)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    count = total = 0
    for chunk in chunks:
        _send_all(conn, _chunk_frame(chunk))
        size = len(chunk.k) + len(chunk.v)
        count, total = count + 1, total + size
        if on_sent is not None:
            on_sent(size)
    conn.shutdown(socket.SHUT_WR)
    return count, total


# --------------------------------------------------------------------------- receiving (decode)


class _Stoppable:
    """A socket a blocking thread works on, and the flag that tells it to stop."""

    def __init__(self):
        self.sock: socket.socket | None = None
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


def _recv_exact(sock: socket.socket, view: memoryview, at_frame_start: bool = False) -> bool:
    """Fill ``view``; False on a clean end of stream before its first byte (at_frame_start)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0 and at_frame_start:
                return False
            raise KVSocketClosed(f"connection closed mid-frame ({got} of {len(view)} bytes)")
        got += n
    return True


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    """socket.create_connection, with the receive buffer set before connecting (the window scale
    is agreed in the handshake): each address of ``host`` in turn, the last error if none."""
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
            sock.settimeout(timeout)
            sock.connect(address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error


def _receive_blocking(host: str, port: int, token: bytes, on_frame: Callable[[memoryview], int],
                      max_frame_bytes: int, connect_timeout: float, state: _Stoppable):
    try:
        sock = _connect(host, port, connect_timeout)
    except OSError as exc:
        raise ConnectionRefusedError(f"cannot connect to the KV socket {host}:{port}: "
                                     f"{exc}") from exc
    state.sock = sock
    with sock:
        if state.stopped.is_set():
            raise KVSocketClosed("cancelled")
        sock.settimeout(IO_TIMEOUT_SECONDS)
        sock.sendall(HELLO + token)
        header, buf = bytearray(FRAME.size), bytearray(0)
        frames = payload = 0
        while _recv_exact(sock, memoryview(header), at_frame_start=True):
            size = FRAME.unpack(header)[0]
            if not 0 < size <= max_frame_bytes:
                raise KVChunkError("kv_socket", f"frame of {size} bytes; this worker accepts "
                                                f"1..{max_frame_bytes}")
            if len(buf) < size:
                buf = bytearray(size)
            frame = memoryview(buf)[:size]
            _recv_exact(sock, frame)
            if state.stopped.is_set():
                raise KVSocketClosed("cancelled")
            payload += on_frame(frame)  # must be done with the buffer when it returns
            frames += 1
        return frames, payload


async def receive(host: str, port: int, token: bytes, on_frame: Callable[[memoryview], int],
                  max_frame_bytes: int, connect_timeout: float = 5.0,
                  nice: int | None = None) -> tuple[int, int]:
    """Connect, claim ``token``, and pass each frame (a serialized PrefillEvent, a view valid only
    during the call) to ``on_frame``, which returns its payload bytes; on a worker thread, at OS
    nice ``nice`` if given (a decode worker's --kv-receive-nice). Returns (frames, payload bytes)
    once the sender closed the connection. ConnectionRefusedError when the connection cannot be
    made (nothing was received); KVSocketClosed or OSError when it broke; whatever ``on_frame``
    raises. Cancelling returns only after the thread stopped."""
    state = _Stoppable()
    return await _on_thread(state, _receive_blocking, host, port, token, on_frame,
                            max_frame_bytes, connect_timeout, state,
                            executor=_transfer_executor(check_nice(nice)))


async def send(conn: socket.socket, chunks: Iterable[kv_transfer.KVChunkData],
               on_sent: Callable[[int], None] | None = None) -> tuple[int, int]:
    """send_chunks on a worker thread; the socket is closed when it returns or is cancelled
    (cancelling returns only after the thread stopped)."""
    state = _Stoppable()
    state.sock = conn
    try:
        return await _on_thread(state, send_chunks, conn, chunks, on_sent)
    finally:
        conn.close()


async def _on_thread(state: _Stoppable, fn, *args, executor: ThreadPoolExecutor | None = None):
    """fn(*args) on a transfer thread (of ``executor``, else the default pool); on cancellation
    stop ``state`` (its socket shut down) and wait for the thread to return before re-raising."""
    work = asyncio.get_running_loop().run_in_executor(executor or _transfer_executor(), fn, *args)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        state.stop()
        with contextlib.suppress(BaseException):
            await work
        raise
