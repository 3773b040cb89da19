"""``cbatch serve``: the OpenAI-compatible server, or ``--num-replicas`` of them behind Ray
Serve (the server's packages load only when it runs)."""

from __future__ import annotations

import argparse

from cbatch.entrypoints.cli.engine_args import (DEFAULT_MODEL, add_engine_args, engine_kwargs,
                                                resolve_device_and_dtype)
from cbatch.entrypoints.openai.cli_args import (add_server_args, check_serve_args,  # no torch
                                                guard_settings)


def resolve_model(args: argparse.Namespace) -> None:
    """``cbatch serve MODEL`` and ``cbatch serve --model MODEL`` are the same; both at once
    must agree."""
    if args.model_tag is None:
        return
    if args.model not in (args.model_tag, DEFAULT_MODEL):
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model "
                         f"{args.model!r}; give it once")
    args.model = args.model_tag


def run_serve(args: argparse.Namespace) -> None:
    """One engine behind the OpenAI API, or ``--num-replicas`` engines behind Ray Serve."""
    from cbatch.entrypoints.openai.serving_chat import read_chat_template

    check_serve_args(args)  # before anything loads, and before uvicorn would trip on them
    resolve_model(args)
    template = None if args.chat_template is None else read_chat_template(args.chat_template)
    resolve_device_and_dtype(args)
    name = args.served_model_name or args.model
    if args.num_replicas > 1:
        from cbatch.entrypoints.ray_serve import serve

        gpus = 1.0 if args.device.startswith("cuda") else 0.0  # one replica per GPU
        serve(args.model, args.num_replicas, args.host, args.port, served_model_name=name,
              num_gpus_per_replica=gpus, max_waiting=args.max_waiting,
              chat_template=template, guard=guard_settings(args), **engine_kwargs(args))
        return
    from cbatch.entrypoints.openai.api_server import run_server

    run_server(args, name, engine_kwargs(args), template)


def add_serve_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("serve", parents=parents, help="serve the OpenAI API over HTTP",
                            description="Serve MODEL (or --model) with the OpenAI API over "
                            "HTTP: /v1/completions, /v1/chat/completions, /v1/models, /health, "
                            "/metrics.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as --model (default: --model's)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the model's)")
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
