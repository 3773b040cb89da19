"""A small CUDA workload for compute-sanitizer: every cbatch GPU kernel once on a ragged
batch, then a short engine run (skipped with --kernels-only, for the slower tools).

    compute-sanitizer --tool memcheck python scripts/sanitize_run.py
    compute-sanitizer --tool racecheck python scripts/sanitize_run.py --kernels-only
"""

import sys

import torch

from cbatch import LLM, SamplingParams, ops
from cbatch.ops import reference


def paged(lens, new, H=4, D=64, block_size=16, dtype=torch.float16):
    blocks = [-(-n // block_size) for n in lens]
    perm = torch.randperm(sum(blocks)).int()
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    offset = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = perm[offset:offset + n]
        offset += n
    cache = torch.randn(2, sum(blocks), block_size, H, D, dtype=dtype, device="cuda")
    q = torch.randn(sum(new), H, D, dtype=dtype, device="cuda")
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    return q, cache[0], cache[1], tables.cuda(), cu.cuda(), torch.tensor(
        lens, dtype=torch.int32, device="cuda")


def main():
    torch.manual_seed(0)
    status = ops.available_backends()
    lens = [1, 15, 16, 17, 700, 3000]
    q, kc, vc, bt, _, sl = paged(lens, [1] * len(lens))
    ref = reference.paged_decode_attention(q, kc, vc, bt, sl).float()
    for backend in ("cuda", "triton"):
        if status[backend].available:
            out = ops.paged_decode_attention(q, kc, vc, bt, sl, backend=backend)
            print(f"decode {backend}: max err {(out.float() - ref).abs().max().item():.3g}")
    q, kc, vc, bt, cu, sl = paged([40, 300, 17], [40, 100, 1])
    ref = reference.paged_prefill_attention(q, kc, vc, bt, cu, sl).float()
    out = ops.paged_prefill_attention(q, kc, vc, bt, cu, sl, backend="triton")
    print(f"prefill triton: max err {(out.float() - ref).abs().max().item():.3g}")
    k = torch.randn(5, 4, 64, dtype=torch.float16, device="cuda")
    slots = torch.tensor([3, -1, 40, 7, 100], device="cuda")
    for backend in ("cuda", "triton"):
        if status[backend].available:
            ops.write_kv_cache(k, k, kc, vc, slots, backend=backend)
    torch.cuda.synchronize()
    if "--kernels-only" in sys.argv[1:]:
        return
    llm = LLM("random:tiny", device="cuda", dtype="float16", max_num_seqs=4,
              max_num_batched_tokens=32, block_size=16, num_blocks=16)
    outs = llm.generate([[1, 2, 3], list(range(50)), [7] * 20], SamplingParams(
        max_tokens=8, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    print("engine:", [len(o.token_ids) for o in outs], "preemptions",
          llm.engine.stats().num_preemptions)


if __name__ == "__main__":
    main()
