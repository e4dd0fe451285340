"""The KV socket (nxdi_common.serving.kv_socket) on real loopback sockets: the listener hands a
connection only to the offer whose token it shows; frames carry exactly the chunk events of the
stream; the receiver refuses oversize and cut frames; cancelling either end stops its thread
before returning."""
import asyncio
import os
import socket
import threading
import time

import pytest
import torch

from nxdi_common import kv_transfer
from nxdi_common.serving import kv_socket


def kv(layers=3, tokens=40, heads=2, dim=8, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, tokens, heads, dim, generator=g).to(dtype),
            torch.randn(layers, tokens, heads, dim, generator=g).to(dtype))


def keep_into(chunks):
    def keep(frame):
        chunk = kv_transfer.chunk_from_event_bytes(bytes(frame))
        assert chunk is not None
        chunks.append(chunk)
        return len(chunk.k) + len(chunk.v)
    return keep


@pytest.mark.parametrize("max_chunk_bytes", [256, 1 << 20])
def test_offered_chunks_arrive_whole_and_in_order(max_chunk_bytes):
    k, v = kv()

    async def scenario():
        server = kv_socket.KVSocketServer(accept_timeout=5)
        port = await server.start("127.0.0.1", 0)
        offer = server.offer()
        received = []
        receiving = asyncio.ensure_future(kv_socket.receive(
            "127.0.0.1", port, offer.token, keep_into(received), 1 << 21))
        conn = await server.claimed(offer)
        assert conn is not None
        chunks = kv_transfer.encode_chunks("r", k, v, max_chunk_bytes=max_chunk_bytes)
        sent = await kv_socket.send(conn, chunks)
        got = await receiving
        await server.stop()
        return sent, got, received

    sent, got, received = asyncio.run(scenario())
    assert sent == got and got[0] == len(received) > (1 if max_chunk_bytes == 256 else 0)
    expected = list(kv_transfer.encode_chunks("r", k, v, max_chunk_bytes=max_chunk_bytes))
    assert [kv_transfer.chunk_event_bytes(c) for c in received] == \
        [kv_transfer.chunk_event_bytes(c) for c in expected]
    res = kv_transfer.Reservation.for_model(
        kv_transfer.ModelFingerprint("m", 3, 2, 8, "bfloat16"), "r", 40)
    out_k, out_v = torch.zeros_like(k), torch.zeros_like(v)
    for chunk in received:
        w = kv_transfer.decode_chunk(chunk, res)
        out_k[w.layers, w.tokens], out_v[w.layers, w.tokens] = w.k, w.v
    assert torch.equal(out_k, k) and torch.equal(out_v, v)


def test_the_receiving_thread_runs_at_the_nice_value_asked_for():
    """receive(nice=N) reads and hands over every frame on a thread of OS nice N (a decode
    worker's --kv-receive-nice), and the default pool's threads keep the process's own; a nice
    outside 0-19 is refused before anything connects."""
    k, v = kv()

    def nice_here() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def one(nice):
        server = kv_socket.KVSocketServer(accept_timeout=5)
        port = await server.start("127.0.0.1", 0)
        offer = server.offer()
        seen = []

        def on_frame(frame):
            seen.append(nice_here())
            return keep_into([])(frame)
        receiving = asyncio.ensure_future(kv_socket.receive(
            "127.0.0.1", port, offer.token, on_frame, 1 << 21, nice=nice))
        conn = await server.claimed(offer)
        await kv_socket.send(conn, kv_transfer.encode_chunks("r", k, v, max_chunk_bytes=256))
        await receiving
        await server.stop()
        return seen

    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert set(asyncio.run(one(11))) == {max(own, 11)}
    assert set(asyncio.run(one(None))) == {own}
    for bad in (-1, 20, 2.5, True):
        with pytest.raises(ValueError, match=r"KV receive nice must be an integer in \[0, 19\]"):
            asyncio.run(kv_socket.receive("127.0.0.1", 1, bytes(16), keep_into([]), 1 << 20,
                                          nice=bad))


def test_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    k, v = kv(layers=1, tokens=8)

    async def scenario():
        server = kv_socket.KVSocketServer(accept_timeout=5)
        try:
            port = await server.start("[::1]", 0)
        except OSError as exc:
            pytest.skip(f"cannot listen on ::1: {exc}")
        offer = server.offer()
        received = []
        receiving = asyncio.ensure_future(kv_socket.receive(
            kv_socket.split_host(f"[::1]:{port}"), port, offer.token, keep_into(received), 1 << 20))
        await kv_socket.send(await server.claimed(offer), kv_transfer.encode_chunks("r", k, v))
        frames = await receiving
        await server.stop()
        return frames, received

    frames, received = asyncio.run(scenario())
    assert frames[0] == len(received) == 1


def test_unclaimed_offer_times_out_and_wrong_tokens_are_closed():
    async def scenario():
        server = kv_socket.KVSocketServer(accept_timeout=0.3)
        port = await server.start("127.0.0.1", 0)
        offer = server.offer()
        wrong = await kv_socket.receive("127.0.0.1", port, bytes(16), keep_into([]), 1 << 20)
        claimed = await server.claimed(offer)
        late = await kv_socket.receive("127.0.0.1", port, offer.token, keep_into([]), 1 << 20)
        await server.stop()
        return wrong, claimed, late

    wrong, claimed, late = asyncio.run(scenario())
    assert wrong == (0, 0) and claimed is None and late == (0, 0)


