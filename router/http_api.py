"""The router's OpenAI-compatible HTTP API (FastAPI on uvicorn, in the router process).

It calls the same GenerationService as the gRPC API, so keys, rate limits, validation,
the journal, replica choice and resume on replica failure are the same. Each choice of
a request is one generation; a thread pool runs their blocking streams and an asyncio
queue merges them into server-sent events. A client that disconnects cancels its
generations on the replicas."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from outrider.router.http_guard import (
    READ_WATCH,
    BodyGuard,
    HttpBounds,
    ReadWatch,
    guarded_protocol,
)
from outrider.router.models import Models, ServedModel
from outrider.router.openai_protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    BodyFieldError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    http_field,
)
from outrider.router.refusal import Refused
from outrider.router.replica_metrics import ReplicaMetrics
from outrider.router.service import GenerationService
from outrider.router.target_link import UNREAD, UNREAD_TIMEOUT_S
from outrider.router.tool_calls import CALL_FORMATS, ForcedCalls, ParsedCalls
from outrider.router.validate import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from outrider import __version__
from outrider.core.stats import SpecStats
from outrider.telemetry.metrics import exposition
from outrider.v1 import generate_pb2 as gp

PASSED_HEADERS = {"authorization", "traceparent", "tracestate"}
SSE_DONE = "data: [DONE]\n\n"
GRACEFUL_STOP_S = 5  # what uvicorn waits for open requests to end when the router stops
# messages a generation may have waiting for its HTTP client: beyond, it waits, so a
# client that stops reading leaves its chunks unread at the link (backpressure there)
STREAM_BUFFER = 64
LOGPROB_FLOOR = -9999.0
DASHBOARD_HTML = (Path(__file__).parent / "dashboard.html").read_text()
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
               grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
               grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
               grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
               grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
               grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
               grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
               grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error")}


@dataclass
class HttpCall:
    """A CallContext (router/service.py) for one HTTP generation."""

    metadata: tuple[tuple[str, str], ...]  # the headers the service reads
    callbacks: list = field(default_factory=list)
    is_cancelled: threading.Event = field(default_factory=threading.Event)
    api: str = "http"
    is_unread: bool = False  # cancelled because its client stopped reading (backpressure)
    is_reader_watched: bool = False  # a ReadWatch sees its client's socket: no other bound

    @classmethod
    def of(cls, request: Request) -> HttpCall:
        return cls(tuple((k, v) for k, v in request.headers.items() if k in PASSED_HEADERS))

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def cancel(self) -> None:
        self.is_cancelled.set()
        for callback in list(self.callbacks):
            callback()

    def cancel_unread(self) -> None:
        self.is_unread = True
        self.cancel()


@dataclass(frozen=True)
class HttpSettings:
    max_streams: int = 128          # threads for generations (as many as may run)
    max_prompts: int = 64           # prompts one completion request may carry
    bounds: HttpBounds = HttpBounds()  # on headers and bodies
    strict_fields: bool = False     # refuse (400) body fields it does not know, not ignore
    tool_call_parser: str | None = None  # tool_choice "auto": the model's call format


def build_app(models: Models, settings: HttpSettings) -> FastAPI:
    """The API of the router's models (router/models.py): a request's `model` names its
    model; keys, refusals' counts and the dashboard are the first model's service's."""
    app = FastAPI(title="Outrider", summary="OpenAI-compatible API of the Outrider router")
    pool = ThreadPoolExecutor(max_workers=settings.max_streams, thread_name_prefix="http")
    created = int(time.time())
    app.state.streams = OpenStreams()
    service = models.default.service  # (what does not depend on the model)
    replica_metrics = ReplicaMetrics(models)  # its models' engines' on /metrics too

    def answer(refusal: Refused) -> JSONResponse:
        """A refusal made before the service ran the request, counted as it counts its own."""
        service.telemetry.metrics.answered(refusal.code.name, "http")
        return error_response(refusal)

    app.add_middleware(BodyGuard, bounds=settings.bounds, refuse=answer)

    @app.exception_handler(Refused)
    async def refused(_, exc: Refused):
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, exc: RequestValidationError):
        return answer(_body_refusal(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        """The framework's own refusals (undecodable bodies, unknown paths), in
        OpenAI's error format too."""
        code = {404: grpc.StatusCode.NOT_FOUND, 405: grpc.StatusCode.INVALID_ARGUMENT}.get(
            exc.status_code, grpc.StatusCode.INVALID_ARGUMENT if exc.status_code < 500
            else grpc.StatusCode.INTERNAL)
        response = answer(Refused(code, f"{exc.detail}"))
        response.status_code = exc.status_code
        return response

    @app.get("/health")
    async def health():
        """200 while some target replica is live; 503 (degraded: requests would wait for
        one, then be refused) while none is, as gRPC health's NOT_SERVING says."""
        live = len(models.live())
        return JSONResponse({"status": "ok" if live else "degraded", "live_replicas": live},
                            status_code=200 if live else 503)

    @app.get("/v1/models")
    async def list_models(request: Request):
        service.authorize(HttpCall.of(request))
        return {"object": "list", "data": [_model_card(m, created) for m in models]}

    @app.get("/v1/models/{model}")
    async def model(model: str, request: Request):
        service.authorize(HttpCall.of(request))
        return _model_card(models.named(model), created)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        service.authorize(HttpCall.of(request))
        chosen = models.named(body.model).service
        ids = _refusing(lambda: chosen.tokenizer.encode(body.prompt, body.add_special_tokens))
        return {"tokens": ids, "count": len(ids), "max_model_len": chosen.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        service.authorize(HttpCall.of(request))
        tokenizer = models.named(body.model).service.tokenizer
        vocab = tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"tokens: id {bad} is outside "
                          f"the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    def ignoring(body, chosen: GenerationService) -> list[str]:
        """The body's unknown fields: refused under strict_fields, else counted (under
        the chosen model) and named in the answer's X-Outrider-Ignored-Fields header."""
        ignored = body.ignored_fields
        if ignored and settings.strict_fields:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{ignored[0]}: unknown field "
                          "(this router refuses fields it does not know)", param=ignored[0])
        if ignored:
            chosen.telemetry.metrics.ignored_fields.inc(len(ignored))
        return ignored

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        served = models.named(body.model)
        chosen = served.service
        ignored = ignoring(body, chosen)
        prompts = _refusing(lambda: body.prompts)
        if len(prompts) > settings.max_prompts:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt: holds {len(prompts)} prompts; this router takes at most "
                          f"{settings.max_prompts} per request", param="prompt")
        max_tokens = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        requests = _refusing(lambda: [
            r for i, p in enumerate(prompts)
            for r in body.generate_requests(p, max_tokens, _request_id(request, i))])
        view = CompletionView(served.name, body, chosen.tokenizer, prompts)
        return _naming_ignored(await _respond(chosen, pool, request,
                                              _naming(requests, served), view, body.stream,
                                              app.state.streams), ignored)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        served = models.named(body.model)
        chosen, chat_template = served.service, served.chat_template
        ignored = ignoring(body, chosen)
        if body.chooses_calls and settings.tool_call_parser is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "tool_choice: 'auto' (the "
                          "default with tools) reads the model's calls from its text, which "
                          "needs the router's --tool-call-parser (" + ", ".join(CALL_FORMATS)
                          + "): start it with one, or give 'required', a named function, or "
                          "'none'", param="tool_choice")
        if chat_template is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"model {served.name!r} has no chat template; "
                          "use /v1/completions")
        prompt_ids = _refusing(lambda: chosen.tokenizer.encode(chat_template.render(
            [m.for_template() for m in body.messages], body.add_generation_prompt,
            body.offered_tools, body.chat_template_kwargs)))
        # OpenAI's chat default: as many tokens as the context has room for
        max_tokens = body.completion_limit or max(1, chosen.max_model_len - len(prompt_ids))
        requests = _refusing(lambda: body.generate_requests(prompt_ids, max_tokens,
                                                            _request_id(request, 0)))
        view = ChatView(served.name, body, chosen.tokenizer, settings.tool_call_parser)
        return _naming_ignored(await _respond(chosen, pool, request,
                                              _naming(requests, served), view, body.stream,
                                              app.state.streams), ignored)

    @app.get("/metrics")
    async def metrics():  # off the loop: it reads the replicas' expositions
        body, content_type = await asyncio.to_thread(exposition, replica_metrics)
        return Response(body, media_type=content_type)

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return DASHBOARD_HTML

    @app.get("/dashboard/data")
    async def dashboard_data():
        return service.telemetry.live.snapshot()

    app.state.pool = pool
    return app


