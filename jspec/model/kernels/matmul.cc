// out[R, N] = x[R, D] @ w[N, D]^T in float32, w float32, bfloat16 or int8, for the few rows of a
// decode step or a verification on a CPU (called through jax.ffi from jspec/model/kernels). A bfloat16
// weight is widened in registers (its 16 bits are a float32's top half), never copied; so is an
// int8 one, whose per-row scale (jspec/model/weights.py) multiplies each output once, after its sum.
//
// Why not XLA: its dot repacks the whole weight before multiplying a few rows, and the fused
// multiply-and-sum jspec used instead costs more per row than it must (docs/design.md, "Few
// rows"). Here w is read in place, row-major [N, D] as jspec stores it: each output is a dot
// product along D, so a register tile of rows x weight rows keeps its accumulators in registers
// and loads every 8 weights once for all its rows (4 x 3 with AVX2; 8 x 6 with AVX-512). A chunk
// of up to 16 rows walks a tile's weight rows while they sit in L1. A thread takes 48 weight rows
// at a time (under 300 KB, which stays in L2 for the next chunk), so the weight comes from memory
// once per call.
//
// Every output is summed in the same order (8 lanes along D, then the same horizontal sum; 16
// lanes for int8 on AVX-512), whatever the number of rows, the tile it fell in, the thread that
// ran it or whether the CPU has AVX-512: a row gets the same bits alone or in a batch. A bfloat16
// weight whose D is a multiple of 32, and an int8 one whose D is a multiple of 64, go through AMX's
// tiles where the CPU has them (namespace amx), at every row count: a row's bits are then the
// same in any batch too, but not AVX2's.

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;
using Matrix = ffi::Buffer<ffi::F32, 2>;
using jspec::CpuHasAvx512;
using jspec::HasAvx512;
using jspec::ParallelFor;
using jspec::Sum8;
using jspec::UseAvx512;

