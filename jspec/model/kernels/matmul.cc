// out[R, N] = x[R, D] @ w[N, D]^T in float32, w float32, bfloat16 or int8, for the few rows of a
// decode step or a verification on a CPU (called through jax.ffi from jspec/model/kernels). A bfloat16
// weight is widened in registers (its 16 bits are a float32's top half), never copied; so is an
// int8 one, whose per-row scale (jspec/model/weights.py) multiplies each output once, after its sum.
//
// Why not XLA: its dot repacks the whole weight before multiplying a few rows, and the fused
// multiply-and-sum jspec used instead costs more per row than it must (docs/design.md, "Few
// rows"). Here w is read in place, row-major [N, D] as jspec stores it: each output is a dot
// product along D, so a tile of 4 rows x 3 weight rows keeps 12 accumulators in registers and
// loads every 8 weight floats once for all 4 rows (8 rows in AVX-512's registers). A chunk of up
// to 16 rows walks 3 weight rows at a time while they sit in L1. A thread takes 48 weight rows at a time (under 300 KB, which
// stays in L2 for the next chunk), so the weight comes from memory once per call.
//
// Every output is summed in the same order (8 lanes along D, then the same horizontal sum; 16
// lanes for int8 on AVX-512), whatever the number of rows, the tile it fell in or the thread that
// ran it: a row gets the same bits alone or in a batch.

#include <type_traits>
#include <utility>

#include "common.h"

namespace ffi = xla::ffi;
using Matrix = ffi::Buffer<ffi::F32, 2>;
using jspec::ParallelFor;
using jspec::Sum8;

namespace {

constexpr int64_t kTileCols = 3;      // weight rows per register tile
constexpr int64_t kChunkRows = 16;    // rows whose tiles share one pass over 3 weight rows in L1
constexpr int64_t kBlockCols = 48;    // weight rows a thread claims at a time

// The 8-lane tiles (matmul_tiles.inc), compiled twice: for AVX2, whose 16 ymm registers hold tiles
// of up to 4 rows, and for AVX-512VL, whose 32 hold tiles of up to 8 rows (24 accumulators, 3
// weights and a row of x), so each widened bfloat16 weight serves twice the rows. Both sum every
// output in the same order: a CPU with AVX-512 gives the same bits as one without.
namespace avx2 {
#define TILE_TARGET AVX2
constexpr int64_t kTileRows = 4;
#include "matmul_tiles.inc"
#undef TILE_TARGET
}  // namespace avx2

namespace avx512vl {
#define TILE_TARGET __attribute__((target("avx2,fma,avx512f,avx512vl")))
constexpr int64_t kTileRows = 8;
#include "matmul_tiles.inc"
#undef TILE_TARGET
}  // namespace avx512vl

// An int8 weight on a CPU with AVX-512 (BW for the byte loads): 16 weights a step, each widened in
// two instructions, where the 8 of an AVX2 step cost as many: with AVX2 alone the int8 product ran
// at half the memory's pace, bound by its widening (docs/journal/2026-12-04_int8-weights.md).
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

AVX512 inline __m512 Load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

AVX512 inline __m512 Tail16(const int8_t* p, __mmask16 tail) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, p)));
}

template <int RB, int NB>
AVX512 void Tile16(const float* x, const int8_t* w, const float* scale, int64_t d, __mmask16 tail, float* out,
                   int64_t n_total) {
  __m512 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_setzero_ps();
  // Four tiles ahead, not one: at a quarter of float32's bytes a tile, the next one was too near
  // to hide the memory's latency (5.2-6.0 ms for SmolLM2-135M's weights at one row, against 7.9).
  const char* next = reinterpret_cast<const char*>(w + 4 * NB * d);
  int64_t k = 0;
  for (; k + 16 <= d; k += 16) {
    _mm_prefetch(next + NB * k, _MM_HINT_T1);  // NB * 16 <= 64 bytes a step: one line
    __m512 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = Load16(w + n * d + k);
    for (int r = 0; r < RB; ++r) {
      __m512 xv = _mm512_loadu_ps(x + r * d + k);
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_fmadd_ps(xv, wv[n], acc[r][n]);
    }
  }
  if (k < d) {  // masked loads read zeros past the end of a row
    __m512 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = Tail16(w + n * d + k, tail);
    for (int r = 0; r < RB; ++r) {
      __m512 xv = _mm512_maskz_loadu_ps(tail, x + r * d + k);
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm512_fmadd_ps(xv, wv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) out[r * n_total + n] = _mm512_reduce_add_ps(acc[r][n]) * scale[n];
}

// 8 rows a tile, where AVX2's 16 registers hold 4: 24 accumulators, 3 weights and a row of x fill
// AVX-512's 32, and each widened weight serves twice the rows.
constexpr int64_t kTileRows16 = 8;
using Tile16Fn = void (*)(const float*, const int8_t*, const float*, int64_t, __mmask16, float*, int64_t);
constexpr Tile16Fn kTiles16[kTileRows16][kTileCols] = {
    {Tile16<1, 1>, Tile16<1, 2>, Tile16<1, 3>},
    {Tile16<2, 1>, Tile16<2, 2>, Tile16<2, 3>},
    {Tile16<3, 1>, Tile16<3, 2>, Tile16<3, 3>},
    {Tile16<4, 1>, Tile16<4, 2>, Tile16<4, 3>},
    {Tile16<5, 1>, Tile16<5, 2>, Tile16<5, 3>},
    {Tile16<6, 1>, Tile16<6, 2>, Tile16<6, 3>},
    {Tile16<7, 1>, Tile16<7, 2>, Tile16<7, 3>},
    {Tile16<8, 1>, Tile16<8, 2>, Tile16<8, 3>},
};

// Columns [n0, n1) of out for all rows, for an int8 weight on AVX-512: as Columns, each tile
// widening its weight rows itself. (Widening them once a chunk into a float buffer for its tiles
// ran slower, 8 to 512 rows: the buffer's stores and reloads cost more than the widening saved.)
AVX512 void Columns16(const float* x, const int8_t* w, const float* scale, float* out, int64_t rows,
                      int64_t n_total, int64_t d, int64_t n0, int64_t n1) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (d % 16)) - 1);
  for (int64_t c = 0; c < rows; c += kChunkRows) {
    const int64_t c_end = std::min(rows, c + kChunkRows);
    for (int64_t n = n0; n < n1; n += kTileCols) {
      const int64_t nb = std::min(kTileCols, n1 - n);
      for (int64_t r = c; r < c_end; r += kTileRows16) {
        const int64_t rb = std::min(kTileRows16, c_end - r);
        kTiles16[rb - 1][nb - 1](x + r * d, w + n * d, scale + n, d, tail, out + r * n_total + n, n_total);
      }
    }
  }
}

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

