"""The OpenAI-compatible HTTP server: a thin FastAPI layer over one :class:`AsyncEngine`.

    cbatch serve gpt2 --host 127.0.0.1 --port 8000

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus).  Every error is OpenAI's error JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from cbatch.core.async_engine import AsyncEngine, EngineDeadError
from cbatch.entrypoints.openai.metrics import ServerMetrics
from cbatch.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                ModelCard, ModelList, OpenAIError)
from cbatch.entrypoints.openai.serving_chat import (OpenAIServingChat, load_chat_template,
                                                    load_special_tokens)
from cbatch.entrypoints.openai.serving_completion import OpenAIServingCompletion


def build_engine(model: str, max_waiting: int = 1024, served_model_name: str | None = None,
                 **engine_kwargs) -> tuple[AsyncEngine, ServerMetrics]:
    """An AsyncEngine whose finished requests feed a fresh set of server metrics."""
    metrics = ServerMetrics(served_model_name or model)
    engine = AsyncEngine(model, max_waiting=max_waiting, on_finished=metrics.observe,
                         **engine_kwargs)
    metrics.attach(engine)
    return engine, metrics


def build_app(engine: AsyncEngine, metrics: ServerMetrics, served_model_name: str,
              shutdown_timeout: float = 0.0, chat_template: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``served_model_name``.  When the app shuts
    down it shuts the engine down, giving running requests ``shutdown_timeout`` seconds.
    ``chat_template`` (Jinja) replaces the one the checkpoint ships, if any."""
    from cbatch.models.loader import resolve_checkpoint_dir

    config = engine.engine.config
    max_model_len = engine.engine.max_model_len
    checkpoint = None if config.model.startswith("random:") else resolve_checkpoint_dir(
        config.model)
    template = chat_template
    if template is None and checkpoint is not None:
        template = load_chat_template(checkpoint)
    completions = OpenAIServingCompletion(engine, served_model_name)
    chat = OpenAIServingChat(engine, served_model_name, template,
                             load_special_tokens(checkpoint))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown, shutdown_timeout)

    app = FastAPI(title="cbatch", lifespan=lifespan)
    app.state.engine = engine

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                                   f"{served_model_name!r}", param="model",
                              code="model_not_found")

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}"
                            for e in exc.errors())
        return JSONResponse(OpenAIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return JSONResponse(OpenAIError(503, str(exc), "service_unavailable").body(),
                            status_code=503)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=max_model_len)])

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw_request: Request):
        check_model(req.model)
        return await completions.create(req, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw_request: Request):
        check_model(req.model)
        return await chat.create(req, raw_request)

    return app


def run_server(args: argparse.Namespace, served_model_name: str, engine_kwargs: dict,
               chat_template: str | None = None) -> None:
    """Start the engine, then serve until interrupted (Ctrl-C shuts down gracefully)."""
    import torch
    import uvicorn

    if args.threads:
        torch.set_num_threads(args.threads)
    engine, metrics = build_engine(args.model, args.max_waiting, served_model_name,
                                   **engine_kwargs)
    app = build_app(engine, metrics, served_model_name, args.shutdown_timeout, chat_template)
    print(engine.engine.kv_cache.memory_report(engine.engine.max_model_len), flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