namespace {

constexpr int64_t kChunkRows = 16;  // rows whose tiles share one pass over a tile's weight rows in L1
constexpr int64_t kBlockCols = 48;  // weight rows a thread claims at a time

// Calls tile(r, rb, n, nb) for the register tiles covering rows [0, rows) x weight rows [n0, n1):
// chunk by chunk of rows, the weight rows of a tile visited once a chunk.
template <int64_t kTileRows, int64_t kTileCols, typename TileAt>
inline void ForTiles(int64_t rows, int64_t n0, int64_t n1, TileAt tile) {
  for (int64_t c = 0; c < rows; c += kChunkRows) {
    const int64_t c_end = std::min(rows, c + kChunkRows);
    for (int64_t n = n0; n < n1; n += kTileCols) {
      const int64_t nb = std::min(kTileCols, n1 - n);
      for (int64_t r = c; r < c_end; r += kTileRows) tile(r, std::min(kTileRows, c_end - r), n, nb);
    }
  }
}

// The 8-lane tiles of AVX2 + FMA, whose 16 ymm registers hold tiles of up to 4 rows x 3 weight rows.
namespace avx2 {
constexpr int64_t kTileRows = 4;
constexpr int64_t kTileCols = 3;

// 8 weights from p as float32; Tail reads the last d % 8 of a row, zeros past its end.
AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
AVX2 inline __m256 Load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
AVX2 inline __m256 Load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
AVX2 inline __m256 Tail(const float* p, int64_t, __m256i mask) { return _mm256_maskload_ps(p, mask); }
template <typename W>
AVX2 inline __m256 Tail(const W* p, int64_t count, __m256i) {
  W part[8] = {0};
  std::copy(p, p + count, part);
  return Load8(part);
}

// out[r, n] for RB rows of x (stride d) and NB rows of w (stride d), times scale[n] where scale
// is given (an int8 weight's); out has stride n_total.
template <int RB, int NB, typename W>
AVX2 void Tile(const float* x, const W* w, const float* scale, int64_t d, __m256i tail, float* out,
               int64_t n_total) {
  __m256 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm256_setzero_ps();
  // The weight rows of the tiles ahead follow these in memory: fetch them while this tile
  // computes (two lines per step cover NB <= 4 rows; past the end of w a prefetch is a harmless
  // hint). Into L2, not L1: fetched into L1 they made a forward over 3 to 13 rows 22-28% slower on
  // an AVX-512 AMD EPYC host, where into L2 the weight streams at about the memory's pace up to 5
  // rows (docs/design.md, "Prefetching into L2"). As many bytes ahead whatever the weight's
  // dtype: one tile of float32, two of bfloat16 (a forward over 1 to 13 rows 10-14% faster than
  // one tile ahead: docs/design.md, "Eight-row tiles"), four of int8.
  constexpr int64_t kAhead = 4 / sizeof(W);
  const char* next = reinterpret_cast<const char*>(w + kAhead * NB * d);
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    _mm_prefetch(next + sizeof(W) * NB * k, _MM_HINT_T1);
    _mm_prefetch(next + sizeof(W) * NB * k + 64, _MM_HINT_T1);
    __m256 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = Load8(w + n * d + k);
    for (int r = 0; r < RB; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * d + k);
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm256_fmadd_ps(xv, wv[n], acc[r][n]);
    }
  }
  if (k < d) {  // masked loads read zeros past the end of a row
    __m256 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = Tail(w + n * d + k, d - k, tail);
    for (int r = 0; r < RB; ++r) {
      __m256 xv = _mm256_maskload_ps(x + r * d + k, tail);
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm256_fmadd_ps(xv, wv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) out[r * n_total + n] = scale ? Sum8(acc[r][n]) * scale[n] : Sum8(acc[r][n]);
}

template <typename W>
using TileFn = void (*)(const float*, const W*, const float*, int64_t, __m256i, float*, int64_t);
// Tiles<W>::at[rb - 1][nb - 1]: the tile of rb rows (up to kTileRows) and nb weight rows.
template <typename W, typename Rows = std::make_index_sequence<kTileRows>>
struct Tiles;
template <typename W, size_t... R>
struct Tiles<W, std::index_sequence<R...>> {
  static constexpr TileFn<W> at[][kTileCols] = {{Tile<R + 1, 1, W>, Tile<R + 1, 2, W>, Tile<R + 1, 3, W>}...};
};

// Columns [n0, n1) of out for all rows.
template <typename W>
AVX2 void Columns(const float* x, const W* w, const float* scale, float* out, int64_t rows, int64_t n_total,
                  int64_t d, int64_t n0, int64_t n1) {
  alignas(32) int32_t lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = i < d % 8 ? -1 : 0;
  const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  ForTiles<kTileRows, kTileCols>(rows, n0, n1, [&](int64_t r, int64_t rb, int64_t n, int64_t nb) {
    Tiles<W>::at[rb - 1][nb - 1](x + r * d, w + n * d, scale ? scale + n : nullptr, d, tail, out + r * n_total + n,
                                 n_total);
  });
}
}  // namespace avx2

// The tiles of a CPU with AVX-512 (32 registers of 16 lanes): up to 8 rows a tile.
namespace avx512 {
constexpr int64_t kTileRows = 8;
constexpr int64_t kTilePairs = 3;

// A float32 or bfloat16 weight: AVX2's 8-lane sums, two weight rows at a time. A 16-lane register
// holds 8 weights of weight row n in its low half and the same 8 of row n + 1 in its high half,
// and a row of x broadcast to both halves, so each half runs exactly the FMAs of one 8-lane
// accumulator (the bits of AVX2's tiles) while one instruction does the work of two where the CPU
// runs 16-lane FMAs as fast as 8-lane ones (an Intel Xeon: 5 a ns of either a core; AMD's Zen 4
// splits a 16-lane one in two). Tiles of up to 8 rows x 3 pairs: 24 accumulators, 3 weights, a
// row of x.
// LoadPair: 8 weights of row a and the same 8 of row b as float32; TailPair the last d % 8 of each,
// zeros past their end.
AVX512 inline __m512 LoadPair(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
AVX512 inline __m512 LoadPair(const uint16_t* a, const uint16_t* b) {
  const __m256i two = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(two), 16));
}
template <typename W>
AVX512 inline __m512 TailPair(const W* a, const W* b, int64_t count) {
  W part[16] = {0};
  std::copy(a, a + count, part);
  std::copy(b, b + count, part + 8);
  return LoadPair(part, part + 8);
}

// out[r, n] for RB rows of x and NB (1 to 2 * kTilePairs) weight rows; an odd last weight row is
// paired with itself and its high half dropped.
template <int RB, int NB, typename W>
AVX512 void Tile(const float* x, const W* w, int64_t d, __mmask8 tail, float* out, int64_t n_total) {
  constexpr int NP = (NB + 1) / 2;
  const W* lo[NP];
  const W* hi[NP];
  for (int p = 0; p < NP; ++p) {
    lo[p] = w + 2 * p * d;
    hi[p] = w + std::min(2 * p + 1, NB - 1) * d;
  }
  __m512 acc[RB][NP];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  // As many bytes ahead as AVX2's tiles: 3 weight rows of float32, 6 of bfloat16.
  constexpr int64_t kAheadRows = 12 / sizeof(W);
  constexpr int64_t kLines = (NB * 8 * sizeof(W) + 63) / 64;
  const char* next = reinterpret_cast<const char*>(w + (NB + kAheadRows) * d);
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    for (int64_t line = 0; line < kLines; ++line) _mm_prefetch(next + sizeof(W) * NB * k + 64 * line, _MM_HINT_T1);
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) wv[p] = LoadPair(lo[p] + k, hi[p] + k);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * d + k));
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
    }
  }
  if (k < d) {  // zeros past the end of a row
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) wv[p] = TailPair(lo[p] + k, hi[p] + k, d - k);
    for (int r = 0; r < RB; ++r) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_maskz_loadu_ps(tail, x + r * d + k));
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < NP; ++p) {
      out[r * n_total + 2 * p] = Sum8(_mm512_castps512_ps256(acc[r][p]));
      if (2 * p + 1 < NB) out[r * n_total + 2 * p + 1] = Sum8(_mm512_extractf32x8_ps(acc[r][p], 1));
    }
}

