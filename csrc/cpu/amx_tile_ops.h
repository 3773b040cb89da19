// The AMX tile operations every AMX path runs on (amx_bf16_linear.h's bf16 linear; the int8
// ones of quantized_linear_w8a8.cpp and quantized_linear_w4a8.cpp): whether a path may take
// the tiles (the CPU's AMX features, whether Linux gave this process the tile state, the
// options), the tile configuration, and the tile instructions the kernels use, twice: on the
// hardware (HardwareTiles), and as a software model of them (ModelTiles), instruction by
// instruction as Intel's SDM defines them, so that the kernels' addressing, their tiles'
// shapes and their epilogues are tested on a CPU without AMX (set_cpu_options(...,
// amx="model")); then the int8 kernels' step and walk on either.  The model checks the kernels
// against the manual's semantics, not the silicon: benchmarks/NOTES.md says where the AMX
// paths have run on hardware.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "x86.h"

#ifdef CBATCH_X86
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CBATCH_AMX_INT8                                                                  \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni," \
                        "avx2,fma,f16c")))

namespace cbatch::amx {

// Whether the CPU has AMX-TILE and the AMX feature `bit` of CPUID leaf 7's EDX (22: BF16,
// 25: INT8), and Linux gave this process the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA), asked once).
inline bool tiles_granted(int bit) {
  static const unsigned edx = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1)) return 0u;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0 ? d : 0u;
  }();
  return (edx >> bit) & 1;
}

// Whether a path may run on tiles of AMX feature `bit` now, its epilogue's ISA present
// (`epilogue`, below the ISA cap): the CPU's tiles unless set_cpu_options turned AMX off, or the
// model's.  The one rule for every AMX path.
inline bool tiles_allowed(int bit, bool epilogue) {
  const AmxOption option = cpu_amx_option();
  if (option == AmxOption::kOff || !epilogue) return false;
  return option == AmxOption::kModel || tiles_granted(bit);
}

