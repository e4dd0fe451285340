"""Pull a prompt's KV from ranked prefill workers into a sequence's reserved blocks.

The first prefill candidate is asked over a server stream (Prefill.Prefill); its first token goes
straight to the client, then every KV chunk is validated against the reservation (ranges, byte
length, checksum) before it is written. A candidate that fails in any way (unreachable, refuses,
breaks the stream, sends a bad chunk, ends with KV missing) is abandoned, its stream cancelled, and
the next one is tried; the blocks simply get overwritten. The first token is taken once, from the
first candidate that sends one.

When the prefill worker offers a KV socket (nxdi_common.serving.kv_socket), the chunks are read
from that connection on a worker thread, validated and written exactly as stream chunks are; the
stream still has to end with done. If the connection cannot be made, the prefill worker sends the
chunks on the stream once its offer times out, and this worker stops asking that prefill worker
for a socket for a while (a blocked port then costs one request a delay, not every request)."""
from __future__ import annotations

import logging
import time

import grpc

from decode_service import convert
from decode_service.engine import DecodeEngine
from decode_service.sequence import Sequence
from nxdi_common import kv_transfer
from nxdi_common.serving import kv_socket
from nxdi_common.serving.kv_socket import check_nice as check_receive_nice
from nxdi_common.serving.errors import FailedPrecondition, ServingError, Unavailable

log = logging.getLogger(__name__)

# A KV socket connection is made within ms where it can be made at all; waiting longer than the
# prefill worker's accept timeout only delays the chunks it then sends on the stream.
SOCKET_CONNECT_TIMEOUT_SECONDS = min(1.0, kv_socket.DEFAULT_ACCEPT_TIMEOUT_SECONDS)
SOCKET_RETRY_AFTER_SECONDS = 60.0  # after a failed connection, no socket from that worker