template <typename W>
using TileFn = void (*)(const float*, const W*, int64_t, __mmask8, float*, int64_t);
template <typename W, typename Rows = std::make_index_sequence<kTileRows>>
struct Tiles;
template <typename W, size_t... R>
struct Tiles<W, std::index_sequence<R...>> {
  static constexpr TileFn<W> at[][2 * kTilePairs] = {
      {Tile<R + 1, 1, W>, Tile<R + 1, 2, W>, Tile<R + 1, 3, W>, Tile<R + 1, 4, W>, Tile<R + 1, 5, W>, Tile<R + 1, 6, W>}...};
};

template <typename W>
AVX512 void Columns(const float* x, const W* w, float* out, int64_t rows, int64_t n_total, int64_t d,
                    int64_t n0, int64_t n1) {
  const __mmask8 tail = static_cast<__mmask8>((1u << (d % 8)) - 1);
  ForTiles<kTileRows, 2 * kTilePairs>(rows, n0, n1, [&](int64_t r, int64_t rb, int64_t n, int64_t nb) {
    Tiles<W>::at[rb - 1][nb - 1](x + r * d, w + n * d, d, tail, out + r * n_total + n, n_total);
  });
}

// An int8 weight on a CPU with AVX-512 (BW for the byte loads): 16 weights a step, each widened in
// two instructions, where the 8 of an AVX2 step cost as many: with AVX2 alone the int8 product ran
// at half the memory's pace, bound by its widening (docs/journal/2026-12-04_int8-weights.md). Its
// sums are 16 lanes wide, so its bits differ from the AVX2 path's (both are tested against JAX's).
AVX512 inline __m512 Load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

AVX512 inline __m512 Tail16(const int8_t* p, __mmask16 tail) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail, p)));
}

