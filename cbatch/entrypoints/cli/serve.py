"""``cbatch serve``: the OpenAI-compatible server, or ``--num-replicas`` of them behind Ray
Serve (the server's packages load only when it runs)."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import socket

from cbatch.entrypoints.cli.engine_args import (add_engine_args, engine_kwargs,
                                                resolve_device_and_dtype, resolve_model)
from cbatch.entrypoints.openai.cli_args import (add_server_args, check_serve_args,  # no torch
                                                guard_settings, vllm_notes)
from cbatch.logger import init_logger

__all__ = ["add_serve_parser", "bind_socket", "require_packages", "resolve_model", "run_serve"]

logger = init_logger("cbatch.serve")

# the modules each way of serving imports, and the extra (pyproject.toml) that installs them
SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")
RAY_MODULES = ("ray",) + SERVER_MODULES


def require_packages(num_replicas: int) -> None:
    """ModuleNotFoundError naming the extra to install, before anything loads, when the
    server's packages (or Ray's, for ``--num-replicas`` > 1) are missing."""
    modules, extra, what = (RAY_MODULES, "ray", "cbatch serve --num-replicas needs Ray Serve"
                            ) if num_replicas > 1 else (SERVER_MODULES, "serve",
                                                        "cbatch serve needs the server's packages")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"{what}: pip install 'cbatch[{extra}]' (missing: "
                                  f"{', '.join(missing)})", name=missing[0])


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, made before the model loads (as vLLM's
    ``create_server_socket``), so that a port in use fails at once and no other process can
    take the port while the model loads; uvicorn listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            why = "is in use (another server?); stop it or pick another with --port"
        elif e.errno == errno.EACCES:
            why = "needs privileges here (ports below 1024 do); pick another with --port"
        else:
            why = f"cannot be bound ({e.strerror or e}); check --host and --port"
        raise ValueError(f"port {port} on {host} {why}") from None
    except socket.gaierror as e:
        sock.close()
        raise ValueError(f"--host {host!r} is not an address of this machine ({e})") from None
    return sock


def run_serve(args: argparse.Namespace) -> None:
    """One engine behind the OpenAI API, or ``--num-replicas`` engines behind Ray Serve."""
    check_serve_args(args)  # before anything loads, and before uvicorn would trip on them
    for note in vllm_notes(args):
        logger.info("%s", note)
    resolve_model(args)
    require_packages(args.num_replicas)
    # the port before torch and the model: a busy one fails in well under a second
    sock = bind_socket(args.host, args.port)
    if args.num_replicas > 1:
        sock.close()  # Ray Serve's proxy binds it itself: this only checked it is free
    try:
        _serve(args, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket) -> None:
    from cbatch.entrypoints.openai.chat_utils import read_chat_template

    template = None if args.chat_template is None else read_chat_template(args.chat_template)
    resolve_device_and_dtype(args)
    names = args.served_model_name or [args.model]
    if args.num_replicas > 1:
        from cbatch.entrypoints.ray_serve import serve

        gpus = 1.0 if args.device.startswith("cuda") else 0.0  # one replica per GPU
        serve(args.model, args.num_replicas, args.host, args.port, served_model_name=names,
              num_gpus_per_replica=gpus, max_waiting=args.max_waiting,
              chat_template=template, guard=guard_settings(args), **engine_kwargs(args))
        return
    from cbatch.entrypoints.openai.api_server import run_server

    run_server(args, names, engine_kwargs(args), template, sock=sock)


def add_serve_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("serve", parents=parents, help="serve the OpenAI API over HTTP",
                            description="Serve MODEL (or --model) with the OpenAI API over "
                            "HTTP: /v1/completions, /v1/chat/completions, /v1/responses, "
                            "/v1/models, /tokenize, /detokenize, /version, /health, /metrics.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as --model (default: --model's)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model names clients use, each one answered and listed by "
                             "/v1/models; the first names the model in /metrics (default: "
                             "the model's)")
    parser.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                        help="a Jinja chat template, or a file holding one, for "
                             "/v1/chat/completions (default: the checkpoint's own)")
    parser.add_argument("--max-waiting", type=int, default=1024,
                        help="requests waiting beyond this are refused with 503")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds running requests get to finish at shutdown (SIGTERM, "
                             "Ctrl-C); a second signal exits at once")
    parser.add_argument("--num-replicas", type=int, default=1,
                        help="> 1: that many engines behind one route with Ray Serve")
    add_server_args(parser)  # limits, timeouts, authentication
    add_engine_args(parser)
    parser.set_defaults(run=run_serve)