// Whether W8A8 and W4A8 may run on AMX-INT8 tiles now (AVX512-VNNI for their epilogues).
inline bool int8_tiles() { return tiles_allowed(25, cpu_has_avx512vnni()); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 each 16 rows of 64 bytes (the kernels' one shape).
inline TileConfig full_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  return config;
}

// The tile instructions, by tile number (a template argument: the intrinsics take literals).
#define CBATCH_TILE_CASE(T, op, ...)          \
  if constexpr (T == 0) op(0, __VA_ARGS__);   \
  else if constexpr (T == 1) op(1, __VA_ARGS__); \
  else if constexpr (T == 2) op(2, __VA_ARGS__); \
  else if constexpr (T == 3) op(3, __VA_ARGS__); \
  else if constexpr (T == 4) op(4, __VA_ARGS__); \
  else if constexpr (T == 5) op(5, __VA_ARGS__); \
  else if constexpr (T == 6) op(6, __VA_ARGS__); \
  else op(7, __VA_ARGS__)
// C += A B by `op` on the kernels' four (C, A, B): sums 0-3, A tiles 4-5, B tiles 6-7.
#define CBATCH_TILE_DOT(op)                                                    \
  static_assert(C < 4 && A >= 4 && A < 6 && B >= 6, "the kernels' tiles");     \
  if constexpr (C == 0 && A == 4 && B == 6) op(0, 4, 6);                       \
  else if constexpr (C == 1 && A == 4 && B == 7) op(1, 4, 7);                  \
  else if constexpr (C == 2 && A == 5 && B == 6) op(2, 5, 6);                  \
  else op(3, 5, 7)
#define CBATCH_TILE_ZERO(t, unused) _tile_zero(t)
#define CBATCH_TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define CBATCH_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)

// Each instruction with the one extension it needs, so that it inlines into the int8 kernels
// (CBATCH_AMX_INT8) and amx_bf16_linear.h's bf16 one (CBATCH_AMX) alike.
#define CBATCH_AMX_TILE __attribute__((target("amx-tile")))
struct HardwareTiles {
  CBATCH_AMX_TILE static void configure(const TileConfig& config) { _tile_loadconfig(&config); }
  CBATCH_AMX_TILE static void release() { _tile_release(); }
  template <int T>
  CBATCH_AMX_TILE static void zero() {
    CBATCH_TILE_CASE(T, CBATCH_TILE_ZERO, 0);
  }
  template <int T>
  CBATCH_AMX_TILE static void load(const void* base, int64_t stride) {
    CBATCH_TILE_CASE(T, CBATCH_TILE_LOAD, base, stride);
  }
  template <int T>
  CBATCH_AMX_TILE static void store(void* base, int64_t stride) {
    CBATCH_TILE_CASE(T, CBATCH_TILE_STORE, base, stride);
  }
  // C += A B: A's rows of signed bytes, B's rows of 16 columns x 4 unsigned bytes (tdpbsud).
  template <int C, int A, int B>
  __attribute__((target("amx-tile,amx-int8"))) static void dot_su() {
    CBATCH_TILE_DOT(_tile_dpbsud);
  }
  // C += A B in fp32: A's rows of bf16 pairs of k, B's rows of 16 columns x a pair (tdpbf16ps).
  template <int C, int A, int B>
  __attribute__((target("amx-tile,amx-bf16"))) static void dot_bf16() {
    CBATCH_TILE_DOT(_tile_dpbf16ps);
  }
};
#undef CBATCH_AMX_TILE
#undef CBATCH_TILE_DOT
#undef CBATCH_TILE_ZERO
#undef CBATCH_TILE_LOAD
#undef CBATCH_TILE_STORE
#undef CBATCH_TILE_CASE

// The same instructions on a thread's own 8 tiles of 1 KiB, as the SDM's pseudocode has them:
// a load or store moves rows[t] rows of colsb[t] bytes, `stride` bytes apart in memory; a zero
// clears the whole tile; tdpbsud adds, for every row m of C and column n (colsb[C] / 4 of
// them), the products of A's signed bytes 4 k .. 4 k + 3 of row m with B's unsigned bytes
// 4 n .. 4 n + 3 of row k, for k < colsb[A] / 4, into C's int32 (wrapping, as the hardware
// does not saturate); tdpbf16ps adds to C's fp32 the products of A's bf16 pair k of row m with
// B's pair n of row k, the even one first, each add rounded to nearest even (a product of two
// bf16 is exact in fp32; the hardware's flushing of denormals is not modelled).
struct ModelTiles {
  struct State {
    TileConfig config;
    alignas(64) uint8_t tile[8][16][64];
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static void configure(const TileConfig& config) { state().config = config; }
  static void release() { state().config = TileConfig{}; }
  template <int T>
  static void zero() {
    std::memset(state().tile[T], 0, sizeof state().tile[T]);
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.config.rows[T]; ++r) {
      std::memcpy(s.tile[T][r], static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[T]);
    }
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    State& s = state();
    for (int r = 0; r < s.config.rows[T]; ++r) {
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.tile[T][r], s.config.colsb[T]);
    }
  }
  // f(m, n, acc) for each sum of C: row m, column n (4 bytes), acc an Acc read and written back.
  template <int C, class Acc, class F>
  static void each_sum(State& s, F f) {
    for (int m = 0; m < s.config.rows[C]; ++m) {
      for (int n = 0; n < s.config.colsb[C] / 4; ++n) {
        Acc acc;
        std::memcpy(&acc, &s.tile[C][m][4 * n], sizeof acc);
        f(m, n, acc);
        std::memcpy(&s.tile[C][m][4 * n], &acc, sizeof acc);
      }
    }
  }
  template <int C, int A, int B>
  static void dot_su() {
    State& s = state();
    each_sum<C, uint32_t>(s, [&](int m, int n, uint32_t& acc) {
      for (int k = 0; k < s.config.colsb[A] / 4; ++k) {
        for (int t = 0; t < 4; ++t) {
          acc += static_cast<uint32_t>(static_cast<int8_t>(s.tile[A][m][4 * k + t]) *
                                       static_cast<int32_t>(s.tile[B][k][4 * n + t]));
        }
      }
    });
  }
  template <int C, int A, int B>
  static void dot_bf16() {
    State& s = state();
    const auto bf16 = [](const uint8_t* p) {  // a bf16 as the fp32 with its 16 bits on top
      uint32_t bits = uint32_t(p[0] | p[1] << 8) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    };
    each_sum<C, float>(s, [&](int m, int n, float& acc) {
      for (int k = 0; k < s.config.colsb[A] / 4; ++k) {
        for (int t = 0; t < 2; ++t) {
          const float product = bf16(&s.tile[A][m][4 * k + 2 * t]) *
                                bf16(&s.tile[B][k][4 * n + 2 * t]);
          acc = acc + product;
        }
      }
    });
  }
};