template <int RB, int NB>
AVX512 void Int8Tile(const float* x, const int8_t* w, const float* scale, int64_t d, __mmask16 tail, float* out,
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

// Tiles of up to 8 rows x 3 weight rows (24 accumulators, 3 weights, a row of x).
constexpr int64_t kInt8TileCols = 3;
using Int8TileFn = void (*)(const float*, const int8_t*, const float*, int64_t, __mmask16, float*, int64_t);
template <typename Rows = std::make_index_sequence<kTileRows>>
struct Int8Tiles;
template <size_t... R>
struct Int8Tiles<std::index_sequence<R...>> {
  static constexpr Int8TileFn at[][kInt8TileCols] = {{Int8Tile<R + 1, 1>, Int8Tile<R + 1, 2>, Int8Tile<R + 1, 3>}...};
};

// Each tile widens its weight rows itself. (Widening them once a chunk into a float buffer for its
// tiles ran slower, 8 to 512 rows: the buffer's stores and reloads cost more than the widening saved.)
AVX512 void Columns(const float* x, const int8_t* w, const float* scale, float* out, int64_t rows,
                    int64_t n_total, int64_t d, int64_t n0, int64_t n1) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (d % 16)) - 1);
  ForTiles<kTileRows, kInt8TileCols>(rows, n0, n1, [&](int64_t r, int64_t rb, int64_t n, int64_t nb) {
    Int8Tiles<>::at[rb - 1][nb - 1](x + r * d, w + n * d, scale + n, d, tail, out + r * n_total + n, n_total);
  });
}
}  // namespace avx512

// A bfloat16 or int8 weight on a CPU with AMX (Intel since Sapphire Rapids): its tile unit
// multiplies a tile of 16 weight rows x 64 bytes of weights (32 bfloat16, 64 int8) by as many
// values of 16 columns in one instruction, whatever the number of columns used, where an FMA does
// 16 weights of one row. Its operands are bfloat16 or int8, so a float32 row of x goes in as three
// parts, three columns:
// - for bfloat16, its top 8 bits of significand, the next 8 and the last 8, which sum to it
//   exactly; their products are exact in float32, summed in float32, and the three sums added;
// - for int8, three digits of x / s, s the row's power of two with |x / s| <= 127: x = s (q0 + q1 /
//   128 + q2 / 128^2) to within s / 2^15 (2^-21 of the row's largest value), q0 in [-127, 127] and
//   q1, q2 in [-64, 64]; their products are summed exactly in 32-bit integers, then scaled back
//   (x's error is 13 bits below the weights' own; docs/design.md, "Tiles of AMX").
// The weight tile is read in place (16 rows of 64 bytes, a row apart); x is packed once a call
// into tiles of 5 rows' 15 columns (and one of zeros) by 64 bytes of weights, in pairs of
// bfloat16 or fours of int8 as the instructions want them. Every output is summed alike whatever
// the number of rows, so a row gets the same bits alone or in a batch; they are not the AVX
// paths' bits.
namespace amx {
#define AMX \
  __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16,amx-int8")))
template <typename W>
constexpr int64_t kDepth = 64 / sizeof(W);  // weights of a row in one tile
constexpr int64_t kTileN = 16;              // weight rows in one tile
constexpr int64_t kGroupRows = 5;           // rows of x in one tile of x: 3 columns each
constexpr int64_t kColumns = 16;            // columns of a tile of x or of sums
constexpr int64_t kPacked = 16 * kColumns;  // 32-bit words of a packed tile of x: 16 rows x 16 columns
constexpr int64_t kBlockCols = 64;          // weight rows a thread claims at a time

// The first words of a tile's 16 rows of 16 columns, as gather and scatter offsets.
AMX inline __m512i RowStarts() {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(kColumns));
}

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: 0 and 1 weights, 2 and 3 x, 4 to 7 sums (Columns).
AMX inline void Configure() {
  Config config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
}

// Where part p of row r's words of depth k go: column 3 (r % 5) + p of its group's tile k.
inline uint32_t* Column(uint32_t* packed, int64_t depths, int64_t r, int64_t k) {
  return packed + (r / kGroupRows * depths + k) * kPacked + 3 * (r % kGroupRows);
}

// x [rows, d] -> packed[group][d / 32][16 rows][16 columns]: a 32-bit word holds bfloat16 parts
// of x's values 2i (low half) and 2i + 1 of the tile's 32, row i.
AMX void Pack(const float* x, int64_t rows, int64_t d, uint32_t* packed) {
  const int64_t depths = d / kDepth<uint16_t>;
  const __m512i pair_rows = RowStarts();  // word i of 16 goes to row i
  const __m512 top = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < depths; ++k) {
      const float* v = x + r * d + k * kDepth<uint16_t>;
      __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
      for (int p = 0; p < 3; ++p) {  // truncated to bfloat16, the rest carried to the next part
        const __m512 a_part = _mm512_and_ps(a, top), b_part = _mm512_and_ps(b, top);
        const __m512i words = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b_part, a_part));
        _mm512_i32scatter_epi32(Column(packed, depths, r, k) + p, pair_rows, words, 4);
        a = _mm512_sub_ps(a, a_part), b = _mm512_sub_ps(b, b_part);
      }
    }
  }
}

