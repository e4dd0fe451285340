"""Send one routed request to a decode worker and stream its tokens back.

The decode workers are tried in the policy's order: RESOURCE_EXHAUSTED before the first token
means "full, try the next one"; UNAVAILABLE before the first token marks the worker unhealthy and
tries the next. When every worker refused, the request waits its turn in the admission queue
(router/admission.py) and tries again as room comes; it is shed with Overloaded (HTTP 429) when
none comes within the queue's timeout (at once with --queue-timeout-seconds 0).
Whatever ends the stream early (the client going away, a deadline, an error) cancels the
downstream call: no decode call is ever left running for a caller that stopped listening.

Choices of one prompt (``n`` > 1) share its prefill (:class:`SharedPrompt`): the first is
routed as usual; the others wait until the prompt's KV is in that decode worker's prefix cache
(the first choice's second token, or its end) and try that worker first, which then finds every
full block of the prompt cached and computes only the rest itself (its cached-prefix rule),
instead of every choice prefilling the whole prompt again.

Every request ends with one line on the ``router.requests`` logger (INFO; the router's
--no-request-log turns it off): its id, outcome (ok, cancelled, rejected, error), decode worker,
where its prompt was sent to be prefilled (the prefill worker offered first, or ``local`` when
none was offered and the decode worker prefilled it itself: conditional disaggregation, no
prefill worker up, or none at all), prompt / cached / output tokens, finish reason, time to
first token and end-to-end latency, where the local prefill rule weighed the two sides their
estimated seconds to finish the prompt (``eta=local:1.90s,prefill:4.10s``: a local prompt whose
first token came far later than its estimate shows a decode worker's reported rate was off), and
the error when there was one. Text never appears in it."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from nxdi_common.serving.errors import Overloaded, ServingError, Unavailable
from nxdi_common.serving.types import ADMITTED_METADATA_KEY, TokenOutput
from router import convert
from router.admission import AdmissionQueue
from router.frontend import RoutedRequest
from router.policies import DECODE, PREFILL, LocalChoice, LocalPrefillRule, WorkerState

# Routes between two calls of the policy's forget_workers (dropping what it keeps about workers
# discovery no longer lists: with DNS discovery pods come and go by address).
FORGET_EVERY_ROUTES = 1024

log = logging.getLogger(__name__)
request_log = logging.getLogger("router.requests")
HTTP_FOR_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


class WorkerError(ServingError):
    """A decode worker's failure, passed on with the worker's status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.http_status = HTTP_FOR_CODE.get(code, 500)


def worker_error(exc: grpc.aio.AioRpcError, address: str) -> WorkerError:
    return WorkerError(exc.code(), f"decode worker {address}: {exc.details()}")


