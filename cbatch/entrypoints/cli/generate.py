"""``cbatch generate``: generate for prompts; one prompt streams its text as it grows."""

from __future__ import annotations

import argparse
import sys

from cbatch.entrypoints.cli.engine_args import add_engine_args, load_llm
from cbatch.sampling_params import SamplingParams


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The ``generate`` flags as SamplingParams (validated there, before any model loads)."""
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                          stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
                          stop=args.stop, min_tokens=args.min_tokens,
                          presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty,
                          bad_words=args.bad_word or None, n=args.n)


def _summary(out) -> str:
    m = out.metrics
    rate = f", {len(out.token_ids) / m.e2e:.1f} tokens/s" if m.e2e else ""
    return (f"({out.finish_reason}, {len(out.token_ids)} tokens, ttft {m.ttft * 1e3:.0f} ms"
            f"{rate})")


def stream(llm, prompt: str, params: SamplingParams):
    """Run one request, writing its text to stdout as it grows (the engine's incremental
    detokenizer holds back a character until its last byte); returns the final output.
    The prompt must have been checked (``validate_prompts``): it is written first."""
    sys.stdout.write(prompt)
    sys.stdout.flush()
    printed = [0]

    def write(out) -> None:
        text = out.text
        sys.stdout.write(text[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(text)

    (final,) = llm.generate([prompt], params, use_tqdm=False, on_output=write)
    sys.stdout.write("\n")
    return final


def run_generate(args: argparse.Namespace) -> None:
    params = sampling_params(args)  # checked before torch and the model load
    llm = load_llm(args)
    from cbatch.entrypoints.llm import validate_prompts

    # every prompt checked before any output (a progress bar, a streamed prompt)
    validate_prompts(llm.engine, args.prompt, [params] * len(args.prompt))
    if len(args.prompt) == 1 and params.n == 1:
        out = stream(llm, args.prompt[0], params)
        print(_summary(out), file=sys.stderr)
        return
    outs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
    for i, out in enumerate(outs):  # each prompt's n choices together
        prompt = args.prompt[i // params.n]
        choice = f" choice {i % params.n}" if params.n > 1 else ""
        print(f"--- {prompt!r}{choice} {_summary(out)}\n{prompt}{out.text}")


def add_generate_parser(sub, parents: list[argparse.ArgumentParser]) -> None:
    gen = sub.add_parser("generate", parents=parents, help="generate for prompts",
                         description="Generate for each --prompt.  One prompt streams its "
                         "text as it is generated; several run as one batch.")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=16,
                     help="new tokens per prompt at most (as SamplingParams and the server)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample from the smallest set of tokens holding this probability")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k most likely "
                     "tokens; 0 = off")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than "
                     "this times the most likely one; 0 = off")
    gen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="in [-2, 2]: subtracted from the logit of every token already out")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="in [-2, 2]: subtracted once per time a token is already out")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="> 0: divides the positive logits (multiplies the negative) of "
                     "every token in the prompt or the output; 1 = off")
    gen.add_argument("--min-tokens", type=int, default=0,
                     help="no EOS, stop token or stop string before this many tokens")
    gen.add_argument("--bad-word", action="append", default=[], metavar="TEXT",
                     help="never generate this text (repeatable)")
    gen.add_argument("--n", type=int, default=1,
                     help="completions per prompt (choice i samples with seed + i)")
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling seed (default: None, the engine's per request)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop before this text (repeatable)")
    gen.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                     help="stop after this token (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="keep going past the end-of-sequence token")
    add_engine_args(gen, exclude=("seed",))  # --seed is the sampling seed here
    gen.set_defaults(run=run_generate)