# -- responses ---------------------------------------------------------------------------------
class _View:
    """What both endpoints share: the model, the body, token texts for logprobs."""

    def __init__(self, model: str, body, tokenizer) -> None:
        self.model, self.body, self.tokenizer = model, body, tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def blame(self, refusal: Refused) -> Refused:
        """The refusal as this endpoint's caller should read it."""
        return refusal


def _json_logprob(value: float) -> float:
    """JSON has no -inf (a token truncation removed): vLLM's stand-in for it."""
    return max(value, LOGPROB_FLOOR)


class CompletionView(_View):
    """How /v1/completions shows choices (logprobs in the legacy completions format)."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl-"

    def __init__(self, model: str, body: CompletionRequest, tokenizer, prompts: list) -> None:
        super().__init__(model, body, tokenizer)
        self.echo = [p if isinstance(p, str) else None for p in prompts] if body.echo else None
        self._offsets: dict[int, int] = {}  # per choice: where its next token's text starts

    def echoed(self, index: int, service: GenerationService) -> str:
        if self.echo is None:
            return ""
        prompt = self.echo[index // self.body.n]
        if prompt is None:  # token ids: echo their text
            prompt = service.tokenizer.decode(list(self.body.prompts[index // self.body.n]))
        return prompt

    def choice(self, index: int, text: str, finish_reason: str | None,
               logprobs: list[gp.TokenLogprob] = ()) -> dict:
        return {"index": index, "text": text, "logprobs": self.logprobs(index, logprobs),
                "finish_reason": finish_reason or None}

    def first_delta(self, index: int) -> dict | None:
        return None

    def delta(self, index: int, text: str, finish_reason: str | None,
              logprobs: list[gp.TokenLogprob] = ()) -> dict:
        return self.choice(index, text, finish_reason, logprobs)

    def logprobs(self, index: int, logprobs: list[gp.TokenLogprob]) -> dict | None:
        if self.body.num_logprobs is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(token)
        return {"tokens": tokens, "token_logprobs": [_json_logprob(lp.logprob) for lp in logprobs],
                "top_logprobs": [{self.token_text(t): _json_logprob(v)
                                  for t, v in zip(lp.top_ids, lp.top_logprobs)}
                                 for lp in logprobs],
                "text_offset": offsets}


class ChatView(_View):
    """How /v1/chat/completions shows choices: text, or tool calls (forced, or read from
    the text by the model's call format)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, model: str, body: ChatCompletionRequest, tokenizer,
                 call_format: str | None = None) -> None:
        super().__init__(model, body, tokenizer)
        self.calls: ForcedCalls | ParsedCalls | None = None
        if body.forced_call is not None:
            self.calls = ForcedCalls(body.forced_call)
        elif body.chooses_calls and call_format is not None:
            self.calls = ParsedCalls(CALL_FORMATS[call_format](),
                                     [t.function.name for t in body.tools])

    def echoed(self, index: int, service: GenerationService) -> str:
        return ""

    def blame(self, refusal: Refused) -> Refused:
        """A forced call's schema is made of its tools' parameters: a refusal of the
        schema names them."""
        field, _, why = refusal.message.partition(": ")
        if self.calls is None or field != "sampling.structured_output.json_schema":
            return refusal
        return Refused(refusal.code, f"tools: a function's parameters: {why}", param="tools")

    def choice(self, index: int, text: str, finish_reason: str | None,
               logprobs: list[gp.TokenLogprob] = ()) -> dict:
        message = {"role": "assistant", "content": text}
        if self.calls is not None:
            message, finish_reason = self.calls.message(index, text, finish_reason)
        return {"index": index, "message": message, "logprobs": self.logprobs(index, logprobs),
                "finish_reason": finish_reason or None}

    def first_delta(self, index: int) -> dict | None:
        delta = ({"role": "assistant", "content": ""} if self.calls is None
                 else self.calls.first_delta(index))
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def delta(self, index: int, text: str, finish_reason: str | None,
              logprobs: list[gp.TokenLogprob] = ()) -> dict | None:
        """None: nothing to show yet (a 'required' call shows once it is whole)."""
        delta = {"content": text} if text else {}
        if self.calls is not None:
            delta, finish_reason = self.calls.delta(index, text, finish_reason)
        if delta is None and not logprobs:
            return None
        return {"index": index, "delta": delta or {}, "logprobs": self.logprobs(index, logprobs),
                "finish_reason": finish_reason or None}

    def logprobs(self, index: int, logprobs: list[gp.TokenLogprob]) -> dict | None:
        if self.body.num_logprobs is None:
            return None
        return {"content": [
            {**self._entry(lp.token_id, lp.logprob),
             "top_logprobs": [self._entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]}
            for lp in logprobs]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.token_text(token_id), "logprob": _json_logprob(logprob),
                "bytes": list(self.tokenizer.token_bytes(token_id))}


