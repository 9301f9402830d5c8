"""The FastAPI app: /v1/models, /v1/completions and /v1/chat/completions (whole or
streamed as server-sent events) on one engine thread, a bearer key when one is set, a body
size limit, and every refusal in OpenAI's error shape (the server keeps serving)."""

import asyncio
import contextlib
import dataclasses
import hmac
import json

from jaxtrain.engine import Request as EngineRequest
from jaxtrain.engine import run_io
from jaxtrain.errors import JaxtrainError
from jaxtrain.serve import protocol
from jaxtrain.serve.protocol import ApiError, Limits
from jaxtrain.serve.replies import DONE, Replies, event
from jaxtrain.serve.worker import Worker


@dataclasses.dataclass
class Served:
    """What the app serves: the engine's worker, the model's name and tokenizer, its chat
    template (None: no chat endpoint), the limits and the API key (None: open)."""

    worker: Worker
    model_name: str
    tokenizer: object
    template: object
    limits: Limits
    api_key: str | None = None
    max_body_bytes: int = 1 << 20


class _Listener:
    """A request's events, from the engine thread into the request's event loop."""

    def __init__(self):
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()

    def __call__(self, completion, delta: str, finished: bool) -> None:
        i = len(completion.ids) - 1
        token = (completion.ids[i], completion.logprobs[i] if completion.logprobs else None,
                 completion.top_logprobs[i] if completion.top_logprobs else [])
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (
            completion, delta, completion.finish_reason if finished else None, token))

    def fail(self, message: str) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, message)


def make_app(served: Served):
    """The FastAPI app (fastapi, the [serve] extra, is imported here: importing this
    module needs none of it)."""
    from fastapi import FastAPI, Request

    @contextlib.asynccontextmanager
    async def lifespan(_):
        served.worker.start()
        yield
        served.worker.stop()

    app = FastAPI(title="jaxtrain serve", lifespan=lifespan)
    _errors(app)
    _guard(app, served)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.model_name, "object": "model",
                                            "created": 0, "owned_by": "jaxtrain"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(served, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(served, request, chat=True)

    return app


def _errors(app) -> None:
    from fastapi.exceptions import StarletteHTTPException as HTTPException
    from fastapi.responses import JSONResponse

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, e):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(),
                            status_code=e.status_code)


def _guard(app, served: Served) -> None:
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def guard(request, call_next):
        if served.api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {served.api_key}".encode()):
                error = ApiError(401, "missing or wrong API key: send Authorization: Bearer "
                                 "KEY", kind="authentication_error", code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
        length = request.headers.get("content-length", "0")
        if not length.isdigit() or int(length) > served.max_body_bytes:
            error = ApiError(413, f"the body is over the limit of {served.max_body_bytes} "
                             "bytes")
            return JSONResponse(error.body(), status_code=413)
        return await call_next(request)


async def _body(served: Served, request) -> dict:
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > served.max_body_bytes:
            raise ApiError(413, f"the body is over the limit of {served.max_body_bytes} bytes")
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if body.get("model") != served.model_name:
        raise ApiError(404, f"model={body.get('model')!r} does not exist: this server has "
                       f"{served.model_name!r}", "model", code="model_not_found")
    return body


def _prompt(served: Served, body: dict, chat: bool) -> list[int]:
    try:
        if not chat:
            return protocol.prompt_of(body, served.tokenizer.encode)
        if served.template is None:
            raise ApiError(400, "this model has no chat template: use /v1/completions")
        return run_io.chat_ids(served.template, served.tokenizer, protocol.messages_of(body))
    except JaxtrainError as e:
        raise ApiError(400, str(e)) from None


async def _complete(served: Served, request, chat: bool):
    from fastapi.responses import StreamingResponse

    body = await _body(served, request)
    params = protocol.sampling(body, served.limits, chat)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream={stream!r} is invalid: true or false", "stream")
    engine_request = EngineRequest(tuple(_prompt(served, body, chat)), params)
    try:
        served.worker.engine.check(engine_request)
    except JaxtrainError as e:
        raise ApiError(400, str(e)) from None
    replies = Replies(served.model_name, chat,
                      lambda i: served.tokenizer.decode([i]))
    listener = _Listener()
    served.worker.submit(engine_request, listener)
    logprobs = params.logprobs or params.top_logprobs > 0
    if stream:
        return StreamingResponse(_stream(served, listener, replies, params.n, logprobs),
                                 media_type="text/event-stream")
    done: dict = {}
    try:
        while len(done) < params.n:
            item = await listener.queue.get()
            if isinstance(item, str):
                raise ApiError(500, item, kind="server_error")
            if item[2] is not None:
                done[item[0].index] = item[0]
    finally:
        if len(done) < params.n:
            served.worker.cancel(listener)
    return replies.whole([done[i] for i in range(params.n)],
                         len(engine_request.prompt_ids), params.top_logprobs > 0, logprobs)


async def _stream(served: Served, listener: _Listener, replies: Replies, n: int,
                  logprobs: bool):
    finished = 0
    try:
        if replies.chat:
            for i in range(n):
                yield replies.chunk(i, "", None, first=True)
        while finished < n:
            item = await listener.queue.get()
            if isinstance(item, str):
                yield event(ApiError(500, item, kind="server_error").body())
                break
            completion, delta, finish, (token, lp, top) = item
            lps = replies.logprobs([token], [lp], [top]) if logprobs else None
            yield replies.chunk(completion.index, delta, finish, logprobs=lps)
            finished += finish is not None
        yield DONE
    finally:
        if finished < n:  # the client went away, or the engine failed
            served.worker.cancel(listener)
