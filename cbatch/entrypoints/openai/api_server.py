"""The OpenAI-compatible HTTP server: a thin FastAPI layer over one :class:`AsyncEngine`.

    cbatch serve gpt2 --host 127.0.0.1 --port 8000

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``
(stateless), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus), and vLLM's ``POST /tokenize``,
``POST /detokenize``, ``GET /version``.  Request fields the server does not know are
accepted, as vLLM accepts them, and named in one warning line in the log.  Every error,
of every route, is OpenAI's error JSON; an internal error's text goes to the log, not to
the client.

No client can take the server down: requests pass :class:`RequestGuard` first (well-formed
and allowed hosts, API key, a slot of ``--limit-concurrency`` or a bounded wait for one, body
size, read time and number of values), half-sent headers and unread responses time out, and
a failure of one request ends that request alone.  If the engine itself fails, ``/health`` fails and
the process exits with status 1 within seconds, so that a supervisor restarts it.  The first
SIGTERM, SIGINT or SIGHUP stops accepting connections and gives running requests
``--shutdown-timeout`` seconds before they are aborted (streams end with reason "abort"); a
second one exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from cbatch.logger import init_logger
from cbatch.core.async_engine import AsyncEngine, EngineDeadError
from cbatch.core.structured_output import prestart as prestart_grammar_workers
from cbatch.core.cpu.report import format_paths
from cbatch.entrypoints.openai.cli_args import (DEFAULT_LIMIT_CONCURRENCY,
                                                DEFAULT_MAX_QUEUED_REQUESTS,
                                                DEFAULT_MAX_REQUEST_BYTES, guard_settings,
                                                tool_settings)
from cbatch.entrypoints.openai.guard import ConcurrencyLimit, RequestGuard
from cbatch.entrypoints.openai.metrics import ServerMetrics
from cbatch.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                DetokenizeRequest, DetokenizeResponse, ModelCard,
                                                ModelList, TokenizeChatRequest,
                                                TokenizeCompletionRequest, TokenizeResponse,
                                                VersionResponse, ignored_fields)
from cbatch.entrypoints.openai.chat_utils import (load_chat_template, load_gguf_chat_template,
                                                 load_special_tokens)
from cbatch.entrypoints.openai.serving_chat import OpenAIServingChat
from cbatch.entrypoints.openai.serving_completion import OpenAIServingCompletion
from cbatch.entrypoints.openai.protocol_responses import ResponsesRequest
from cbatch.entrypoints.openai.serving_engine import ENGINE_UNAVAILABLE, OpenAIError
from cbatch.entrypoints.openai.serving_responses import OpenAIServingResponses
from cbatch.entrypoints.openai.uvicorn_server import (raise_open_files_limit, server_class,
                                                      uvicorn_config)
from cbatch.hub import find_gguf_file, resolve_checkpoint_dir
from cbatch.models.registry import random_chat_template
from cbatch.tokenizer import check_text_fits, token_text

logger = init_logger("cbatch.server")

# how long a server's start-up waits for its grammar workers (xgrammar's import)
GRAMMAR_START_TIMEOUT_S = 120.0


def served_names(served_model_name: str | list[str] | None, model: str) -> list[str]:
    """The names a server answers to (``--served-model-name``, one or several; default the
    model's), the first naming it in its metrics and logs."""
    if not served_model_name:
        return [model]
    return [served_model_name] if isinstance(served_model_name, str) else list(
        served_model_name)


def build_engine(model: str, max_waiting: int = 1024,
                 served_model_name: str | list[str] | None = None, on_dead=None,
                 **engine_kwargs) -> tuple[AsyncEngine, ServerMetrics]:
    """An AsyncEngine whose finished requests feed a fresh set of server metrics, its
    grammar workers warm: started before the model loads (they import xgrammar meanwhile),
    then given its vocabulary, so that no client's first constraint waits for them."""
    prestart_grammar_workers()
    metrics = ServerMetrics(served_names(served_model_name, model)[0])
    engine = AsyncEngine(model, max_waiting=max_waiting, on_finished=metrics.observe,
                         on_dead=on_dead, **engine_kwargs)
    metrics.attach(engine)
    if engine.is_running and not engine.warm_up_grammars(GRAMMAR_START_TIMEOUT_S):
        logger.warning("the grammar workers are not ready; structured outputs start them "
                       "when a request needs them")
    return engine, metrics


def build_app(engine: AsyncEngine, metrics: ServerMetrics, served_model_name: str | list[str],
              shutdown_timeout: float = 0.0, chat_template: str | None = None, *,
              api_key: str | None = None, allowed_hosts: list[str] | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              body_timeout: float = 30.0,
              limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY,
              max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
              queue_timeout: float = 30.0, special_tokens_in_content: bool = True,
              tool_call_parser: str | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``served_model_name`` (or as each of
    several names: a response names the model as its request did), behind a
    :class:`RequestGuard` with these settings (``limit_concurrency`` None: no limit).  When
    the app shuts down it shuts the engine down, giving running requests ``shutdown_timeout``
    seconds.  ``chat_template`` (Jinja) replaces the one the checkpoint ships, if any;
    ``special_tokens_in_content=False`` encodes chat contents as plain text
    (``--no-special-tokens-in-content``); ``tool_call_parser`` (a name of
    ``tool_parsers.TOOL_PARSERS``) turns tool_choice "auto" on; ``reasoning_parser`` (of
    ``reasoning_parsers.REASONING_PARSERS``) splits replies' thinking off."""
    config = engine.config
    max_model_len = engine.max_model_len
    names = served_names(served_model_name, config.model)
    served_model_name = names[0]
    is_random = config.model.startswith("random:")
    gguf_file = None if is_random else find_gguf_file(config.model)
    checkpoint = None if is_random or gguf_file else resolve_checkpoint_dir(config.model)
    if gguf_file is not None:  # the file's own template and special tokens
        own_template, special_tokens = load_gguf_chat_template(gguf_file, engine.tokenizer)
    else:  # the checkpoint's own, or a chat-capable random model's
        own_template = (load_chat_template(checkpoint) if checkpoint is not None
                        else random_chat_template(config.model))
        special_tokens = load_special_tokens(checkpoint)
    template = own_template if chat_template is None else chat_template
    completions = OpenAIServingCompletion(engine, served_model_name)
    chat = OpenAIServingChat(engine, served_model_name, template, special_tokens,
                             architecture=engine.architecture,
                             tool_call_parser=tool_call_parser,
                             special_tokens_in_content=special_tokens_in_content,
                             reasoning_parser=reasoning_parser)
    responses = OpenAIServingResponses(chat)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown, shutdown_timeout)

    app = FastAPI(title="cbatch", lifespan=lifespan)
    app.state.engine = engine
    limit = None if limit_concurrency is None else ConcurrencyLimit(
        limit_concurrency, max_queued_requests, queue_timeout)
    app.add_middleware(RequestGuard, max_request_bytes=max_request_bytes,
                       body_timeout=body_timeout, api_key=api_key, allowed_hosts=allowed_hosts,
                       limit=limit)

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                                   f"{', '.join(map(repr, names))}", param="model",
                              code="model_not_found")

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        where = [".".join(str(p) for p in e["loc"] if p != "body" and not _union_member(p))
                 for e in errors]
        messages = [e["msg"].removeprefix("Value error, ") for e in errors]
        if not where[0]:  # a check of the whole body: its message names the field
            fields = exc.body if isinstance(exc.body, dict) else ()
            error = OpenAIError.bad_request(messages[0], fields)
        else:
            message = "; ".join(f"{w}: {m}" if w else m for w, m in zip(where, messages[:5]))
            if len(errors) > 5:  # the first few: a list may fail per item
                message += f"; and {len(errors) - 5} more"
            error = OpenAIError(400, message, param=where[0])
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return JSONResponse(OpenAIError(503, ENGINE_UNAVAILABLE, "service_unavailable").body(),
                            status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # 404, 405, ...
        error = OpenAIError(exc.status_code, str(exc.detail),
                            "invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(OpenAIError(500, "internal server error; see the server log",
                                        "server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=name, max_model_len=max_model_len)
                               for name in names])

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    def check_request(route: str, req) -> None:
        """The model it names is this one; the fields it has and cbatch does not know are
        logged (not refused, as vLLM: a client's extra field must not fail its request)."""
        check_model(req.model)
        ignored = ignored_fields(req)
        if ignored:
            logger.warning("%s: ignoring fields cbatch does not know: %s", route,
                           ", ".join(ignored))

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request):
        check_request("/v1/completions", req)
        return await completions.create(req, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        check_request("/v1/chat/completions", req)
        return await chat.create(req, raw_request)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw_request: Request):
        check_request("/v1/responses", req)
        return await responses.create(req, raw_request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest):
        """vLLM's: a prompt (or messages, through the chat template) as token ids."""
        check_request("/tokenize", req)
        if isinstance(req, TokenizeChatRequest):
            ids, field = await chat.prompt_ids(req, req.add_special_tokens), "messages"
        else:
            field = "prompt"
            try:  # bounded like a prompt: by its length first, then tokenised off the loop
                check_text_fits(req.prompt, engine.tokenizer, max_model_len)
                ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt,
                                              add_special_tokens=req.add_special_tokens)
            except ValueError as exc:  # too long, or text it cannot take (a lone surrogate)
                raise OpenAIError(400, f"prompt: {exc}", param="prompt") from None
        if len(ids) > max_model_len:  # as vLLM's /tokenize
            raise OpenAIError(400, f"{field} is {len(ids)} tokens, more than the model's "
                                   f"maximum length ({max_model_len})", param=field)
        strs = ([token_text(engine.tokenizer, t)[0] for t in ids] if req.return_token_strs
                else None)
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids,
                                token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        """vLLM's: token ids as text (special tokens kept)."""
        check_request("/detokenize", req)
        vocab_size = engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(400, f"tokens must be ids in [0, {vocab_size}), got {bad[:5]}",
                              param="tokens")
        text = await asyncio.to_thread(engine.tokenizer.decode, req.tokens)
        return DetokenizeResponse(prompt=text)

    @app.get("/version")
    async def version():
        from cbatch import __version__

        return VersionResponse(version=__version__)

    return app