class _Tracker:
    """Records one request's metrics: TTFT, inter-token gaps, end-to-end latency, token counts,
    outcome; and the queue depth (requests waiting for their first token)."""

    def __init__(self, metrics, prompt_tokens: int, started: float):
        self.metrics, self.started, self.last, self.first = metrics, started, None, None
        self.prompt_tokens, self.tokens = prompt_tokens, 0
        self.expected_cached: int | None = None  # the policy's belief when it routed it
        self.prefill = "-"  # the prefill worker offered first, "local", or "-" (never routed)
        self.eta = ""  # LocalChoice.note() where the local prefill rule weighed both sides
        metrics.queue_depth_requests.inc()

    def token(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.first = now
            self.metrics.queue_depth_requests.dec()
            self.metrics.time_to_first_token_seconds.observe(now - self.started)
        else:
            self.metrics.inter_token_latency_seconds.observe(now - self.last)
        self.last, self.tokens = now, self.tokens + 1

    def finish(self, outcome: str, last: TokenOutput | None = None) -> None:
        m = self.metrics
        if self.last is None:
            m.queue_depth_requests.dec()
        m.requests_total.inc(outcome)
        m.generated_tokens_total.inc(self.tokens)
        if outcome == "ok":
            m.prompt_tokens_total.inc(self.prompt_tokens)
            m.e2e_request_latency_seconds.observe(time.monotonic() - self.started)
            usage = last.usage if last is not None else None
            if self.expected_cached is not None and usage is not None:
                m.expected_cached_tokens_total.inc(self.expected_cached)
                m.cached_prompt_tokens_total.inc(usage.cached_prompt_tokens)

    def log(self, request_id: str, outcome: str, address: str, last: TokenOutput | None,
            error: str) -> None:
        """The request's line on the router.requests logger (module doc)."""
        if not request_log.isEnabledFor(logging.INFO):
            return
        usage = last.usage if last is not None else None
        ttft = "-" if self.first is None else f"{self.first - self.started:.3f}s"
        request_log.info(
            "request %s %s decode=%s prefill=%s prompt=%d cached=%s output=%d finish=%s ttft=%s "
            "e2e=%.3fs%s%s", request_id, outcome, address or "-", self.prefill,
            self.prompt_tokens, usage.cached_prompt_tokens if usage else "-", self.tokens,
            (last.finish_reason if last is not None else None) or "-", ttft,
            time.monotonic() - self.started, f" eta={self.eta}" if self.eta else "",
            f" error={error!r}" if error else "")


@dataclass(eq=False)
class SharedPrompt:
    """The choices of one prompt (module doc): the first request given it leads; ``address``
    is the decode worker that took it, ``ready`` is set once its prompt's KV is there (or it
    ended: then the others route as usual)."""

    address: str = ""
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    led: bool = False

    def lead(self) -> bool:
        """True for the first caller: that request leads."""
        first, self.led = not self.led, True
        return first


class Dispatcher:
    """Routes requests over the registry's workers with a policy, and records router metrics."""

    def __init__(self, registry, policy, metrics, request_timeout_seconds: float = 600.0,
                 local_prefill: LocalPrefillRule = LocalPrefillRule(),
                 admission: AdmissionQueue | None = None):
        if request_timeout_seconds <= 0:
            raise ValueError(f"request_timeout_seconds must be > 0, got {request_timeout_seconds}")
        self.registry, self.policy, self.metrics = registry, policy, metrics
        self.request_timeout_seconds = request_timeout_seconds
        self.local_prefill = local_prefill
        self.admission = admission if admission is not None else AdmissionQueue()
        self._routed = 0

    def plan(self, req: RoutedRequest) -> tuple[list[WorkerState], list[WorkerState]]:
        """Decode workers to try, best first, and the prefill candidates, best first."""
        decodes = self.policy.rank_decode(req.prompt_ids, self.registry.workers(DECODE),
                                          req.cache_salt)
        prefills = self.policy.rank_prefill(req.prompt_ids, self.registry.workers(PREFILL),
                                            req.cache_salt)
        return decodes, prefills

    def unhealthy_reason(self) -> str:
        """Why no decode worker can take requests ("" when at least one is healthy)."""
        workers = self.registry.workers(DECODE)
        if not workers:
            return "no decode workers are configured or discovered"
        if any(w.healthy for w in workers):
            return ""
        return "no healthy decode worker: " + "; ".join(f"{w.address} ({w.reason})"
                                                        for w in workers)

    async def generate(self, req: RoutedRequest, timeout: float | None = None,
                       started: float | None = None,
                       shared: SharedPrompt | None = None) -> AsyncIterator[TokenOutput]:
        """Stream the request's tokens (the last carries finish_reason and usage). ``timeout``:
        seconds the whole request may take (None: --request-timeout-seconds); ``started``:
        time.monotonic() at arrival, for the latency metrics; ``shared``: the prompt's other
        choices (module doc)."""
        tracker = _Tracker(self.metrics, len(req.prompt_ids), started or time.monotonic())
        outcome, call, address, last, error = "error", None, "", None, ""
        leads = shared is not None and shared.lead()
        prefer = ""
        try:
            if timeout is None:
                timeout = self.request_timeout_seconds
            if shared is not None and not leads:
                prefer = await _leader(shared, timeout - (time.monotonic() - tracker.started))
                timeout -= time.monotonic() - tracker.started  # what the wait left of it
            (call, address, out, tracker.expected_cached, tracker.prefill,
             tracker.eta) = await self._open(req, timeout, prefer)
            if leads:
                shared.address = address
            while out is not None:
                tracker.token()
                if leads and tracker.tokens == 2:  # decoding: the prompt's KV is in place
                    shared.ready.set()
                yield out
                last, out = out, await _next_token(call, address)
            if last.finish_reason is None:
                raise WorkerError(grpc.StatusCode.INTERNAL, f"decode worker {address} ended the "
                                                            f"stream without a finish reason")
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except (Overloaded, Unavailable) as exc:
            outcome = "rejected" if tracker.last is None else "error"
            error = str(exc)
            raise
        except Exception as exc:
            error = str(exc)
            raise
        finally:
            if leads:
                shared.ready.set()  # ended (or failed) before its second token
            if call is not None:
                call.cancel()  # no-op once the call has finished
                self.admission.notify()  # its blocks are free: a waiting request may fit
            tracker.finish(outcome, last)
            tracker.log(req.request_id, outcome, address, last, error)

    async def _open(self, req: RoutedRequest, timeout: float, prefer: str = ""):
        """A decode worker's call and first token: (call, worker address, first token, the
        prompt tokens the policy believed that worker had cached or None, the prefill worker
        offered first or "local", LocalChoice.note() of the local prefill rule). When
        every worker refused, the request waits its turn in the admission queue (nobody waiting:
        after one try at once) and tries again as room comes; Overloaded when none comes in the
        queue's timeout."""
        deadline = time.monotonic() + timeout
        refused: list[str] = []
        queue = self.admission
        if not (queue.enabled and queue.ahead_of(req.priority)):  # nobody ahead: try at once
            opened = await self._try_decodes(req, deadline, refused, prefer)
            if opened is not None:
                return opened
            if not queue.enabled:
                raise Overloaded(f"every decode worker is full (refused by {', '.join(refused)})")
        async with queue.place(req.priority) as ticket:
            self.metrics.admission_waits_total.inc()
            waited = time.monotonic()
            while await queue.turn(ticket, min(deadline, waited + queue.timeout_seconds)):
                refused = []
                opened = await self._try_decodes(req, deadline, refused, prefer,
                                                 admitted=lambda: queue.leave(ticket))
                if opened is not None:
                    return opened
                queue.rejoin(ticket)  # taken, then failed before its first token: wait again
        raise Overloaded(f"every decode worker is full (refused by {', '.join(refused) or '-'}) "
                         f"after {time.monotonic() - waited:.1f} s in the admission queue")

    async def _try_decodes(self, req: RoutedRequest, deadline: float, refused: list[str],
                           prefer: str = "", admitted=None):
        """Try the decode workers in order (``prefer`` first) until one sends a first token:
        _open's tuple; None when every one refused (their addresses in ``refused``).
        ``admitted()`` is called when a worker has taken the request (_first_token)."""
        decodes, prefills = self.plan(req)
        if prefer:  # stable: the policy's order after it
            decodes = sorted(decodes, key=lambda w: w.address != prefer)
        if not decodes:
            raise Unavailable(self.unhealthy_reason() or "no decode worker can take requests")
        for worker in decodes:
            call, prefill, eta = self._start(worker, req, prefills, deadline)
            try:
                first = await self._first_token(call, worker.address, refused, admitted)
            except BaseException:
                call.cancel()
                raise
            if first is not None:
                expected = self.policy.expected_cached_tokens(req.prompt_ids, worker,
                                                              req.cache_salt)
                self._note_routed(req, worker, prefill)
                return (call, worker.address, first, expected,
                        prefill.address if prefill is not None else "local", eta)
            call.cancel()
        if refused:
            return None
        raise Unavailable(self.unhealthy_reason() or "every decode worker failed")

    def _note_routed(self, req: RoutedRequest, decode: WorkerState,
                     prefill: WorkerState | None) -> None:
        """Tell the policy where an accepted request went (the first prefill candidate is where
        its prompt most likely went: the decode worker tries them in order); now and then let it
        forget workers that discovery no longer lists."""
        self.policy.note_routed(req.prompt_ids, decode, prefill, req.cache_salt)
        self._routed += 1
        if self._routed % FORGET_EVERY_ROUTES == 0:
            self.policy.forget_workers({w.address for role in (DECODE, PREFILL)
                                        for w in self.registry.workers(role)})

    def _start(self, worker: WorkerState, req: RoutedRequest, ranked: list[WorkerState],
               deadline: float):
        """The decode worker's call, the prefill candidate it will try first (None when it
        prefills locally), and the local prefill rule's estimates (LocalChoice.note())."""
        prefills = compatible_prefills(worker, ranked)
        choice = LocalChoice(False)
        if prefills:
            choice = self.local_prefill.choose(
                len(req.prompt_ids), [w for w in ranked if w.address in prefills], worker)
        if choice.local:
            prefills = []  # the decode worker prefills it (no candidates to pull from)
            self.metrics.local_prefills_total.inc()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request timed out before "
                                                                 "a decode worker took it")
        call = convert.start_generate(self.registry.channel(worker.address), req, prefills,
                                      remaining, choice.hold_steps)
        self.registry.note_dispatch(worker.address, prefills[0] if prefills else None,
                                    len(req.prompt_ids))
        first = next((w for w in ranked if w.address == prefills[0]), None) if prefills else None
        return call, first, choice.note()

    async def _first_token(self, call, address: str, refused: list[str],
                           admitted=None) -> TokenOutput | None:
        """The first token; None when this worker refused (try the next). With ``admitted``:
        called as soon as the worker's initial metadata says it took the request (it reserved
        the KV blocks), before the prompt's KV and the first token."""
        try:
            if admitted is not None and _taken(await call.initial_metadata()):
                admitted()
            event = await call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                log.info("decode worker %s is full: %s", address, exc.details())
                self.registry.note_refused(address)
                refused.append(address)
                return None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                log.warning("decode worker %s unavailable: %s", address, exc.details())
                self.registry.mark_unhealthy(DECODE, address, f"UNAVAILABLE: {exc.details()}")
                return None
            raise worker_error(exc, address) from None
        if event is grpc.aio.EOF:
            raise WorkerError(grpc.StatusCode.INTERNAL,
                              f"decode worker {address} ended the stream without a token")
        return convert.token_output(event)


