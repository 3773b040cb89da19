// Paged decode attention on CUDA: one query token per sequence over its paged KV cache.
//
// Grid (query head, sequence, split); one CTA of NUM_WARPS warps per cell.  Grouped-query
// attention: query head h reads KV head h / (H / H_kv) of a cache that holds H_kv heads.  The
// H / H_kv CTAs of one KV head are neighbours in the grid, so they run together and all but
// the first read that head's blocks from L2 (vLLM's paged attention kernels do the same).
// A token's head row (HEAD_DIM elements) is read by a group of THREADS_PER_TOKEN lanes, 16
// bytes each, so a CTA has NUM_GROUPS tokens in flight, UNROLL deep.  Every group keeps its
// own online softmax state (max, sum, a slice of the output) in fp32 registers — a single
// pass over the context with no buffer that grows with it — and the groups are merged
// through shared memory at the end.
//
// Split-KV: each sequence's context is cut into partitions of kPartitionSize tokens, a size
// fixed in tokens and never derived from the batch, so a sequence's summation order depends on
// its own length only: its output is bitwise the same whatever it is batched with.  The grid
// gets one z-slice per partition of the widest block table; each CTA serves the tokens
// [split * partition, (split + 1) * partition) of its sequence and exits at once if that
// starts past the sequence's real length.  Partial outputs and log-sum-exps go to a workspace
// that merge_kernel combines in partition order.  When no block table holds more than one
// partition the merge is skipped, which changes no bit: merging one partition multiplies it
// by exp(0) = 1 and divides by 1.  Nothing here reads device memory on the host, so the op
// can be captured in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "../checks.h"
#include "../ops.h"

namespace cbatch {
namespace {

constexpr int kWarpSize = 32;
constexpr int kPartitionSize = 256;  // tokens

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// Loads 16 bytes (VEC elements) of T and widens them to fp32.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* ptr, float (&dst)[VEC]) {
  static_assert(sizeof(T) * VEC == 16, "one 16-byte load");
  const uint4 raw = *reinterpret_cast<const uint4*>(ptr);
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < VEC; ++i) dst[i] = to_float(elems[i]);
}

template <typename T, int HEAD_DIM, int NUM_WARPS, int UNROLL>
__global__ void __launch_bounds__(NUM_WARPS* kWarpSize)
    paged_decode_kernel(const T* __restrict__ query, const T* __restrict__ key_cache,
                        const T* __restrict__ value_cache, const int* __restrict__ block_tables,
                        const int* __restrict__ seq_lens, T* __restrict__ out,
                        float* __restrict__ partial_out, float* __restrict__ partial_lse,
                        float scale, int64_t query_stride, int num_heads, int num_kv_heads,
                        int block_size, int max_blocks, int partition, int num_splits) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int THREADS_PER_TOKEN = HEAD_DIM / VEC;
  static_assert(HEAD_DIM % VEC == 0 && kWarpSize % THREADS_PER_TOKEN == 0, "bad head_dim");
  constexpr int NUM_GROUPS = NUM_WARPS * kWarpSize / THREADS_PER_TOKEN;

  const int head = blockIdx.x, seq = blockIdx.y, split = blockIdx.z;
  const int seq_len = seq_lens[seq];
  const int start = split * partition;
  if (start >= seq_len) return;  // CTA-uniform: this partition is past the sequence's end
  const int end = min(start + partition, seq_len);

  const int group = threadIdx.x / THREADS_PER_TOKEN;
  const int lane = threadIdx.x % THREADS_PER_TOKEN;
  // Lanes of one group always run the same iterations, so shuffles are masked to the group.
  const unsigned group_mask =
      (THREADS_PER_TOKEN == kWarpSize ? 0xffffffffu : ((1u << THREADS_PER_TOKEN) - 1u))
      << ((threadIdx.x % kWarpSize) / THREADS_PER_TOKEN * THREADS_PER_TOKEN);

  float q[VEC];
  const T* q_row = query + seq * query_stride + head * HEAD_DIM + lane * VEC;
