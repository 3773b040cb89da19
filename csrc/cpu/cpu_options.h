// What the CPU kernels may run and what they ran: the options that set_cpu_options sets (an
// ISA cap, the attention step and AMX), read by the kernels on every call, and one counter per
// kernel path, counted once per op call where that path runs (cpu_path_names and
// cpu_path_counts report them, so that a test can tell which path an op took).
#pragma once

#include <atomic>
#include <cstdint>

namespace cbatch {

// "avx2": the kernels take the paths of a CPU without AVX-512, so that those are tested and
// compared on any x86 machine.
extern std::atomic<bool> g_cpu_isa_avx2;
// "generic": attention runs its portable step whatever the CPU.
extern std::atomic<bool> g_cpu_attention_generic;

// "": AMX tiles where the CPU has them; "off": never; "model": the AMX paths (W8A8's and W4A8's
// where AVX512-VNNI runs, the bf16 linear's where AVX512-BF16 does) on amx_tile_ops.h's software
// model of the tile instructions (for their tests).
enum class AmxOption : int { kCpu = 0, kOff = 1, kModel = 2 };
extern std::atomic<int> g_cpu_amx;

inline bool cpu_isa_capped_at_avx2() { return g_cpu_isa_avx2.load(std::memory_order_relaxed); }
inline bool cpu_attention_generic() {
  return g_cpu_attention_generic.load(std::memory_order_relaxed);
}
inline AmxOption cpu_amx_option() {
  return static_cast<AmxOption>(g_cpu_amx.load(std::memory_order_relaxed));
}

// Every path an op can take; kCpuPathNames (cpu_options.cpp) holds their names, in this order.
enum class CpuPath : int {
  kLinearAvx512,
  kLinearAvx2,
  kLinearAmx,
  kLinearBf16Avx2,  // bf16 on the AVX2 tiles (linear.avx2 counts fp32 there)
  kQuantizedLinearW8Avx512,
  kQuantizedLinearW8Avx2,
  kQuantizedLinearW4Avx512,
  kQuantizedLinearW4Avx2,
  kQuantizedLinearW4Avx512Bf16,  // int4 on a bf16 x: vdpbf16ps
  kQuantizedLinearW8A8Vnni,
  kQuantizedLinearW8A8Avx2,
  kQuantizedLinearW8A8Amx,  // AMX-INT8 tiles (or their model: set_cpu_options)
  kQuantizedLinearW4A8Vnni,
  kQuantizedLinearW4A8Avx2,
  kQuantizedLinearW4A8Amx,  // AMX-INT8 tiles (or their model)
  kQuantizedLinearW8A8GroupedAvx2,  // W4A8's op on 8-bit weights (W8A8 per group)
  kQuantizedLinearW8A8GroupedVnni,  // the same on AVX512-VNNI (vpdpbusd, the weights flipped)
  kGreedyHeadInt8Avx512Vnni,
  kGreedyHeadInt8Avx2,
  kGreedyHeadBf16Avx512,
  kGreedyHeadBf16Avx2,
  kGreedyHeadKernel,
  kGreedyHeadUnsettledRows,  // counts rows, not calls: those the screen left to the kernel
  kDecodeAttentionAvx512,
  kDecodeAttentionAvx512Bf16,  // bf16: q K^T on vdpbf16ps
  kDecodeAttentionAvx2,
  kDecodeAttentionGeneric,
  kPrefillAttentionAvx512,
  kPrefillAttentionAvx512Bf16,
  kPrefillAttentionAvx2,
  kPrefillAttentionGeneric,
  kPrefillAttentionTransposedRows,  // counts row steps (a row over 16 keys) on transposed keys
  kArgmaxAvx512,
  kArgmaxGeneric,
  kSampleAvx512,
  kSampleAvx2,
  kSampleGeneric,
  kPenaltiesCpu,
  kBitmaskCpu,
  kWriteKvCacheCpu,
  kRmsNormAvx2,
  kRmsNormGeneric,
  kFusedAddRmsNormAvx2,
  kFusedAddRmsNormGeneric,
  kSiluAndMulAvx2,
  kSiluAndMulGeneric,
  kRotaryEmbeddingAvx2,
  kRotaryEmbeddingGeneric,
  kDecoderLayersCpu,  // one call of a step's decoder layers (decoder_layers.cpp)
  kGgufUnpackCpu,  // a GGUF tensor's blocks unpacked at load (gguf_blocks.cpp)
  kQuantizedPackCpu,  // a quantized weight packed at load (quantized_pack.cpp)
  kCount,
};

extern std::atomic<int64_t> g_cpu_path_counts[static_cast<int>(CpuPath::kCount)];

// One relaxed increment per op call (n per call for a count of rows): no ordering, no cost
// worth measuring.
inline void count_path(CpuPath path, int64_t n = 1) {
  g_cpu_path_counts[static_cast<int>(path)].fetch_add(n, std::memory_order_relaxed);
}

}  // namespace cbatch