// Whether the products take their AVX-512 paths: the CPU's answer, unless a test turned them off
// (jspec_use_avx512) to run the AVX2 paths on a CPU that has both.
std::atomic<bool>& UseAvx512() {
  static std::atomic<bool> use{CpuHasAvx512()};
  return use;
}

bool HasAvx512() { return UseAvx512().load(std::memory_order_relaxed); }

// WT is the weight's dtype: F32, BF16 (whose native type is its 16 bits, uint16_t) or S8, with
// `scale` [N] for S8 and nullptr otherwise. A work item is a block of kBlockCols weight rows.
template <ffi::DataType WT>
ffi::Error Run(ffi::ThreadPool pool, Matrix x, ffi::Buffer<WT, 2> w, const float* scale, ffi::Result<Matrix> out) {
  using W = ffi::NativeType<WT>;
  const int64_t rows = x.dimensions()[0], d = x.dimensions()[1], n_total = w.dimensions()[0];
  if (w.dimensions()[1] != d) return ffi::Error::InvalidArgument("jspec_matmul: x and w differ in D");
  if (rows == 0 || n_total == 0) return ffi::Error::Success();
  const float* xs = x.typed_data();
  const W* ws = w.typed_data();
  float* os = out->typed_data();
  ParallelFor(pool, (n_total + kBlockCols - 1) / kBlockCols, [=](int64_t block) {
    const int64_t n0 = block * kBlockCols;
    const int64_t n1 = std::min(n_total, n0 + kBlockCols);
    if (!HasAvx512()) return avx2::Columns(xs, ws, scale, os, rows, n_total, d, n0, n1);
    if constexpr (std::is_same_v<W, int8_t>) {
      Columns16(xs, ws, scale, os, rows, n_total, d, n0, n1);
    } else {
      avx512vl::Columns(xs, ws, scale, os, rows, n_total, d, n0, n1);
    }
  });
  return ffi::Error::Success();
}

template <ffi::DataType WT>
ffi::Error Matmul(ffi::ThreadPool pool, Matrix x, ffi::Buffer<WT, 2> w, ffi::Result<Matrix> out) {
  return Run<WT>(pool, x, w, nullptr, out);
}

ffi::Error MatmulInt8(ffi::ThreadPool pool, Matrix x, ffi::Buffer<ffi::S8, 2> w, ffi::Buffer<ffi::F32, 1> scale,
                      ffi::Result<Matrix> out) {
  if (scale.dimensions()[0] != w.dimensions()[0])
    return ffi::Error::InvalidArgument("jspec_matmul_int8: w and scale differ in N");
  return Run<ffi::S8>(pool, x, w, scale.typed_data(), out);
}

}  // namespace

template <ffi::DataType WT>
auto Binding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<Matrix>().Arg<ffi::Buffer<WT, 2>>().template Ret<Matrix>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecMatmul, Matmul<ffi::F32>, Binding<ffi::F32>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecMatmulBf16, Matmul<ffi::BF16>, Binding<ffi::BF16>());
auto Int8Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<Matrix>()
      .Arg<ffi::Buffer<ffi::S8, 2>>()
      .Arg<ffi::Buffer<ffi::F32, 1>>()
      .Ret<Matrix>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecMatmulInt8, MatmulInt8, Int8Binding());

// How long the kernels' helpers spin for the next call before they sleep (common.h: Helpers),
// from now on; returns how long they spun until now.
extern "C" long jspec_set_spin_us(long us) { return jspec::Helpers::SpinMicros().exchange(us); }

// Lets the products use AVX-512 where the CPU has it (use != 0) or not; returns whether they did.
extern "C" int jspec_use_avx512(int use) { return UseAvx512().exchange(use != 0 && CpuHasAvx512()); }

extern "C" int jspec_cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
