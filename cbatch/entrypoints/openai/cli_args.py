"""The flags of ``cbatch serve`` that bound what clients can do to the server (limits,
timeouts, authentication) or set what it offers them (tool calls), and the check of every
serve flag before anything loads.

Parsing them imports nothing but argparse, like the rest of the command line.
"""

from __future__ import annotations

import argparse
import math

from cbatch import envs
from cbatch.entrypoints.openai.reasoning_parsers import REASONING_PARSERS  # (no imports)
from cbatch.entrypoints.openai.tool_parsers import TOOL_PARSERS  # (the standard library)

DEFAULT_MAX_REQUEST_BYTES = 16 << 20
DEFAULT_LIMIT_CONCURRENCY = 512
DEFAULT_MAX_QUEUED_REQUESTS = 4 * DEFAULT_LIMIT_CONCURRENCY  # a burst of 4x is served


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on /v1 routes, /tokenize "
                             "and /detokenize (default: $CBATCH_API_KEY; /health, /metrics and "
                             "/version stay open)")
    parser.add_argument("--allowed-hosts", default=None, metavar="HOST[,HOST...]",
                        help="the Host names this server answers, '*' for any (default: "
                             "loopback names when bound to a loopback address, else any)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="larger request bodies get 413 before they are parsed")
    parser.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                        help="requests served at once; more wait for a slot (/health and "
                             "/metrics never wait)")
    parser.add_argument("--max-queued-requests", type=int,
                        default=DEFAULT_MAX_QUEUED_REQUESTS,
                        help="requests that may wait for a slot; more get 503 at once")
    parser.add_argument("--queue-timeout", type=float, default=30.0,
                        help="seconds a request may wait for a slot (else 503)")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a connection may take to send a request's headers")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request's body may take to arrive (else 408)")
    # tool calls, vLLM's flags: without them tool_choice "auto" is refused
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto" in /v1/chat/completions: the model decides '
                             "when to call tools, and --tool-call-parser finds its calls")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="the format of the model's tool calls, as vLLM's parsers read "
                             "them: hermes (<tool_call>{...}</tool_call>: Qwen2, Qwen2.5, "
                             "Qwen3), llama3_json ({\"name\": ..., \"parameters\": ...}: "
                             "Llama 3.1, 3.2), mistral ([TOOL_CALLS]...: Mistral), pythonic "
                             "([f(a=1)]: Llama 3.2 and 4 pythonic templates)")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="put a reasoning model's <think>...</think> in reasoning_content "
                             "(qwen3: when the reply opens the block; deepseek_r1: the prompt "
                             "opened it)")
    # vLLM's flags that a `vllm serve` command line passes: applied where they mean something
    # here, accepted where they are always true, refused where they cannot be (check_serve_args)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="vLLM's: 1, as cbatch runs a model on one device; to use several "
                             "devices, run one engine on each with --num-replicas")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="vLLM's, accepted: cbatch runs its own code for every "
                             "architecture it serves, never a checkpoint's")
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="vLLM's, always on here: a step prefills at most "
                             "--max-num-batched-tokens tokens, a longer prompt in chunks (the "
                             "default; --no-enable-chunked-prefill is refused)")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="vLLM's, accepted: cbatch never logs a request's contents")
    parser.add_argument("--write-timeout", type=float, default=30.0,
                        help="seconds a client may leave its response unread before the "
                             "connection is closed and its request aborted")
    parser.add_argument("--no-special-tokens-in-content", dest="special_tokens_in_content",
                        action="store_false",
                        help="encode chat messages' contents as plain text, so that a content "
                             "spelling the template's special tokens (<|im_end|>) cannot forge "
                             "a turn (default: read them, as vLLM and transformers do)")