// The power of two s with max |v| <= 127 s over a row of d values (1 for a row of zeros; at least
// 2^-100, whose inverse is a float), or NaN where the row holds an infinity or a NaN: its outputs
// are then NaN, as the AVX paths' would be non-finite (the digits cannot carry them).
AMX float RowScale(const float* v, int64_t d) {
  __m512 big = _mm512_setzero_ps();
  __mmask16 wild = 0;
  for (int64_t k = 0; k < d; k += 16) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(v + k));
    wild |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(std::numeric_limits<float>::max()), _CMP_NLE_UQ);
    big = _mm512_max_ps(big, a);
  }
  if (wild) return std::numeric_limits<float>::quiet_NaN();
  const float m = _mm512_reduce_max_ps(big);
  if (m == 0.0f) return 1.0f;
  int e;
  std::frexp(m / 127.0f, &e);  // m / 127 < 2^e
  e = std::max(e, -100);
  while (e > -100 && m <= 127.0f * std::ldexp(1.0f, e - 1)) --e;
  while (m > 127.0f * std::ldexp(1.0f, e)) ++e;
  return std::ldexp(1.0f, e);
}

// x [rows, d] -> packed[group][d / 64][16 rows][16 columns] and row_scale [rows]: a 32-bit word
// holds a digit of x's values 4i .. 4i + 3 of the tile's 64 (lowest byte first), row i.
AMX void PackInt8(const float* x, int64_t rows, int64_t d, uint32_t* packed, float* row_scale) {
  const int64_t depths = d / kDepth<int8_t>;
  const __m512i quad_rows = RowStarts();
  for (int64_t r = 0; r < rows; ++r) {
    row_scale[r] = RowScale(x + r * d, d);
    const __m512 inverse = _mm512_set1_ps(1.0f / row_scale[r]);  // a power of two: exact
    for (int64_t k = 0; k < depths; ++k) {
      __m512 t[4];
      for (int j = 0; j < 4; ++j) t[j] = _mm512_mul_ps(_mm512_loadu_ps(x + r * d + k * 64 + 16 * j), inverse);
      for (int p = 0; p < 3; ++p) {  // rounded to the nearest digit, the rest carried, times 128
        __m512i words = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          const __m512 q = _mm512_roundscale_ps(t[j], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          words = _mm512_inserti32x4(words, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)), j);
          t[j] = _mm512_mul_ps(_mm512_sub_ps(t[j], q), _mm512_set1_ps(128.0f));
        }
        _mm512_i32scatter_epi32(Column(packed, depths, r, k) + p, quad_rows, words, 4);
      }
    }
  }
}

// The 16 columns of a 16 x 16 tile of 32-bit values (its rows `r`), each a register: lane i of
// column j is r[i]'s lane j.
AMX inline void Transpose(const __m512 (&r)[16], __m512 (&column)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  for (int i = 0; i < 16; i += 4) {  // u[i + e]: lane L holds rows i .. i + 3 of column 4 L + e
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 a = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88), b = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88), d = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
    column[e] = _mm512_shuffle_f32x4(a, c, 0x88), column[8 + e] = _mm512_shuffle_f32x4(a, c, 0xDD);
    column[4 + e] = _mm512_shuffle_f32x4(b, d, 0x88), column[12 + e] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
}

// The 16 int32 lanes of v as floats.
AMX inline __m512 Float(__m512 v) { return _mm512_cvtepi32_ps(_mm512_castps_si512(v)); }