#pragma unroll
  for (int i = 0; i < VEC; ++i) q[i] = to_float(q_row[i]) * scale;

  const int* table = block_tables + static_cast<int64_t>(seq) * max_blocks;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * HEAD_DIM;
  const int64_t block_stride = token_stride * block_size;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int64_t head_offset = static_cast<int64_t>(kv_head) * HEAD_DIM + lane * VEC;

  float m = -INFINITY, l = 0.f, acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.f;

  for (int base = start + group; base < end; base += NUM_GROUPS * UNROLL) {
    float k[UNROLL][VEC], v[UNROLL][VEC], s[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // issue all loads first: UNROLL tokens in flight
      const int tok = base + u * NUM_GROUPS;
      if (tok < end) {
        const int64_t row = table[tok / block_size] * block_stride +
                            (tok % block_size) * token_stride + head_offset;
        load_vec<T, VEC>(key_cache + row, k[u]);
        load_vec<T, VEC>(value_cache + row, v[u]);
      }
    }
    float block_max = -INFINITY;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < VEC; ++i) dot += q[i] * k[u][i];
#pragma unroll
      for (int offset = THREADS_PER_TOKEN / 2; offset > 0; offset /= 2) {
        dot += __shfl_xor_sync(group_mask, dot, offset);
      }
      s[u] = base + u * NUM_GROUPS < end ? dot : -INFINITY;
      block_max = fmaxf(block_max, s[u]);
    }
    const float m_new = fmaxf(m, block_max);  // finite: the first token of this pass is valid
    const float alpha = __expf(m - m_new);
    l *= alpha;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= alpha;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const float p = __expf(s[u] - m_new);  // 0 for tokens past the end
      l += p;
      if (base + u * NUM_GROUPS < end) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += p * v[u][i];
      }
    }
    m = m_new;
  }

  // Merge the groups' states: out = sum_g e^(m_g - M) acc_g / sum_g e^(m_g - M) l_g.
  __shared__ float smem_m[NUM_GROUPS], smem_l[NUM_GROUPS];
  __shared__ float smem_acc[NUM_GROUPS][HEAD_DIM];
  if (lane == 0) {
    smem_m[group] = m;
    smem_l[group] = l;
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) smem_acc[group][lane * VEC + i] = acc[i];
  __syncthreads();

  float max_m = -INFINITY;
  for (int g = 0; g < NUM_GROUPS; ++g) max_m = fmaxf(max_m, smem_m[g]);
  float sum_l = 0.f;
  for (int g = 0; g < NUM_GROUPS; ++g) sum_l += smem_l[g] * __expf(smem_m[g] - max_m);
  const int64_t cell = static_cast<int64_t>(seq) * num_heads + head;
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float o = 0.f;
    for (int g = 0; g < NUM_GROUPS; ++g) o += smem_acc[g][d] * __expf(smem_m[g] - max_m);
    o /= sum_l;
    if (partial_out == nullptr) {
      out[cell * HEAD_DIM + d] = from_float<T>(o);
    } else {
      partial_out[(cell * num_splits + split) * HEAD_DIM + d] = o;
    }
  }
  if (partial_out != nullptr && threadIdx.x == 0) {
    partial_lse[cell * num_splits + split] = max_m + __logf(sum_l);
  }
}

// Grid (head, sequence), HEAD_DIM threads: combine a sequence's partitions by their lse.
template <typename T, int HEAD_DIM>
__global__ void merge_kernel(const float* __restrict__ partial_out,
                             const float* __restrict__ partial_lse,
                             const int* __restrict__ seq_lens, T* __restrict__ out,
                             int num_heads, int partition, int num_splits) {
  const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const int used = (seq_lens[seq] + partition - 1) / partition;
  const int64_t cell = static_cast<int64_t>(seq) * num_heads + head;
  const float* lse = partial_lse + cell * num_splits;
  float max_lse = -INFINITY;
  for (int i = 0; i < used; ++i) max_lse = fmaxf(max_lse, lse[i]);
  float o = 0.f, sum_w = 0.f;
  for (int i = 0; i < used; ++i) {
    const float w = __expf(lse[i] - max_lse);
    sum_w += w;
    o += w * partial_out[(cell * num_splits + i) * HEAD_DIM + d];
  }
  out[cell * HEAD_DIM + d] = from_float<T>(o / sum_w);
}