class PrefillChannels:
    """One channel per prefill worker address, reused across requests."""

    def __init__(self, max_message_bytes: int):
        self._options = [("grpc.max_receive_message_length", max_message_bytes),
                         ("grpc.max_send_message_length", max_message_bytes)]
        self._calls: dict[str, object] = {}
        self._channels: list = []

    def prefill(self, address: str):
        """The Prefill.Prefill callable for ``address`` (events arrive as bytes)."""
        if address not in self._calls:
            channel = grpc.aio.insecure_channel(address, options=self._options)
            self._channels.append(channel)
            self._calls[address] = convert.prefill_call(channel)
        return self._calls[address]

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class KVPuller:
    """Runs the pull for one sequence (see the module doc)."""

    def __init__(self, engine: DecodeEngine, channels: PrefillChannels, fingerprint,
                 max_chunk_bytes: int, metrics=None, timeout_seconds: float | None = None,
                 kv_socket: bool = True, receive_nice: int | None = None):
        self.engine, self.channels, self.fingerprint = engine, channels, fingerprint
        self.max_chunk_bytes, self.metrics, self.timeout = max_chunk_bytes, metrics, timeout_seconds
        self.kv_socket = kv_socket  # accept the prefill worker's KV socket offers
        # the OS nice value the KV socket's receiving threads run at (--kv-receive-nice)
        self.receive_nice = check_receive_nice(receive_nice)
        self._no_socket_until: dict[str, float] = {}  # address -> monotonic time
        self.open_transfers = 0

    async def pull(self, seq: Sequence, candidates: tuple[str, ...]) -> bool:
        """Fill seq's prompt KV; False when the first token already finished the sequence.
        Raises when every candidate failed (the code they agree on, else UNAVAILABLE)."""
        failures: list[tuple[str, grpc.StatusCode, str]] = []
        for address in candidates:
            if failures and self.metrics is not None:
                self.metrics.kv_pull_failovers_total.inc()
            try:
                return await self._pull_from(address, seq)
            except grpc.aio.AioRpcError as exc:
                failures.append((address, exc.code(), exc.details() or ""))
            except ServingError as exc:
                failures.append((address, exc.code, str(exc)))
            except kv_transfer.KVChunkError as exc:
                failures.append((address, grpc.StatusCode.FAILED_PRECONDITION, str(exc)))
            log.warning("KV pull of %s from %s failed: %s", seq.request_id, address, failures[-1])
        raise _all_failed(failures)

    async def _pull_from(self, address: str, seq: Sequence) -> bool:
        start = min(seq.num_cached_tokens, seq.prompt_len - 1)
        reservation = kv_transfer.Reservation.for_model(self.fingerprint, seq.request_id,
                                                        seq.prompt_len, start)
        coverage = kv_transfer.KVCoverage(reservation)
        store = self.engine.kv_writer(seq)
        request = convert.prefill_request(seq.job, self.fingerprint, start, self.max_chunk_bytes,
                                          self.accepts_socket(address), seq.banned_ids())
        call = self.channels.prefill(address)(request, timeout=self.timeout)
        self.open_transfers += 1
        began, payload = time.perf_counter(), 0
        try:
            last = None  # the previous event's kind
            # Read on past done to the stream's own end: cancelling as soon as done arrives
            # could cancel the prefill handler before it returns, so a delivered transfer
            # would count as a cancelled one there.
            async for event in call:
                kind, data = convert.prefill_event(event)
                if (last == "done" or (last is None) != (kind == "first_token")
                        or (kind == "kv_socket" and last != "first_token")):
                    raise FailedPrecondition(f"prefill stream out of order: {kind} after "
                                             f"{last or 'nothing'}")
                last = kind
                if kind == "first_token":
                    if self._take_first_token(seq, data):
                        return False
                elif kind == "kv_chunk":
                    payload += self._write_chunk(data, reservation, coverage, store)
                elif kind == "kv_socket":
                    payload += await self._receive_socket(address, data, seq, reservation,
                                                          coverage, store)
            if not coverage.complete:
                raise FailedPrecondition(f"prefill stream from {address} ended with "
                                         f"{coverage.missing()} KV values missing")
            self._observe(payload, time.perf_counter() - began)
            return True
        finally:
            self.open_transfers -= 1
            call.cancel()

    def _take_first_token(self, seq: Sequence, data) -> bool:
        """Emit the first token (once per sequence); True if it ends the sequence."""
        if not seq.generated:
            seq.draw_uniform()  # the prefill worker used this request's first uniform
            token_id, logprob, top, prompt_scores = data
            seq.prompt_logprobs = prompt_scores
            seq.add_token(token_id, logprob, top)
        return seq.finished

    def accepts_socket(self, address: str) -> bool:
        """Whether to ask the prefill worker at ``address`` for a KV socket now."""
        return self.kv_socket and time.monotonic() >= self._no_socket_until.get(address, 0.0)

    async def _receive_socket(self, address: str, offer, seq, reservation, coverage,
                              store) -> int:
        """Read the chunks from the offered KV socket; their payload bytes (0 when it could not
        be reached: they come on the stream then)."""
        port, token = offer
        if not self.kv_socket:
            raise FailedPrecondition("prefill stream offered a kv_socket this worker did not "
                                     "ask for")
        if not 0 < port < 65536 or len(token) != kv_socket.TOKEN_BYTES:
            raise FailedPrecondition(f"kv_socket: port {port} and a {len(token)}-byte token; "
                                     f"expected 1..65535 and {kv_socket.TOKEN_BYTES} bytes")

        def on_frame(frame: memoryview) -> int:
            kind, chunk = convert.prefill_event(frame)
            if kind != "kv_chunk":
                raise FailedPrecondition(f"kv_socket: a frame holds a {kind} event, not a kv_chunk")
            return self._write_chunk(chunk, reservation, coverage, store)

        host = kv_socket.split_host(address)
        try:
            _, payload = await kv_socket.receive(
                host, port, token, on_frame, kv_transfer.max_message_bytes(self.max_chunk_bytes),
                SOCKET_CONNECT_TIMEOUT_SECONDS, nice=self.receive_nice)
        except ConnectionRefusedError as exc:
            self._no_socket_until[address] = time.monotonic() + SOCKET_RETRY_AFTER_SECONDS
            log.warning("%s; the chunks of %s will come on the stream, and %s is not asked for "
                        "a KV socket for %.0f s", exc, seq.request_id, address,
                        SOCKET_RETRY_AFTER_SECONDS)
            return 0
        except OSError as exc:
            raise Unavailable(f"KV socket {host}:{port} of {address} broke: {exc}") from None
        return payload

    @staticmethod
    def _write_chunk(chunk, reservation, coverage, store) -> int:
        write = kv_transfer.decode_chunk(chunk, reservation)
        coverage.add(write)
        store(write)
        return len(chunk.k) + len(chunk.v)

    def _observe(self, payload: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.kv_transfer_bytes_total.inc(payload)
            self.metrics.kv_transfer_duration_seconds.observe(seconds)


def _all_failed(failures) -> ServingError:
    summary = "; ".join(f"{a}: {c.name} {d}" for a, c, d in failures) or "no candidates"
    codes = {c for _, c, _ in failures}
    if codes == {grpc.StatusCode.FAILED_PRECONDITION}:
        return FailedPrecondition(f"every prefill candidate refused the KV transfer: {summary}")
    return Unavailable(f"every prefill candidate failed: {summary}")