// Adds up the three parts of each row's sums: `sums` [16 weight rows][16 columns] of a tile of
// sums, for group g's rows and the nb weight rows from n (the tile transposed in registers).
// For bfloat16 the parts' float sums add; for int8 the digits' integer sums, each at its power of
// 128, times the row's scale and the weight rows' (`scale`).
template <typename W>
AMX inline void Unpack(const void* sums, int64_t g, int64_t rows, int64_t nb, int64_t n, float* out,
                       int64_t n_total, const float* scale, const float* row_scale) {
  const __mmask16 valid = static_cast<__mmask16>((1u << nb) - 1);
  __m512 r[16], column[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(static_cast<const float*>(sums) + 16 * i);
  Transpose(r, column);
  for (int64_t i = 0; i < kGroupRows && g * kGroupRows + i < rows; ++i) {
    const int64_t row = g * kGroupRows + i;
    const __m512* part = column + 3 * i;
    __m512 y;
    if constexpr (std::is_same_v<W, int8_t>) {
      y = _mm512_fmadd_ps(Float(part[2]), _mm512_set1_ps(1.0f / 16384),
                          _mm512_fmadd_ps(Float(part[1]), _mm512_set1_ps(1.0f / 128), Float(part[0])));
      y = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_set1_ps(row_scale[row])), _mm512_maskz_loadu_ps(valid, scale + n));
    } else {
      y = _mm512_add_ps(part[0], _mm512_add_ps(part[1], part[2]));
    }
    _mm512_mask_storeu_ps(out + row * n_total + n, valid, y);
  }
}

// Sums tile c += weight tile a x tile of x b. (A macro: the instructions name their tiles in text.)
#define PRODUCT(c, a, b)                       \
  do {                                         \
    if constexpr (std::is_same_v<W, int8_t>) { \
      _tile_dpbssd(c, a, b);                   \
    } else {                                   \
      _tile_dpbf16ps(c, a, b);                 \
    }                                          \
  } while (0)

// Columns [n0, n1) of out for all rows, from x packed: two tiles of weight rows by two tiles of x
// at a time (tiles 0, 1 and 2, 3; their four tiles of sums 4 to 7), so every tile loaded serves
// two products. Loading a tile is what binds (about 15 ns for its KB even from L1, where a product
// takes 6.5: docs/design.md, "Tiles of AMX").
template <typename W>
AMX void Columns(const uint32_t* packed, const W* w, float* out, int64_t rows, int64_t n_total, int64_t d,
                 int64_t n0, int64_t n1, const float* scale, const float* row_scale) {
  const int64_t depths = d / kDepth<W>, groups = (rows + kGroupRows - 1) / kGroupRows, stride = d * sizeof(W);
  thread_local std::vector<W> last;  // w's last weight rows, fewer than a tile, and zeros
  alignas(64) int32_t sums[kTileN * kColumns];
  const auto unpack = [&](int64_t g, int64_t nb, int64_t n) {
    Unpack<W>(sums, g, rows, nb, n, out, n_total, scale, row_scale);
  };
  Configure();
  for (int64_t n = n0; n < n1; n += 2 * kTileN) {
    const int64_t nb0 = std::min(kTileN, n1 - n), nb1 = std::clamp<int64_t>(n1 - n - kTileN, 0, kTileN);
    const W* w0 = w + n * d;
    const W* w1 = w0 + kTileN * d;
    const W*& short_tile = nb1 > 0 ? w1 : w0;  // only a pair's last tile can be short
    const int64_t short_rows = nb1 > 0 ? nb1 : nb0;
    if (short_rows < kTileN) {
      last.assign(kTileN * d, 0);
      std::copy(short_tile, short_tile + short_rows * d, last.data());
      short_tile = last.data();
    }
    for (int64_t g = 0; g < groups; g += 2) {
      const bool two_w = nb1 > 0, two_x = g + 1 < groups;
      const uint32_t* x0 = packed + g * depths * kPacked;
      const uint32_t* x1 = x0 + depths * kPacked;
      _tile_zero(4);
      _tile_zero(5);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t k = 0; k < depths; ++k) {
        _tile_loadd(0, w0 + k * kDepth<W>, stride);
        _tile_loadd(2, x0 + k * kPacked, 64);
        PRODUCT(4, 0, 2);
        if (two_x) {
          _tile_loadd(3, x1 + k * kPacked, 64);
          PRODUCT(5, 0, 3);
        }
        if (two_w) {
          _tile_loadd(1, w1 + k * kDepth<W>, stride);
          PRODUCT(6, 1, 2);
          if (two_x) PRODUCT(7, 1, 3);
        }
      }
      _tile_stored(4, sums, 64);
      unpack(g, nb0, n);
      if (two_x) {
        _tile_stored(5, sums, 64);
        unpack(g + 1, nb0, n);
      }
      if (two_w) {
        _tile_stored(6, sums, 64);
        unpack(g, nb1, n + kTileN);
        if (two_x) {
          _tile_stored(7, sums, 64);
          unpack(g + 1, nb1, n + kTileN);
        }
      }
    }
  }
  _tile_release();
}
#undef PRODUCT
#undef AMX
}  // namespace amx