def check_serve_args(args: argparse.Namespace) -> None:
    """ValueError naming the first serve flag out of range (before any model loads, and
    before uvicorn would fail on it with a traceback)."""
    def need(ok: bool, flag: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{flag} must be {what}, got {getattr(args, _dest(flag))!r}")

    need(0 <= args.port <= 65535, "--port", "in [0, 65535]")
    need(args.threads is None or args.threads >= 1, "--threads", ">= 1")
    need(math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0,
         "--shutdown-timeout", "a number of seconds >= 0")
    need(args.max_waiting >= 1, "--max-waiting", ">= 1")
    need(args.num_replicas >= 1, "--num-replicas", ">= 1")
    need(args.tensor_parallel_size >= 1, "--tensor-parallel-size", ">= 1")
    if args.tensor_parallel_size > 1:
        n = args.tensor_parallel_size
        raise ValueError(f"--tensor-parallel-size {n}: cbatch runs a model on one device (it "
                         f"has no tensor parallelism); to use {n} devices, serve {n} replicas, "
                         f"one engine on each, with --num-replicas {n} (Ray Serve)")
    if args.enable_chunked_prefill is False:
        raise ValueError("--no-enable-chunked-prefill: cbatch always prefills a prompt longer "
                         "than --max-num-batched-tokens in chunks; it cannot be turned off")
    need(args.max_request_bytes >= 1, "--max-request-bytes", ">= 1")
    need(args.limit_concurrency >= 1, "--limit-concurrency", ">= 1")
    need(args.max_queued_requests >= 0, "--max-queued-requests", ">= 0")
    for flag in ("--header-timeout", "--body-timeout", "--queue-timeout", "--write-timeout"):
        value = getattr(args, _dest(flag))
        need(math.isfinite(value) and value > 0, flag, "a number of seconds > 0")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format of "
                         f"the model's calls: {', '.join(sorted(TOOL_PARSERS))})")
    if args.api_key is not None:
        need(bool(args.api_key.strip()), "--api-key", "a non-empty string")
    elif envs.CBATCH_API_KEY and not envs.CBATCH_API_KEY.strip():
        raise ValueError("CBATCH_API_KEY must be a non-empty string, got "
                         f"{envs.CBATCH_API_KEY!r} (unset it to serve without a key)")
    if args.allowed_hosts is not None:
        from cbatch.entrypoints.openai.hosts import check_allowed_hosts

        check_allowed_hosts(_host_list(args.allowed_hosts))


def vllm_notes(args: argparse.Namespace) -> list[str]:
    """One log line for each vLLM flag given that changes nothing here (a vLLM user then
    knows what happened to it)."""
    notes = []
    if args.trust_remote_code:
        notes.append("--trust-remote-code: cbatch runs its own code for every architecture "
                     "it serves; none of the checkpoint's code runs")
    if args.enable_chunked_prefill:
        notes.append("--enable-chunked-prefill: always on in cbatch (a step prefills at most "
                     f"--max-num-batched-tokens={args.max_num_batched_tokens} tokens)")
    return notes


def guard_settings(args: argparse.Namespace) -> dict:
    """The keywords of ``build_app`` that the serve flags set: its :class:`RequestGuard`'s
    and what chat contents may spell."""
    from cbatch.entrypoints.openai.hosts import default_allowed_hosts

    allowed = (default_allowed_hosts(args.host) if args.allowed_hosts is None
               else _host_list(args.allowed_hosts))
    return dict(api_key=args.api_key or envs.CBATCH_API_KEY or None,
                allowed_hosts=allowed, max_request_bytes=args.max_request_bytes,
                body_timeout=args.body_timeout, limit_concurrency=args.limit_concurrency,
                max_queued_requests=args.max_queued_requests,
                queue_timeout=args.queue_timeout,
                special_tokens_in_content=args.special_tokens_in_content)


def _host_list(value: str) -> list[str]:
    return [h.strip() for h in value.split(",") if h.strip()]


def tool_settings(args: argparse.Namespace) -> dict:
    """The keywords of ``build_app`` that the tool-call and reasoning flags set: the parser
    of tool_choice "auto" (None: "auto" is refused), and of the reasoning."""
    return dict(tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice
                else None, reasoning_parser=args.reasoning_parser)


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")