template <typename T, int HEAD_DIM>
void launch(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& out,
            float scale) {
  constexpr int kNumWarps = 4, kUnroll = 4;
  const int S = query.size(0), H = query.size(1), H_kv = key_cache.size(2);
  const int block_size = key_cache.size(1), max_blocks = block_tables.size(1);
  const int max_context = max_blocks * block_size;
  const int partition = max_context > kPartitionSize ? kPartitionSize : 0;  // 0: one pass
  const int num_splits = partition ? (max_context + partition - 1) / partition : 1;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  at::Tensor partial_out, partial_lse;
  if (partition) {
    const auto f32 = query.options().dtype(at::kFloat);
    partial_out = at::empty({S, H, num_splits, HEAD_DIM}, f32);
    partial_lse = at::empty({S, H, num_splits}, f32);
  }
  float* partial_out_ptr = partition ? partial_out.data_ptr<float>() : nullptr;
  float* partial_lse_ptr = partition ? partial_lse.data_ptr<float>() : nullptr;
  T* out_ptr = reinterpret_cast<T*>(out.data_ptr());
  const int* seq_lens_ptr = seq_lens.data_ptr<int>();

  const dim3 grid(H, S, num_splits);
  paged_decode_kernel<T, HEAD_DIM, kNumWarps, kUnroll><<<grid, kNumWarps * kWarpSize, 0, stream>>>(
      reinterpret_cast<const T*>(query.data_ptr()), reinterpret_cast<const T*>(key_cache.data_ptr()),
      reinterpret_cast<const T*>(value_cache.data_ptr()), block_tables.data_ptr<int>(),
      seq_lens_ptr, out_ptr, partial_out_ptr, partial_lse_ptr, scale, query.stride(0), H,
      H_kv, block_size, max_blocks, partition ? partition : max_context, num_splits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (partition) {
    merge_kernel<T, HEAD_DIM><<<dim3(H, S), HEAD_DIM, 0, stream>>>(
        partial_out_ptr, partial_lse_ptr, seq_lens_ptr, out_ptr, H, partition, num_splits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename T>
void dispatch_head_dim(const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& seq_lens, at::Tensor& out, float scale) {
  switch (query.size(2)) {
    case 64:
      return launch<T, 64>(query, key_cache, value_cache, block_tables, seq_lens, out, scale);
    case 128:
      return launch<T, 128>(query, key_cache, value_cache, block_tables, seq_lens, out, scale);
    default:
      TORCH_CHECK_VALUE(false, "the CUDA decode kernel supports head_dim 64 and 128, got ",
                        query.size(2), "; use backend='triton' (cbatch.ops picks it by itself)");
  }
}

}  // namespace

at::Tensor paged_decode_attention_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache,
                                       const at::Tensor& block_tables,
                                       const at::Tensor& seq_lens, double scale) {
  check_attention_args(query, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK_VALUE(query.size(0) == seq_lens.size(0), "decode takes one query token per "
                    "sequence: query has ", query.size(0), " rows for ", seq_lens.size(0),
                    " sequences");
  TORCH_CHECK_VALUE(query.size(0) > 0, "empty batch: seq_lens has no sequences");
  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (out.numel() == 0) return out;  // no heads or an empty head: no kernel to launch
  const float s = static_cast<float>(scale);
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_head_dim<float>(query, key_cache, value_cache, block_tables, seq_lens, out, s);
      break;
    case at::kHalf:
      dispatch_head_dim<__half>(query, key_cache, value_cache, block_tables, seq_lens, out, s);
      break;
    case at::kBFloat16:
      dispatch_head_dim<__nv_bfloat16>(query, key_cache, value_cache, block_tables, seq_lens,
                                       out, s);
      break;
    default:
      TORCH_CHECK_TYPE(false, "unsupported dtype ", query.scalar_type());
  }
  return out;
}

}  // namespace cbatch