// Whether the CPU has AMX's tiles with bfloat16 and int8 products, and the kernel lets this process use
// them (Linux asks a process to request the tiles' 8 KB of state first).
bool CpuHasAmx() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tiles = (edx >> 24) & 1, bf16 = (edx >> 22) & 1, int8 = (edx >> 25) & 1;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  const bool avx512_bf16 = (eax >> 5) & 1;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return tiles && bf16 && int8 && avx512_bf16 && CpuHasAvx512() && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

std::atomic<bool>& UseAmx() {
  static std::atomic<bool> use{CpuHasAmx()};
  return use;
}

// Runs body(n0, n1) for the blocks [n0, n1) of `cols` weight rows covering [0, n_total), a work
// item each.
template <typename Body>
void ForBlocks(ffi::ThreadPool& pool, int64_t n_total, int64_t cols, Body body) {
  ParallelFor(pool, (n_total + cols - 1) / cols, [=](int64_t block) {
    const int64_t n0 = block * cols;
    body(n0, std::min(n_total, n0 + cols));
  });
}

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
  if constexpr (!std::is_same_v<W, float>) {
    if (UseAmx().load(std::memory_order_relaxed) && d % amx::kDepth<W> == 0) {
      thread_local std::vector<uint32_t> packed;
      thread_local std::vector<float> row_scale;
      packed.assign((rows + amx::kGroupRows - 1) / amx::kGroupRows * (d / amx::kDepth<W>) * amx::kPacked, 0u);
      if constexpr (std::is_same_v<W, int8_t>) {
        row_scale.resize(rows);
        amx::PackInt8(xs, rows, d, packed.data(), row_scale.data());
      } else {
        amx::Pack(xs, rows, d, packed.data());
      }
      const uint32_t* ps = packed.data();
      const float* rs = row_scale.data();
      ForBlocks(pool, n_total, amx::kBlockCols, [=](int64_t n0, int64_t n1) {
        amx::Columns<W>(ps, ws, os, rows, n_total, d, n0, n1, scale, rs);
      });
      return ffi::Error::Success();
    }
  }
  ForBlocks(pool, n_total, kBlockCols, [=](int64_t n0, int64_t n1) {
    if (!HasAvx512()) return avx2::Columns(xs, ws, scale, os, rows, n_total, d, n0, n1);
    if constexpr (std::is_same_v<W, int8_t>) {
      avx512::Columns(xs, ws, scale, os, rows, n_total, d, n0, n1);
    } else {
      avx512::Columns(xs, ws, os, rows, n_total, d, n0, n1);
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

// Lets the kernels (products and attention) use AVX-512 where the CPU has it (use != 0) or not; returns
// whether they did.
extern "C" int jspec_use_avx512(int use) { return UseAvx512().exchange(use != 0 && CpuHasAvx512()); }

// Lets bfloat16 and int8 products use AMX where the CPU has it (use != 0) or not; returns whether they did.
extern "C" int jspec_use_amx(int use) { return UseAmx().exchange(use != 0 && CpuHasAmx()); }

// The products' paths in use: 1 for AVX-512's tiles, + 2 for AMX's (bfloat16 weights).
extern "C" int jspec_paths() { return HasAvx512() + 2 * UseAmx().load(std::memory_order_relaxed); }

// What the Python side checks its library against: raised with each change of a kernel's arguments (2: attention
// takes the cache rows its queries read).
extern "C" int jspec_abi() { return 2; }

extern "C" int jspec_cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