class OpenStreams:
    """The requests the HTTP API is answering, so that a router that stops ends each with
    an error its client can read (then `[DONE]`), not a truncated stream."""

    def __init__(self) -> None:
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()

    def add(self, queue: asyncio.Queue) -> None:
        with self._lock:
            self._queues[id(queue)] = (asyncio.get_running_loop(), queue)

    def remove(self, queue: asyncio.Queue) -> None:
        with self._lock:
            self._queues.pop(id(queue), None)

    def end_all(self, reason: str) -> None:
        """From any thread: every open request fails with UNAVAILABLE (try another router)."""
        refusal = Refused(grpc.StatusCode.UNAVAILABLE, reason, retry_after_s=1.0)
        with self._lock:
            queues = list(self._queues.values())
        for loop, queue in queues:
            loop.call_soon_threadsafe(queue.put_nowait, (0, refusal))


async def _respond(service, pool, request: Request, requests: list[gp.GenerateRequest],
                   view, stream: bool, streams: OpenStreams):
    calls = [HttpCall.of(request) for _ in requests]
    events = _merged(service, pool, requests, calls, streams,
                     request.scope.get(READ_WATCH) if stream else None)
    response_id = view.id_prefix + uuid.uuid4().hex
    try:
        first = await anext(events)  # refusals before any token become HTTP errors
    except Refused as refusal:
        return error_response(view.blame(refusal))
    if stream:
        sse = _sse(service, view, response_id, first, events, calls, len(requests))
        return StreamingResponse(sse, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    finals, texts, logprobs = await _collect(first, events, len(requests))
    choices = [view.choice(i, view.echoed(i, service) + texts[i], finals[i].finish_reason,
                           logprobs[i])
               for i in range(len(requests))]
    return {"id": response_id, "object": view.object, "created": int(time.time()),
            "model": view.model, "choices": choices, "usage": usage(finals)}


IGNORED_HEADER = "X-Outrider-Ignored-Fields"
MAX_NAMED_IGNORED = 16  # of a body's unknown fields, the header names at most these


def _naming_ignored(answer, ignored: list[str]):
    """The answer with the header naming the body's ignored fields (JSON-escaped, so that a
    name holding CR or LF cannot end the header; truncated)."""
    if not ignored:
        return answer
    response = answer if isinstance(answer, Response) else JSONResponse(answer)
    names = [json.dumps(name)[1:-1][:64] for name in ignored]  # printable ASCII: no \r\n
    response.headers[IGNORED_HEADER] = ", ".join(names[:MAX_NAMED_IGNORED])
    return response


async def _collect(first, events, n: int):
    """Per choice: its last message, its text, its tokens' logprobs."""
    finals: list[gp.GenerateResponse] = [gp.GenerateResponse()] * n
    texts = [""] * n
    logprobs: list[list[gp.TokenLogprob]] = [[] for _ in range(n)]
    index, msg = first
    while True:
        texts[index] += msg.text
        logprobs[index] += msg.logprobs
        if msg.finish_reason:
            finals[index] = msg
        try:
            index, msg = await anext(events)
        except StopAsyncIteration:
            return finals, texts, logprobs


async def _sse(service, view, response_id: str, first, events, calls: list[HttpCall], n: int):
    """Server-sent events in OpenAI's chunk format, then `data: [DONE]`."""
    created = int(time.time())

    def chunk(choices: list[dict], **extra) -> str:
        body = {"id": response_id, "object": view.chunk_object, "created": created,
                "model": view.model, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    finals: list[gp.GenerateResponse] = [gp.GenerateResponse()] * n
    latest = [gp.GenerateResponse()] * n  # each choice's last message: its usage so far

    def so_far() -> dict:  # stream_options.continuous_usage_stats: every chunk's usage
        return {"usage": usage(latest, speculation=False)} if view.body.continuous_usage \
            else {}
    try:
        for i in range(n):
            opening = view.first_delta(i)
            echoed = view.echoed(i, service)
            if opening or echoed:
                yield chunk([opening or view.delta(i, echoed, None)], **so_far())
        pending = first
        while pending is not None:
            index, msg = pending
            latest[index] = msg
            if msg.finish_reason:
                finals[index] = msg
            delta = (view.delta(index, msg.text, msg.finish_reason, msg.logprobs)
                     if msg.text or msg.finish_reason or msg.logprobs else None)
            if delta is not None:
                yield chunk([delta], **so_far())
            pending = await anext(events, None)
        if view.body.include_usage:
            yield chunk([], usage=usage(finals))
    except Refused as refusal:  # after the first token: reported in the stream, the end in
        # the same write (a stopping router closes its connections once they wrote it)
        yield f"data: {json.dumps(error_body(refusal))}\n\n{SSE_DONE}"
        return
    finally:
        for call in calls:
            call.cancel()
    yield SSE_DONE


async def _merged(service: GenerationService, pool: ThreadPoolExecutor,
                  requests: list[gp.GenerateRequest], calls: list[HttpCall],
                  streams: OpenStreams, read_watch: ReadWatch | None = None,
                  ) -> AsyncIterator[tuple[int, gp.GenerateResponse]]:
    """(choice index, message) from all generations as they arrive; a refusal of any
    raises Refused. Leaving early (a client gone) cancels them all, and so does a client
    that stops reading what `read_watch` sees written (each then ends with UNREAD)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    try:  # the request's generations are admitted together; each pump frees its own slot
        await service.admission.enter(len(requests))
    except Refused as refusal:
        service.telemetry.metrics.answered(refusal.code.name, "http")
        raise

    room = [threading.Semaphore(STREAM_BUFFER) for _ in requests]

    def pump(index: int) -> None:
        call = calls[index]
        messages = service.responses(requests[index], call, is_admitted=True)
        try:
            for msg in messages:
                if not _wait_for_room(room[index], call):
                    if call.is_unread:
                        raise Refused(grpc.StatusCode.CANCELLED, UNREAD)
                    break
                loop.call_soon_threadsafe(queue.put_nowait, (index, msg))
        except Exception as exc:  # handed to the event loop, raised there
            failure = exc
            if call.is_unread:  # not the replica's failure: its reader stopped reading
                service.telemetry.metrics.unread.inc()
                failure = Refused(grpc.StatusCode.CANCELLED, UNREAD)
            loop.call_soon_threadsafe(queue.put_nowait, (index, failure))
        finally:
            messages.close()
            service.admission.leave(1)
            loop.call_soon_threadsafe(queue.put_nowait, (index, done))

    stop_watching = None
    if read_watch is not None and read_watch.sees_reads():
        stop_watching = read_watch.watch(lambda: [call.cancel_unread() for call in calls])
        for call in calls:
            call.is_reader_watched = True
    futures = [loop.run_in_executor(pool, pump, i) for i in range(len(requests))]
    running = len(requests)
    streams.add(queue)
    try:
        while running:
            index, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise _as_refusal(item)
            else:
                room[index].release()
                yield index, item
    finally:
        if stop_watching is not None:
            stop_watching()
        streams.remove(queue)
        for call in calls:
            call.cancel()
        del futures  # the pumps end on their own once cancelled


def _wait_for_room(room: threading.Semaphore, call: HttpCall) -> bool:
    """True once the client has read enough to make room; False when the call is
    cancelled, or, where no ReadWatch sees its socket, when the client read nothing for
    UNREAD_TIMEOUT_S (then it is cancelled as unread). A watched client waits: a slow
    reader's writes can block for longer while it still reads (the kernel wakes a writer
    only once a third of its send buffer is free)."""
    deadline = time.monotonic() + UNREAD_TIMEOUT_S
    while not room.acquire(timeout=0.5):
        if call.is_cancelled.is_set():
            return False
        if not call.is_reader_watched and time.monotonic() >= deadline:
            call.cancel_unread()
            return False
    return not call.is_cancelled.is_set()


def usage(finals: list[gp.GenerateResponse], speculation: bool = True) -> dict:
    """OpenAI usage, plus `speculation`: the statistics of all choices together."""
    prompt = sum(f.usage.prompt_tokens for f in finals)
    cached = sum(f.usage.cached_prompt_tokens for f in finals)
    completion = sum(f.usage.completion_tokens for f in finals)
    if not speculation:
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}
    total = SpecStats()
    for f in finals:
        total.merge(SpecStats.from_proto(f.speculation))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "speculation": {
                "draft_tokens": total.num_draft_tokens,
                "accepted_tokens": total.num_accepted_tokens, "rounds": total.num_rounds,
                "acceptance_rate": total.acceptance_rate,
                "mean_accepted_len": total.mean_accepted_len,
                "drafted_per_position": total.drafted_per_position,
                "accepted_per_position": total.accepted_per_position,
                "by_proposer": {m: {"draft_tokens": d, "accepted_tokens": a}
                                for m, (d, a) in sorted(total.by_proposer.items())}}}


# -- errors ------------------------------------------------------------------------------------
def error_body(refusal: Refused) -> dict:
    status, kind = HTTP_STATUS.get(refusal.code, (500, "server_error"))
    param, message = http_field(refusal.message)
    param = refusal.param or param
    return {"error": {"message": message, "type": kind, "param": param,
                      "code": refusal.code.name.lower()}}


def error_response(refusal: Refused) -> JSONResponse:
    status, _ = HTTP_STATUS.get(refusal.code, (500, "server_error"))
    headers = ({"Retry-After": str(max(1, round(refusal.retry_after_s))),
                "retry-after-ms": str(int(refusal.retry_after_s * 1000))}
               if refusal.retry_after_s else None)
    return JSONResponse(error_body(refusal), status_code=status, headers=headers)


def _body_refusal(exc: RequestValidationError) -> Refused:
    """pydantic's first complaint, as `field: problem` (the field in OpenAI's terms)."""
    err = exc.errors()[0]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, BodyFieldError):
        return Refused(grpc.StatusCode.INVALID_ARGUMENT, str(cause),
                       param=cause.field.split(".")[0])
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    if err.get("type") == "json_invalid":
        return Refused(grpc.StatusCode.INVALID_ARGUMENT, "the body is not valid JSON")
    message = err.get("msg", "invalid").removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        message = "is not a supported parameter"
    top = next((str(p) for p in err.get("loc", ()) if p != "body"), None)
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{where or 'body'}: {message}",
                   param=top)


def _as_refusal(exc: Exception) -> Refused:
    if isinstance(exc, Refused):
        return exc
    if isinstance(exc, ValidationError | ValueError):
        return Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    return Refused(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


def _refusing(build):
    """build() with argument errors raised as INVALID_ARGUMENT refusals."""
    try:
        return build()
    except (ValidationError, ValueError) as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def _naming(requests: list[gp.GenerateRequest], served: ServedModel):
    """The requests, each naming its model (ServedModel.take)."""
    for request in requests:
        served.take(request)
    return requests


def _model_card(served: ServedModel, created: int) -> dict:
    return {"id": served.name, "object": "model", "created": created,
            "owned_by": "outrider", "max_model_len": served.service.max_model_len}


def _request_id(request: Request, index: int) -> str | None:
    """X-Request-Id makes a request idempotent, as request_id does on gRPC."""
    header = request.headers.get("x-request-id")
    return f"{header}.p{index}" if header and index else header


# -- serving -----------------------------------------------------------------------------------
def start_http(app: FastAPI, host: str, port: int, tls_cert: str | None = None,
               tls_key: str | None = None, tls_client_ca: str | None = None,
               header_timeout_s: float = HttpBounds.header_timeout_s,
               ) -> tuple[uvicorn.Server, threading.Thread, int]:
    """uvicorn in a daemon thread; returns (server, its thread, bound port) once it
    listens. With `tls_client_ca`, clients must present a certificate it signed (mTLS)."""
    mtls = {"ssl_ca_certs": tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED} \
        if tls_client_ca else {}
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level="warning", ssl_certfile=tls_cert,
        ssl_keyfile=tls_key, timeout_graceful_shutdown=GRACEFUL_STOP_S,
        http=guarded_protocol(header_timeout_s, UNREAD_TIMEOUT_S), **mtls))
    thread = threading.Thread(target=server.run, name="http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise OSError(f"the HTTP API could not listen on {host}:{port}")
        time.sleep(0.02)
    return server, thread, server.servers[0].sockets[0].getsockname()[1]