// The int8 kernels' shape: from kInt8FromRows rows (below, the weights' bytes bound the
// time), steps of kInt8StepRows rows of x (two A tiles) and kInt8StepQuads quads of k (a tile
// row of 64 bytes), rows in chunks of about 512 KiB of x (ldx bytes a row), so that x comes
// from L2 once per pair of blocks.
constexpr int64_t kInt8FromRows = 8, kInt8StepRows = 32, kInt8StepQuads = 16;
inline int64_t int8_chunk_rows(int64_t ldx) {
  return std::max<int64_t>(1, (512 << 10) / (ldx * kInt8StepRows)) * kInt8StepRows;
}

// The int8 kernels' step (W8A8's, W4A8's), on Tiles: 32 rows of x against NB blocks of 16
// columns, tiles 0-3 the 2 x NB sums (int32), 4-5 the A tiles (x's rows, ldx bytes apart: rows
// 0-15 and 16-31), 6-7 the B tiles (a block's quads of k, 64 bytes each), as
// amx_bf16_linear.h's bf16 kernel has them.  Each tile is loaded just before its first product.
template <class Tiles>
CBATCH_AMX_INT8 void zero_sums() {
  Tiles::template zero<0>();
  Tiles::template zero<1>();
  Tiles::template zero<2>();
  Tiles::template zero<3>();
}

// Sums += x's k of quads [i0, i1) (a multiple of 16 of them) times the blocks' (w0, w1).
template <class Tiles, int NB>
CBATCH_AMX_INT8 void add_products(const int8_t* x, int64_t ldx, const uint8_t* w0,
                                  const uint8_t* w1, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; i += kInt8StepQuads) {
    Tiles::template load<4>(x + 4 * i, ldx);
    Tiles::template load<6>(w0 + 64 * i, 64);
    Tiles::template dot_su<0, 4, 6>();
    if constexpr (NB == 2) {
      Tiles::template load<7>(w1 + 64 * i, 64);
      Tiles::template dot_su<1, 4, 7>();
    }
    Tiles::template load<5>(x + 16 * ldx + 4 * i, ldx);
    Tiles::template dot_su<2, 5, 6>();
    if constexpr (NB == 2) Tiles::template dot_su<3, 5, 7>();
  }
}

// The sums into sums [32][32] int32 (block b's columns at 16 b).
template <class Tiles, int NB>
CBATCH_AMX_INT8 void store_sums(int32_t* sums) {
  Tiles::template store<0>(sums, 128);
  Tiles::template store<2>(sums + 16 * 32, 128);
  if constexpr (NB == 2) {
    Tiles::template store<1>(sums + 16, 128);
    Tiles::template store<3>(sums + 16 * 32 + 16, 128);
  }
}

// The int8 kernels' walk (W8A8's, W4A8's): their `blocks` blocks of 16 columns in pairs (the
// last alone where blocks is odd), shared out among threads, each thread over x's M rows a
// chunk at a time (int8_chunk_rows: a chunk of x comes from L2 once per pair) on its own tiles,
// configured before and released after: pair(block, nb, m0, m1) for each chunk and pair, nb its
// blocks.  pair is the kernel's CBATCH_AMX_INT8 function (a lambda here would not inherit the
// target that its steps inline under).
template <class Tiles, class Pair>
void for_pairs(int64_t M, int64_t blocks, int64_t ldx, Pair&& pair) {
  const int64_t chunk = int8_chunk_rows(ldx);
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    Tiles::configure(full_tiles());
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      for (int64_t p = begin; p < end; ++p) {
        pair(2 * p, 2 * p + 1 < blocks ? 2 : 1, m0, std::min(M, m0 + chunk));
      }
    }
    Tiles::release();
  });
}

// f(HardwareTiles{}) or, where set_cpu_options chose the model, f(ModelTiles{}): which tile
// instructions a kernel's instantiation runs.
template <class F>
void on_tiles(F&& f) {
  if (cpu_amx_option() == AmxOption::kModel) {
    f(ModelTiles{});
  } else {
    f(HardwareTiles{});
  }
}

}  // namespace cbatch::amx
#endif  // CBATCH_X86