def _union_member(part) -> bool:
    """Whether a part of a pydantic error's location names the member of a union a value
    was tried as (``str``, ``list[int]``, ``NamedToolChoice``), not a field."""
    return isinstance(part, str) and (part[:1].isupper() or any(c in part for c in "[(-,")
                                      or part in ("str", "int", "float", "bool", "dict",
                                                  "list", "none"))


def run_server(args: argparse.Namespace, served_model_name: str | list[str],
               engine_kwargs: dict,
               chat_template: str | None = None, sock: socket.socket | None = None) -> None:
    """Start the engine, then serve until interrupted (Ctrl-C shuts down gracefully).
    ``sock``: bound to ``args.host:args.port`` already (``cbatch serve`` binds it before the
    model loads); None: uvicorn binds it once the engine is up."""
    server_box = []  # the server, once made: an engine that fails stops it

    def on_dead(exc: BaseException) -> None:
        for server in server_box:
            server.engine_failed(exc)

    engine, metrics = build_engine(args.model, args.max_waiting, served_model_name,
                                   on_dead=on_dead, **engine_kwargs)
    app = build_app(engine, metrics, served_model_name, args.shutdown_timeout, chat_template,
                    **guard_settings(args), **tool_settings(args))
    print(engine.memory_report(), flush=True)
    paths = engine.describe()  # a CPU engine's fast paths
    if paths:
        print("\n".join([f"{engine.config.device} fast paths:"] + format_paths(paths)),
              flush=True)
    config = uvicorn_config(app, args.host, args.port, args.shutdown_timeout,
                            args.header_timeout, args.write_timeout)
    raise_open_files_limit()
    server = server_class()(config)
    server.engine, server.shutdown_timeout = engine, args.shutdown_timeout
    server_box.append(server)
    if not engine.is_running:  # it failed before the server existed
        server.engine_failed(engine.error)
    if engine.config.speculative_config is not None:
        print(f"speculative decoding: {engine.config.speculative_config.describe()}", flush=True)
    names = ", ".join(map(repr, served_names(served_model_name, args.model)))
    print(f"serving {names} on http://{args.host}:{args.port} (/v1/completions, "
          "/v1/chat/completions, /v1/responses, /v1/models, /tokenize, /detokenize, /version, "
          "/health, /metrics)", flush=True)
    server.run(sockets=None if sock is None else [sock])
    if server.failed:
        raise SystemExit(1)
