// GGUF's quantized blocks unpacked on the CPU: one pass over a tensor's bytes, where the
// pure-torch unpackers (cbatch/models/gguf/legacy_quants.py, k_quants.py) make ten or more
// (their nibbles, bit planes and scale fields each a tensor of their own), which was the
// largest share of a GGUF file's load (benchmarks/NOTES.md, "Loading a model: cold start and
// memory after load").
//
// The same output as those unpackers, bit for bit (tests/models/test_gguf_blocks.py compares
// them): for blocks [B, type_size] of one type, the levels [B, block_size] (uint8; int8 for
// Q8_0), the scales fp32 [B, S] and the zero points int8 [B, S] or the mins fp32 [B, S],
// S = block_size / group_size.  The byte layouts are those modules' docstrings'.  A K-quant's
// scale is d * sc in fp32 (one rounding, as gguf-py's dequantize forms it).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <cstring>
#include <string>
#include <tuple>

#include "../ops.h"
#include "cpu_options.h"

namespace cbatch {
namespace {

inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// 2 * n levels from n bytes of nibbles, chunk bytes at a time: their low nibbles, then their
// high ones (every 4-bit field of GGUF).
inline void nibbles(const uint8_t* qs, int n, int chunk, uint8_t* out) {
  for (int c = 0; c < n; c += chunk, out += 2 * chunk) {
    for (int i = 0; i < chunk; ++i) {
      out[i] = qs[c + i] & 0x0F;
      out[chunk + i] = qs[c + i] >> 4;
    }
  }
}

// Q4_K's and Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins.
inline void scales_and_mins(const uint8_t* p, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = p[j] & 0x3F;
    mn[j] = p[4 + j] & 0x3F;
    sc[4 + j] = (p[8 + j] & 0x0F) | ((p[j] >> 2) & 0x30);
    mn[4 + j] = (p[8 + j] >> 4) | ((p[4 + j] >> 2) & 0x30);
  }
}

// One block of each type: its levels q, scales s and offsets (zero points z or mins m).
struct Out {
  uint8_t* q;
  float* s;
  int8_t* z;
  float* m;
};

void q8_0(const uint8_t* b, Out o) {
  o.s[0] = fp16(b);
  std::memcpy(o.q, b + 2, 32);
  o.z[0] = 0;
}

void q4_0(const uint8_t* b, Out o) {
  o.s[0] = fp16(b);
  nibbles(b + 2, 16, 16, o.q);
  o.z[0] = 8;
}

void q4_1(const uint8_t* b, Out o) {
  o.s[0] = fp16(b);
  o.m[0] = -fp16(b + 2);
  nibbles(b + 4, 16, 16, o.q);
}

inline void fifth_bits(const uint8_t* qh, uint8_t* q) {
  uint32_t h;
  std::memcpy(&h, qh, 4);  // little-endian: bit j is element j's
  for (int j = 0; j < 32; ++j) q[j] |= ((h >> j) & 1) << 4;
}

void q5_0(const uint8_t* b, Out o) {
  o.s[0] = fp16(b);
  nibbles(b + 6, 16, 16, o.q);
  fifth_bits(b + 2, o.q);
  o.z[0] = 16;
}

void q5_1(const uint8_t* b, Out o) {
  o.s[0] = fp16(b);
  o.m[0] = -fp16(b + 2);
  nibbles(b + 8, 16, 16, o.q);
  fifth_bits(b + 4, o.q);
}

// Q4_K's and Q5_K's scales d * sc and mins dmin * m, one per sub-block of 32.
inline void k_scales(const uint8_t* b, Out o) {
  const float d = fp16(b), dmin = fp16(b + 2);
  uint8_t sc[8], mn[8];
  scales_and_mins(b + 4, sc, mn);
  for (int j = 0; j < 8; ++j) o.s[j] = d * static_cast<float>(sc[j]), o.m[j] = dmin * mn[j];
}

void q4_k(const uint8_t* b, Out o) {
  k_scales(b, o);
  nibbles(b + 16, 128, 32, o.q);
}

void q5_k(const uint8_t* b, Out o) {
  k_scales(b, o);
  nibbles(b + 48, 128, 32, o.q);
  const uint8_t* qh = b + 16;  // bit s of qh[i]: the fifth bit of element i of sub-block s
  for (int s = 0; s < 8; ++s) {
    for (int i = 0; i < 32; ++i) o.q[32 * s + i] |= ((qh[i] >> s) & 1) << 4;
  }
}

void q6_k(const uint8_t* b, Out o) {
  nibbles(b, 128, 64, o.q);
  const uint8_t* qh = b + 128;  // per half h: 32 bytes, 2 bits of 4 runs of 32 elements
  for (int h = 0; h < 2; ++h) {
    for (int p = 0; p < 4; ++p) {
      for (int i = 0; i < 32; ++i) {
        o.q[128 * h + 32 * p + i] |= ((qh[32 * h + i] >> (2 * p)) & 3) << 4;
      }
    }
  }
  const float d = fp16(b + 208);
  for (int j = 0; j < 16; ++j) {
    o.s[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
    o.z[j] = 32;
  }
}

struct Format {
  const char* name;
  int block_size, type_size, group_size;
  bool mins;  // mins (fp32) rather than zero points (int8)
  void (*unpack)(const uint8_t*, Out);
};

constexpr Format kFormats[] = {
    {"Q8_0", 32, 34, 32, false, q8_0}, {"Q4_0", 32, 18, 32, false, q4_0},
    {"Q4_1", 32, 20, 32, true, q4_1},  {"Q5_0", 32, 22, 32, false, q5_0},
    {"Q5_1", 32, 24, 32, true, q5_1},  {"Q4_K", 256, 144, 32, true, q4_k},
    {"Q5_K", 256, 176, 32, true, q5_k}, {"Q6_K", 256, 210, 16, false, q6_k},
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> gguf_unpack_cpu(const at::Tensor& blocks,
                                                               const std::string& qtype) {
  const Format* f = nullptr;
  for (const Format& one : kFormats) {
    if (qtype == one.name) f = &one;
  }
  TORCH_CHECK_VALUE(f != nullptr, "gguf_unpack: ", qtype, " is not a block type it unpacks");
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                        blocks.size(1) == f->type_size && blocks.is_contiguous() &&
                        blocks.device().is_cpu(),
                    "gguf_unpack: ", qtype, " blocks are contiguous uint8 [B, ", f->type_size,
                    "] on the CPU, got ", blocks.scalar_type(), " ", blocks.sizes());
  const int64_t B = blocks.size(0);
  const int S = f->block_size / f->group_size;
  const auto bytes = blocks.options();
  const auto levels = qtype == "Q8_0" ? at::kChar : at::kByte;
  at::Tensor q = at::empty({B, f->block_size}, bytes.dtype(levels));
  at::Tensor scales = at::empty({B, S}, bytes.dtype(at::kFloat));
  at::Tensor offset = at::empty({B, S}, bytes.dtype(f->mins ? at::kFloat : at::kChar));
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* q_out = static_cast<uint8_t*>(q.data_ptr());
  float* s_out = scales.data_ptr<float>();
  int8_t* z_out = f->mins ? nullptr : offset.data_ptr<int8_t>();
  float* m_out = f->mins ? offset.data_ptr<float>() : nullptr;
  at::parallel_for(0, B, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      f->unpack(in + i * f->type_size,
                Out{q_out + i * f->block_size, s_out + i * S, z_out ? z_out + i * S : nullptr,
                    m_out ? m_out + i * S : nullptr});
    }
  });
  count_path(CpuPath::kGgufUnpackCpu);
  return {q, scales, offset};
}

}  // namespace cbatch
