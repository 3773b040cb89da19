"""``cbatch serve``: the OpenAI-compatible server, or ``--num-replicas`` of them behind Ray
Serve (the server's packages load only when it runs)."""

from __future__ import annotations

import argparse

from cbatch.entrypoints.cli.engine_args import (add_engine_args, engine_kwargs,
                                                resolve_device_and_dtype)


def run_serve(args: argparse.Namespace) -> None:
    """One engine behind the OpenAI API, or ``--num-replicas`` engines behind Ray Serve."""
    resolve_device_and_dtype(args)
    name = args.served_model_name or args.model
    if args.num_replicas > 1:
        from cbatch.entrypoints.ray_serve import serve

        gpus = 1.0 if args.device.startswith("cuda") else 0.0  # one replica per GPU
        serve(args.model, args.num_replicas, args.host, args.port, served_model_name=name,
              num_gpus_per_replica=gpus, max_waiting=args.max_waiting, threads=args.threads,
              **engine_kwargs(args))
        return
    from cbatch.entrypoints.openai.api_server import run_server

    run_server(args, name, engine_kwargs(args))


def add_serve_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("serve", parents=parents, help="serve the OpenAI API over HTTP")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: --model)")
    parser.add_argument("--max-waiting", type=int, default=1024,
                        help="requests waiting beyond this are refused with 503")
    parser.add_argument("--shutdown-timeout", type=float, default=0.0,
                        help="seconds running requests get to finish at shutdown")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--num-replicas", type=int, default=1,
                        help="> 1: that many engines behind one route with Ray Serve")
    add_engine_args(parser)
    parser.set_defaults(run=run_serve)
