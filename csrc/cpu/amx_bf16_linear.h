// The bf16 linear on AMX tiles (Intel Sapphire Rapids and later): for many rows a linear layer
// is compute-bound, and one tdpbf16ps multiplies 16 x 32 by 32 x 16 where vdpbf16ps does
// 16 pairs (benchmarks/NOTES.md, "AMX tiles").  It reads the weight in
// cbatch's packed bf16 layout as it is: a block of 16 columns, [K / 2][16][2], is a stack of
// AMX B tiles (16 rows of 16 column pairs, 64 bytes apart).  The sums run in another order than
// vdpbf16ps' (each pair's products added even first), so a row's result depends on whether
// this path ran: batch-invariant engines never take it (cbatch/ops/cpu.py).  The tile
// instructions come from amx_tile_ops.h, on the hardware or (for tests) on its model.
#pragma once

#include <ATen/Parallel.h>

#include <cstring>
#include <memory>

#include "gemm.h"

#ifdef CBATCH_X86
#include "amx_tile_ops.h"

#define CBATCH_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16," \
                         "avx512vnni")))

namespace cbatch::amx {
namespace {

// Rows of x, columns of W and pairs of k per tile (tiles of 16 rows of 64 bytes).
constexpr int64_t kTileRows = 16, kTileK = 32;

// Whether the bf16 linear may run on AMX tiles now: AVX512-BF16 below the ISA cap (the
// epilogue), and the CPU's AMX-BF16 with the tile state (amx_tile_ops.h) unless set_cpu_options
// turned AMX off, or the tiles' model.
inline bool available() { return tiles_allowed(22, cpu_has_avx512bf16()); }

// Rows [m, m + 32) of x (padded to whole tiles) times the NB column blocks from `block`, into
// sums [32][NB * 16] (fp32, 128 bytes a row).  Tiles 0-3: the sums of 2 x 2 tiles (32 rows x 32
// columns); 4-5: two row tiles of x; 6-7: two column blocks of W; every tile 16 rows of 64
// bytes.  On Tiles: the hardware's instructions, or amx_tile_ops.h's model of them.
template <class Tiles, int NB>
CBATCH_AMX void tile_sums(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w, int64_t m,
                          int64_t block, float* sums) {
  Tiles::template zero<0>();
  Tiles::template zero<1>();
  Tiles::template zero<2>();
  Tiles::template zero<3>();
  const c10::BFloat16* xa = x + m * K;
  const c10::BFloat16* xb = xa + kTileRows * K;
  const c10::BFloat16* w0 = w + block * K * kBlock;
  const c10::BFloat16* w1 = w0 + K * kBlock;
  // Each tile is loaded just before its first product and its last reader comes early, so
  // the next step's load into it (tiles are not renamed) waits as little as possible.
  for (int64_t k = 0; k < K; k += kTileK) {
    Tiles::template load<4>(xa + k, K * 2);
    Tiles::template load<6>(w0 + k * kBlock, 64);  // 16 pairs of k, 16 columns each
    Tiles::template dot_bf16<0, 4, 6>();
    if constexpr (NB == 2) {
      Tiles::template load<7>(w1 + k * kBlock, 64);
      Tiles::template dot_bf16<1, 4, 7>();
    }
    Tiles::template load<5>(xb + k, K * 2);
    Tiles::template dot_bf16<2, 5, 6>();
    if constexpr (NB == 2) Tiles::template dot_bf16<3, 5, 7>();
  }
  Tiles::template store<0>(sums, 128);
  Tiles::template store<2>(sums + kTileRows * 32, 128);
  if constexpr (NB == 2) {
    Tiles::template store<1>(sums + kBlock, 128);
    Tiles::template store<3>(sums + kTileRows * 32 + kBlock, 128);
  }
}

// The epilogue of gemm.h's tiles on the sums of rows [m, min(m + 32, M)) and the NB blocks
// from `block`: bias, GELU, residual, bf16 out.
CBATCH_AMX void epilogue(const Args<c10::BFloat16>& a, const float* sums, int64_t m,
                         int64_t block, int nb) {
  using avx512::first_lanes, avx512::load, avx512::store;
  const int64_t rows = std::min<int64_t>(2 * kTileRows, a.M - m);
  for (int b = 0; b < nb; ++b) {
    const int64_t col = (block + b) * kBlock;
    const __mmask16 mask = first_lanes(a.N - col);
    const __m512 bias = a.bias ? load(a.bias + col, mask) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + r * 32 + b * kBlock), bias);
      if (a.gelu) v = avx512::gelu_tanh(v);
      if (a.residual) v = _mm512_add_ps(load(a.residual + (m + r) * a.ldr + col, mask), v);
      store(a.out + (m + r) * a.N + col, v, mask);
    }
  }
}

// How many rows of x a thread runs against its column blocks before moving on: as many whole
// tiles as fit in about 1 MB (half of an L2), so that for a long prefill chunk x comes from L2
// once per column pair rather than from memory (2048 x 768 bf16 is 3 MB, read 36 times a
// layer before; NOTES, "AMX tiles").
inline int64_t chunk_rows(int64_t K) {
  constexpr int64_t kBytes = 1 << 20;
  return std::max<int64_t>(1, kBytes / (K * 2) / (2 * kTileRows)) * (2 * kTileRows);
}

// Column-block pairs [begin, end) against every 32 rows of x (whole tiles), on this thread,
// chunk_rows(K) rows at a time.
template <class Tiles>
CBATCH_AMX void run_pairs(const Args<c10::BFloat16>& a, const c10::BFloat16* x, int64_t begin,
                          int64_t end) {
  const int64_t blocks = (a.N + kBlock - 1) / kBlock;
  const int64_t chunk = chunk_rows(a.K);
  Tiles::configure(full_tiles());
  alignas(64) float sums[2 * kTileRows * 32];
  for (int64_t m0 = 0; m0 < a.M; m0 += chunk) {
    const int64_t m1 = std::min(a.M, m0 + chunk);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t block = 2 * pair;
      const int nb = block + 1 < blocks ? 2 : 1;
      for (int64_t m = m0; m < m1; m += 2 * kTileRows) {
        if (nb == 2) {
          tile_sums<Tiles, 2>(x, a.K, a.w, m, block, sums);
        } else {
          tile_sums<Tiles, 1>(x, a.K, a.w, m, block, sums);
        }
        epilogue(a, sums, m, block, nb);
      }
    }
  }
  Tiles::release();
}

// The whole product: x's rows copied into whole tiles (zero rows past M), then pairs of
// column blocks shared out among threads, each running every 32 rows against its blocks
// (their weights stay in L2 meanwhile).  K must be a multiple of kTileK.
inline void run(const Args<c10::BFloat16>& a) {
  const int64_t rows = (a.M + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
  std::unique_ptr<c10::BFloat16[]> x(new c10::BFloat16[rows * a.K]);
  for (int64_t m = 0; m < a.M; ++m) std::memcpy(&x[m * a.K], a.x + m * a.ldx, a.K * 2);
  std::memset(static_cast<void*>(&x[a.M * a.K]), 0, (rows - a.M) * a.K * 2);
  const int64_t blocks = (a.N + kBlock - 1) / kBlock;
  on_tiles([&](auto tiles) {
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      run_pairs<decltype(tiles)>(a, x.get(), begin, end);
    });
  });
}

}  // namespace
}  // namespace cbatch::amx
#endif  // CBATCH_X86