def _taken(metadata) -> bool:
    """Whether a decode worker's initial metadata says it took the request (workers from
    before the key send none until their first token; a refusal sends none)."""
    return any(key == ADMITTED_METADATA_KEY for key, _ in metadata or ())


async def _leader(shared: SharedPrompt, timeout: float) -> str:
    """Wait until the leading choice's prompt KV is in place (SharedPrompt); its decode
    worker's address."""
    try:
        await asyncio.wait_for(shared.ready.wait(), max(timeout, 0))
    except TimeoutError:
        raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request timed out waiting for "
                                                             "its prompt's first choice") from None
    return shared.address


def compatible_prefills(decode: WorkerState, prefills: list[WorkerState]) -> list[str]:
    """Addresses of the prefill candidates whose reported model fingerprint equals the decode
    worker's (a prefill worker would refuse the pair with FAILED_PRECONDITION anyway; skipping it
    saves the round trip, and with no compatible candidate the decode worker prefills locally).
    A worker that has not reported a fingerprint yet is not excluded."""
    mine = decode.load.fingerprint if decode.load is not None else None
    out = []
    for w in prefills:
        theirs = w.load.fingerprint if w.load is not None else None
        if mine is None or theirs is None or theirs == mine:
            out.append(w.address)
    return out


async def _next_token(call, address: str) -> TokenOutput | None:
    """The call's next token; None at the end of the stream."""
    try:
        event = await call.read()
    except grpc.aio.AioRpcError as exc:
        raise worker_error(exc, address) from None
    return None if event is grpc.aio.EOF else convert.token_output(event)