def test_settings_and_hosts():
    with pytest.raises(ValueError, match="accept_timeout"):
        kv_socket.KVSocketServer(accept_timeout=0)
    assert kv_socket.split_host("10.0.0.5:50051") == "10.0.0.5"
    assert kv_socket.split_host("[::1]:50051") == "::1"
    assert kv_socket.split_host("prefill-0.prefill.ns.svc:50051") == "prefill-0.prefill.ns.svc"


class RawSender:
    """A hand-made KV socket peer: accepts one connection, reads HELLO + token, then runs
    ``script(conn)`` on a thread."""

    def __init__(self, script):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.hello = b""
        self.thread = threading.Thread(target=self._run, args=(script,), daemon=True)
        self.thread.start()

    def _run(self, script):
        conn, _ = self.listener.accept()
        with conn:
            while len(self.hello) < len(kv_socket.HELLO) + kv_socket.TOKEN_BYTES:
                self.hello += conn.recv(64)
            script(conn)

    def close(self):
        self.thread.join(10)
        self.listener.close()


def one_frame():
    k, v = kv(layers=1, tokens=4)
    data = kv_transfer.chunk_event_bytes(next(iter(kv_transfer.encode_chunks("r", k, v))))
    return kv_socket.FRAME.pack(len(data)) + data


@pytest.mark.parametrize("how, error, match", [
    ("oversize", kv_transfer.KVChunkError, "kv_socket.: frame of 2097152"),
    ("empty", kv_transfer.KVChunkError, "kv_socket.: frame of 0 "),
    ("cut", kv_socket.KVSocketClosed, "mid-frame"),
])
def test_bad_frames_are_refused(how, error, match):
    frame = one_frame()
    payload = {"oversize": kv_socket.FRAME.pack(1 << 21) + bytes(64),
               "empty": kv_socket.FRAME.pack(0), "cut": frame + frame[:-10]}[how]
    peer = RawSender(lambda conn: conn.sendall(payload))
    received = []
    try:
        with pytest.raises(error, match=match):
            asyncio.run(kv_socket.receive("127.0.0.1", peer.port, b"t" * 16, keep_into(received),
                                          1 << 20))
    finally:
        peer.close()
    assert peer.hello == kv_socket.HELLO + b"t" * 16
    assert len(received) == (1 if how == "cut" else 0)  # the whole frame before the cut was taken


def test_unreachable_socket_is_connection_refused():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed below: nothing listens there afterwards
    with pytest.raises(ConnectionRefusedError, match=f"127.0.0.1:{port}"):
        asyncio.run(kv_socket.receive("127.0.0.1", port, bytes(16), keep_into([]), 1 << 20))


def test_cancelled_receive_returns_after_its_thread_stopped():
    frame = one_frame()
    release = threading.Event()

    def script(conn):
        conn.sendall(frame)
        release.wait(10)  # stall mid-transfer until the receiver was cancelled
        try:
            conn.sendall(frame * 4)
        except OSError:
            pass

    peer = RawSender(script)
    received = []

    async def scenario():
        task = asyncio.ensure_future(kv_socket.receive("127.0.0.1", peer.port, bytes(16),
                                                       keep_into(received), 1 << 20))
        while not received:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - started < 5
    release.set()
    peer.close()
    time.sleep(0.1)
    assert len(received) == 1  # nothing was handed on after the cancellation returned


def test_cancelled_send_closes_the_connection():
    k, v = kv(layers=8, tokens=4096, heads=8, dim=64)  # 64 MiB: far beyond the socket buffers

    async def scenario():
        server = kv_socket.KVSocketServer(accept_timeout=5)
        port = await server.start("127.0.0.1", 0)
        offer = server.offer()
        reader = socket.create_connection(("127.0.0.1", port))
        reader.sendall(kv_socket.HELLO + offer.token)
        conn = await server.claimed(offer)
        sending = asyncio.ensure_future(kv_socket.send(
            conn, kv_transfer.encode_chunks("r", k, v, max_chunk_bytes=1 << 20)))
        await asyncio.sleep(0.3)  # stalled: nobody reads
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending
        await server.stop()
        return reader, conn

    reader, conn = asyncio.run(scenario())
    assert conn.fileno() == -1  # closed by send
    got = 0
    reader.settimeout(10)
    with reader:
        try:
            while chunk := reader.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
    assert 0 < got < 2 * k.numel() * k.element_size()  # some, not all, then the end


def _sysctl(name: str, fallback: int) -> int:
    try:
        return int(open(f"/proc/sys/net/core/{name}").read())
    except OSError:
        return fallback


def test_both_ends_set_their_buffers_and_the_sender_sends_at_once():
    """A transfer runs on a new connection, whose buffers would start at the system defaults
    and grow only as autotuning catches up: the receiver sets its receive buffer before it
    connects, the sender its send buffer and TCP_NODELAY (no frame tail held back)."""
    want = kv_socket.SOCKET_BUFFER_BYTES
    with socket.create_server(("127.0.0.1", 0)) as listener:
        receiver = kv_socket._connect("127.0.0.1", listener.getsockname()[1], 5.0)
        conn, _ = listener.accept()
        with receiver, conn:
            assert kv_socket.send_chunks(conn, []) == (0, 0)
            assert receiver.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= \
                min(want, _sysctl("rmem_max", want))
            assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= \
                min(want, _sysctl("wmem_max", want))
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert receiver.recv(1) == b""  # the sender closed its side after no chunks
