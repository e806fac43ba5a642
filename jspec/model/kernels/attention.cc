// Attention of a few queries per row over jspec's KV cache on a CPU (called through jax.ffi from
// jspec/model/kernels/__init__.py): q [B, T, K, G, H], cache k and v [R, S, K, H] (rows, positions, kv heads,
// head dim), query (b, t) sees keys j < from[b, t] and key pos[b, t] of cache row rows[b] (from <= pos + 1;
// from = pos + 1 is causal attention, less lets a query skip the keys of alternatives to it, a round's
// candidates side by side), those with valid[b, j] set; out [B, T, K, G, H] and
// the log of each query's softmax denominator, lse [B, T, K, G] (-inf where it sees no key), with
// which a caller merges this attention with one over keys kept elsewhere (MJSD's beams).
//
// Why not XLA: its dot contracts over (row, kv head) pairs, so XLA:CPU first transposes every
// layer's whole cache to [B, K, S, H], reading and writing it once more per step; at batch 8
// over a long prompt that was most of a decode step (docs/design.md, "Attention on a CPU"). Here
// each chunk of 128 cache positions is read once per block of 16 query positions of a row (all
// kv heads), and only up to the last position a query of that block sees.
//
// Every output is computed the same way whatever else the call holds: a score is 8 lanes along
// H then the same sum of the lanes, a chunk's softmax runs over its visible keys in position
// order, the weighted sum of values adds them in position order, and the chunks combine in
// order. So a query gets the same bits alone, among the K + 1 of a verification, in a batch, or
// over a longer cache: attention is batch invariant by construction. The AVX-512 path (namespace
// avx512) computes the same bits with wider registers.

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;
using Queries = ffi::Buffer<ffi::F32, 5>;  // q and out [B, T, K, G, H]
using Cache = ffi::Buffer<ffi::F32, 4>;    // k and v [R, S, K, H]
using jspec::ParallelFor;
using jspec::Sum8;

namespace {

// Query positions t per work item: 16, or up to 64 in a call with items enough (a prefill's
// chunk), as each item copies its chunk of keys and values once (Attention).
constexpr int64_t kBlockQueries = 16, kMostBlockQueries = 64, kItems = 8;
constexpr int64_t kCombineQueries = 256;  // queries a work item of Combine takes

// The lane sums of 8 vectors, each ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)): the same
// order for every vector, whichever others share the call.
AVX2 inline __m256 Sum8x8(const __m256* x) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// scores[i, j] = q_i . k_j for NQ queries (contiguous, H apart) and NK keys (key_stride apart):
// a 4 x 3 register tile loads each 8 floats of a key once for 4 queries.
template <int NQ, int NK>
AVX2 void ScoreTile(const float* q, const float* k, int64_t key_stride, int64_t h, __m256i tail,
                    float* scores, int64_t score_stride) {
  __m256 acc[NQ][NK];
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NK; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= h; c += 8) {
    __m256 kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = _mm256_loadu_ps(k + j * key_stride + c);
    for (int i = 0; i < NQ; ++i) {
      const __m256 qv = _mm256_loadu_ps(q + i * h + c);
      for (int j = 0; j < NK; ++j) acc[i][j] = _mm256_fmadd_ps(qv, kv[j], acc[i][j]);
    }
  }
  if (c < h) {  // masked loads read zeros past the end of a head
    __m256 kv[NK];
    for (int j = 0; j < NK; ++j) kv[j] = _mm256_maskload_ps(k + j * key_stride + c, tail);
    for (int i = 0; i < NQ; ++i) {
      const __m256 qv = _mm256_maskload_ps(q + i * h + c, tail);
      for (int j = 0; j < NK; ++j) acc[i][j] = _mm256_fmadd_ps(qv, kv[j], acc[i][j]);
    }
  }
  __m256 flat[16];
  for (int i = 0; i < 16; ++i) flat[i] = i < NQ * NK ? acc[i / NK][i % NK] : _mm256_setzero_ps();
  alignas(32) float sums[16];
  _mm256_store_ps(sums, Sum8x8(flat));
  if (NQ * NK > 8) _mm256_store_ps(sums + 8, Sum8x8(flat + 8));
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < NK; ++j) scores[i * score_stride + j] = sums[i * NK + j];
}

using ScoreFn = void (*)(const float*, const float*, int64_t, int64_t, __m256i, float*, int64_t);
constexpr ScoreFn kScoreTiles[4][3] = {
    {ScoreTile<1, 1>, ScoreTile<1, 2>, ScoreTile<1, 3>},
    {ScoreTile<2, 1>, ScoreTile<2, 2>, ScoreTile<2, 3>},
    {ScoreTile<3, 1>, ScoreTile<3, 2>, ScoreTile<3, 3>},
    {ScoreTile<4, 1>, ScoreTile<4, 2>, ScoreTile<4, 3>},
};

// e^x for x <= 0 (a score minus its row's maximum): x = n ln 2 + r, |r| <= ln 2 / 2, e^r by a
// degree-6 polynomial (Cephes' expf coefficients), 2^n through the exponent bits. Below kFloor the
// result is 0. Both widths' Exp read these, so they take e^x alike, lane for lane.
namespace exp_constants {
constexpr float kFloor = -87.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;  // ln 2 in two parts, for r
constexpr float kPolynomial[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_constants

AVX2 inline __m256 Exp(__m256 x) {
  using namespace exp_constants;
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kFloor), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(kFloor));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 y = _mm256_set1_ps(kPolynomial[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kPolynomial[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(scale)));
}

// acc[r, e] = sum_j p[r, j] v_j[e] for NQ query rows of p (p_stride apart) and `lanes` <= 8 * NC
// values of each v_j (v_stride apart), j in position order.
template <int NQ, int NC>
AVX2 void ValueTile(const float* p, int64_t p_stride, const float* v, int64_t v_stride, int64_t lanes,
                    float* acc) {
  alignas(32) int32_t mask[16];
  for (int e = 0; e < 16; ++e) mask[e] = e < lanes ? -1 : 0;
  __m256i m[NC];
  for (int c = 0; c < NC; ++c) m[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(mask + 8 * c));
  // One array, its loops unrolled where they are written: as GCC (12.2) left them, 8 or more
  // accumulators were stored to the stack every key, as many stores as FMAs.
  __m256 a[NQ * NC];
#pragma GCC unroll 16
  for (int i = 0; i < NQ * NC; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < p_stride; ++j) {
    __m256 vv[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) vv[c] = _mm256_maskload_ps(v + j * v_stride + 8 * c, m[c]);
#pragma GCC unroll 8
    for (int r = 0; r < NQ; ++r) {
      const __m256 pr = _mm256_set1_ps(p[r * p_stride + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) a[r * NC + c] = _mm256_fmadd_ps(pr, vv[c], a[r * NC + c]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NQ * NC; ++i) _mm256_storeu_ps(acc + i / NC * 16 + i % NC * 8, a[i]);
}

using ValueFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*);
constexpr ValueFn kValueTiles[4][2] = {
    {ValueTile<1, 1>, ValueTile<1, 2>},
    {ValueTile<2, 1>, ValueTile<2, 2>},
    {ValueTile<3, 1>, ValueTile<3, 2>},
    {ValueTile<4, 1>, ValueTile<4, 2>},
};

// The same work on a CPU with AVX-512, with AVX2's bits. A score tile holds two keys in a 16-lane
// register, 8 values of a head of key j in its low half and the same 8 of key j + 1 in its high
// half, the query broadcast to both halves: each half runs exactly the FMAs of one 8-lane
// accumulator of ScoreTile, and Sum8x16 adds 16 halves' lanes as Sum8x8 adds 8 registers', with
// shuffles across registers in place of horizontal adds (as matmul.cc's AVX-512 float32 tiles
// pair weight rows). A value tile's lanes are independent sums in position order, 16 at a time
// instead of 8, a whole head of up to 64 values at once, so each weight p is broadcast once, not
// once a 16 values; the softmax compares its masks and takes e^x 16 lanes at a time, its sum
// added 8 lanes at a time in position order. Together 1.2-1.4x AVX2's speed on this CPU
// (docs/design.md, "Attention on a CPU").
namespace avx512 {

AVX512 inline __m512 KeyPair(__m256 a, __m256 b) { return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1); }

// The 8-lane sums of the 16 halves of 8 registers x, each by Sum8x8's additions ((l0 + l1) + (l2 +
// l3)) + ((l4 + l5) + (l6 + l7)), done across registers: [x0 lo, x1 lo, x2 lo, x3 lo, x0 hi, ..,
// x3 hi, x4 lo, .., x7 lo, x4 hi, .., x7 hi].
AVX512 inline __m512 Sum8x16(const __m512* x) {
  __m512 s[4], t[2];
  for (int i = 0; i < 4; ++i)
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// A score tile's 4 keys as two pairs, 8 values of key j in the low half of a 16-lane register and
// the same 8 of key j + 1 in the high half. SplitKeys joins two halves loaded from the chunk's keys
// (a missing key reads the last one again and its score is dropped); PairedKeys loads pairs that
// PairKeys laid out so, one load where SplitKeys spent two and a shuffle, which competed with the
// FMAs for their port. Both hold the same values, so a score is the same sum either way.
struct SplitKeys {
  const float* key[4];
  SplitKeys(const float* k, int64_t key_stride, int64_t nk) {
    for (int j = 0; j < 4; ++j) key[j] = k + std::min<int64_t>(j, nk - 1) * key_stride;
  }
  AVX512 __m512 Pair(int p, int64_t c) const {
    return KeyPair(_mm256_loadu_ps(key[2 * p] + c), _mm256_loadu_ps(key[2 * p + 1] + c));
  }
  AVX512 __m512 Tail(int p, int64_t c, __m256i tail) const {  // masked loads read zeros past a head's end
    return KeyPair(_mm256_maskload_ps(key[2 * p] + c, tail), _mm256_maskload_ps(key[2 * p + 1] + c, tail));
  }
};

struct PairedKeys {
  const float* pair[2];
  AVX512 __m512 Pair(int p, int64_t c) const { return _mm512_loadu_ps(pair[p] + 2 * c); }
  AVX512 __m512 Tail(int p, int64_t c, __m256i) const { return Pair(p, c); }  // zeros past the head's end
};

// scores[i, j] = q_i . k_j for NQ <= 8 queries and nk <= 4 keys.
template <int NQ, typename Keys>
AVX512 void ScoreTile(const float* q, const Keys& k, int64_t h, int64_t nk, __m256i tail, float* scores,
                      int64_t score_stride) {
  constexpr int kGroups = (NQ + 3) / 4;  // of 4 queries: 8 registers, 16 scores
  __m512 acc[4 * kGroups][2];
  for (int i = 0; i < 4 * kGroups; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= h; c += 8) {
    const __m512 k01 = k.Pair(0, c), k23 = k.Pair(1, c);
    for (int i = 0; i < NQ; ++i) {
      const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + i * h + c));
      acc[i][0] = _mm512_fmadd_ps(qv, k01, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(qv, k23, acc[i][1]);
    }
  }
  if (c < h) {
    const __m512 k01 = k.Tail(0, c, tail), k23 = k.Tail(1, c, tail);
    for (int i = 0; i < NQ; ++i) {
      const __m512 qv = _mm512_broadcast_f32x8(_mm256_maskload_ps(q + i * h + c, tail));
      acc[i][0] = _mm512_fmadd_ps(qv, k01, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(qv, k23, acc[i][1]);
    }
  }
  // Sum8x16's lanes [q0 k0, q0 k2, q1 k0, q1 k2, q0 k1, q0 k3, q1 k1, q1 k3, then q2 and q3 alike]
  // to rows of 4 keys.
  const __m512i rows = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  const __mmask16 keys = static_cast<__mmask16>((1u << nk) - 1);
  for (int g = 0; g < kGroups; ++g) {
    const __m512 x[8] = {acc[4 * g][0],     acc[4 * g][1],     acc[4 * g + 1][0], acc[4 * g + 1][1],
                         acc[4 * g + 2][0], acc[4 * g + 2][1], acc[4 * g + 3][0], acc[4 * g + 3][1]};
    alignas(64) float sums[16];
    _mm512_store_ps(sums, _mm512_permutexvar_ps(rows, Sum8x16(x)));
    for (int i = 4 * g; i < std::min(NQ, 4 * g + 4); ++i)
      _mm_mask_storeu_ps(scores + i * score_stride, keys, _mm_load_ps(sums + 4 * (i - 4 * g)));
  }
}

// A chunk's keys [count, K, H] (the cache's layout) as ScoreTile reads them: for each kv head, its
// keys in pairs, each pair 8 values of key j in the low half of a 16-lane register and the same
// 8 of key j + 1 in the high half, a head's blocks of 8 one after another (the last padded with
// zeros, as masked loads read them), an odd last key paired with itself: PairedKeys. One pass
// over the chunk in the cache's order.
AVX512 void PairKeys(const float* k, int64_t count, int64_t kv, int64_t h, float* pairs) {
  const int64_t blocks = (h + 7) / 8, pair_stride = 16 * blocks, head_stride = (count + 1) / 2 * pair_stride;
  for (int64_t j = 0; j < count; ++j)
    for (int64_t kh = 0; kh < kv; ++kh) {
      const float* key = k + (j * kv + kh) * h;
      float* pair = pairs + kh * head_stride + j / 2 * pair_stride;
      for (int64_t c = 0, block = 0; c < h; c += 8, ++block) {
        const __mmask8 in = static_cast<__mmask8>((1u << std::min<int64_t>(8, h - c)) - 1);
        const __m256 part = _mm256_maskz_loadu_ps(in, key + c);
        _mm256_storeu_ps(pair + 16 * block + 8 * (j % 2), part);
        if (j % 2 == 0 && j + 1 == count) _mm256_storeu_ps(pair + 16 * block + 8, part);
      }
    }
}

template <typename Keys>
using WideScoreFn = void (*)(const float*, const Keys&, int64_t, int64_t, __m256i, float*, int64_t);
constexpr int kScoreQueries = 8, kScoreKeys = 4;  // a score tile's most queries and keys
template <typename Keys>
constexpr WideScoreFn<Keys> kScoreTiles[kScoreQueries] = {
    ScoreTile<1, Keys>, ScoreTile<2, Keys>, ScoreTile<3, Keys>, ScoreTile<4, Keys>,
    ScoreTile<5, Keys>, ScoreTile<6, Keys>, ScoreTile<7, Keys>, ScoreTile<8, Keys>};

// scores [nq, count] (rows `count` apart) of the queries qs [nq, h] over a chunk's keys, in tiles
// of kScoreQueries x kScoreKeys; keys_at(j, nk) gives the tile's Keys for keys j .. j + nk - 1.
template <typename Keys, typename KeysAt>
AVX512 void Scores(const float* qs, int64_t nq, int64_t count, int64_t h, __m256i tail, float* scores,
                   KeysAt keys_at) {
  for (int64_t j = 0; j < count; j += kScoreKeys) {
    const int64_t nk = std::min<int64_t>(kScoreKeys, count - j);
    const Keys keys = keys_at(j, nk);
    for (int64_t i = 0; i < nq; i += kScoreQueries)
      kScoreTiles<Keys>[std::min<int64_t>(kScoreQueries, nq - i) - 1](qs + i * h, keys, h, nk, tail,
                                                                     scores + i * count + j, count);
  }
}

// acc[r, e] = sum_j p[r, j] v_j[e] for NQ query rows of p and `lanes` <= 16 * NC values of each v_j.
template <int NQ, int NC>
AVX512 void ValueTile(const float* p, int64_t p_stride, const float* v, int64_t v_stride, int64_t lanes,
                      float* acc) {
  __mmask16 m[NC];
  for (int c = 0; c < NC; ++c) m[c] = static_cast<__mmask16>((1u << std::clamp<int64_t>(lanes - 16 * c, 0, 16)) - 1);
  __m512 a[NQ * NC];  // one array, unrolled as AVX2's ValueTile says why
#pragma GCC unroll 16
  for (int i = 0; i < NQ * NC; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < p_stride; ++j) {
    __m512 vv[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_maskz_loadu_ps(m[c], v + j * v_stride + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < NQ; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * p_stride + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) a[r * NC + c] = _mm512_fmadd_ps(pr, vv[c], a[r * NC + c]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NQ * NC; ++i) _mm512_storeu_ps(acc + i / NC * 64 + i % NC * 16, a[i]);
}

// Exp's arithmetic, lane for lane, 16 lanes at a time.
AVX512 inline __m512 Exp(__m512 x) {
  using namespace exp_constants;
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kFloor), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(kFloor));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 y = _mm512_set1_ps(kPolynomial[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kPolynomial[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), y, _mm512_castsi512_ps(scale));
}

// ChunkSoftmax (below) 16 keys at a time, its masks compared in registers: the same bits, the
// lanes of its sum added 8 at a time in position order as there.
AVX512 float ChunkSoftmax(float* row, int64_t count, int64_t c0, int64_t from, int64_t last, const bool* valid,
                          float scale, float& sum) {
  const __m512 low = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 top16 = low;
  for (int64_t j = 0; j < count; j += 16) {
    const __mmask16 in = static_cast<__mmask16>((1u << std::min<int64_t>(16, count - j)) - 1);
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(c0 + j)));
    const __m128i ok = _mm_maskz_loadu_epi8(in, valid + c0 + j);
    const __mmask16 seen = (_mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(from))) |
                            _mm512_cmpeq_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(last)))) &
                           _mm_test_epi8_mask(ok, ok) & in;
    const __m512 x = _mm512_mask_mul_ps(low, seen, _mm512_maskz_loadu_ps(in, row + j), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(row + j, in, x);
    top16 = _mm512_max_ps(top16, x);
  }
  const float top = _mm512_reduce_max_ps(top16);
  if (top == -std::numeric_limits<float>::infinity()) {
    std::fill_n(row, count, 0.0f);
    sum = 0.0f;
    return top;
  }
  const __m512 top_all = _mm512_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; j += 16) {
    const __mmask16 in = static_cast<__mmask16>((1u << std::min<int64_t>(16, count - j)) - 1);
    const __m512 x = _mm512_mask_loadu_ps(low, in, row + j);
    const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_NEQ_UQ), Exp(_mm512_sub_ps(x, top_all)));
    _mm512_mask_storeu_ps(row + j, in, p);
    sum8 = _mm256_add_ps(sum8, _mm512_castps512_ps256(p));
    if (count - j > 8) sum8 = _mm256_add_ps(sum8, _mm512_extractf32x8_ps(p, 1));
  }
  sum = Sum8(sum8);
  return top;
}

constexpr ValueFn kValueTiles[4][4] = {
    {ValueTile<1, 1>, ValueTile<1, 2>, ValueTile<1, 3>, ValueTile<1, 4>},
    {ValueTile<2, 1>, ValueTile<2, 2>, ValueTile<2, 3>, ValueTile<2, 4>},
    {ValueTile<3, 1>, ValueTile<3, 2>, ValueTile<3, 3>, ValueTile<3, 4>},
    {ValueTile<4, 1>, ValueTile<4, 2>, ValueTile<4, 3>, ValueTile<4, 4>},
};

}  // namespace avx512

struct Shapes {
  int64_t b, t, kv, g, s, h;
};

// Softmax of one chunk of a query's scores row[0, count) (keys c0 ..), in place: p_j =
// e^(score_j - top) over the visible keys, exactly 0 elsewhere. Returns top (-inf when no key of
// the chunk is visible) and sets sum = sum_j p_j, 8 lanes by position mod 8, then Sum8.
AVX2 float ChunkSoftmax(float* row, int64_t count, int64_t c0, int64_t from, int64_t last, const bool* valid,
                        float scale, float& sum) {
  const float low = -std::numeric_limits<float>::infinity();
  float top = low;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t key = c0 + j;  // visible: below `from`, or the query's own key `last`
    row[j] = (key >= from && key != last) || !valid[key] ? low : row[j] * scale;
    top = std::max(top, row[j]);
  }
  if (top == low) {
    std::fill_n(row, count, 0.0f);
    sum = 0.0f;
    return top;
  }
  const __m256 top8 = _mm256_set1_ps(top), low8 = _mm256_set1_ps(low);
  __m256 sum8 = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; j += 8) {
    alignas(32) float part[8];
    std::fill_n(part, 8, low);
    std::copy(row + j, row + std::min<int64_t>(j + 8, count), part);
    const __m256 x = _mm256_load_ps(part);
    const __m256 p = _mm256_andnot_ps(_mm256_cmp_ps(x, low8, _CMP_EQ_OQ), Exp(_mm256_sub_ps(x, top8)));
    _mm256_store_ps(part, p);
    std::copy(part, part + std::min<int64_t>(8, count - j), row + j);
    sum8 = _mm256_add_ps(sum8, p);
  }
  sum = Sum8(sum8);
  return top;
}

// A work item: the queries of positions [t0, t1) of row b, every kv head, over the keys of one
// chunk [c0, c0 + kChunkKeys) that they can see. Each query's partial result for the chunk is
// (top, sum, acc[H] = sum_j p_j v_j in position order), combined over chunks by Combine.
constexpr int64_t kChunkKeys = 128;  // a multiple of 8: a chunk's lanes are positions mod 8

AVX2 void Chunk(const Shapes& n, const float* q, const float* k, const float* v, const int32_t* pos,
                const int32_t* from, const bool* valid, float scale, float* partial, int64_t chunks, int64_t b,
                int64_t row, int64_t t0, int64_t t1, int64_t chunk) {
  thread_local std::vector<float> qs, scores, kbuf, vbuf, pairs;  // a thread's scratch, kept between calls
  const int64_t h = n.h, g = n.g, key_stride = n.kv * h, nq = (t1 - t0) * g, stride = h + 2;
  int64_t keys = 0;  // keys [0, keys) are all the block's queries can see
  for (int64_t t = t0; t < t1; ++t) keys = std::max<int64_t>(keys, int64_t{pos[b * n.t + t]} + 1);
  const int64_t c0 = chunk * kChunkKeys, c1 = std::min({c0 + kChunkKeys, keys, n.s}), count = c1 - c0;
  alignas(32) int32_t lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = i < h % 8 ? -1 : 0;
  const __m256i tail = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  alignas(64) float acc[4 * 64];
  const bool wide = jspec::HasAvx512();
  // The chunk's keys and values are contiguous in the cache ([count, K, H] of its row `row`): one
  // sequential copy of each streams them from memory at full speed, where the per-head passes
  // below, 1 of every K heads' bytes at a time, left the prefetchers behind.
  // With AVX-512 and a score tile of queries or more (a prefill's chunk, a wide verification) the
  // keys go straight into ScoreTile's pairs (PairKeys), in the same one pass; for fewer queries
  // the pairing cost more than it saved.
  const bool paired = wide && nq >= avx512::kScoreQueries;
  const int64_t pair_stride = 16 * ((h + 7) / 8), head_pairs = (count + 1) / 2 * pair_stride;
  if (count > 0) {
    if (paired) {
      pairs.resize(n.kv * head_pairs);
      avx512::PairKeys(k + (row * n.s + c0) * key_stride, count, n.kv, h, pairs.data());
    } else {
      kbuf.resize(count * key_stride);
      std::copy_n(k + (row * n.s + c0) * key_stride, count * key_stride, kbuf.data());
    }
    vbuf.resize(count * key_stride);
    std::copy_n(v + (row * n.s + c0) * key_stride, count * key_stride, vbuf.data());
  }
  for (int64_t kh = 0; kh < n.kv; ++kh) {
    auto out = [&](int64_t i) {
      const int64_t query = ((b * n.t + t0 + i / g) * n.kv + kh) * g + i % g;
      return partial + (query * chunks + chunk) * stride;
    };
    if (count <= 0) {
      for (int64_t i = 0; i < nq; ++i) out(i)[0] = -std::numeric_limits<float>::infinity();
      continue;
    }
    qs.resize(nq * h);  // the block's queries for kv head kh, contiguous
    for (int64_t t = t0; t < t1; ++t)
      std::copy_n(q + ((b * n.t + t) * n.kv + kh) * g * h, g * h, qs.data() + (t - t0) * g * h);
    scores.resize(nq * count);
    if (paired) {
      const float* head = pairs.data() + kh * head_pairs;
      avx512::Scores<avx512::PairedKeys>(qs.data(), nq, count, h, tail, scores.data(), [&](int64_t j, int64_t nk) {
        const float* pair01 = head + j / 2 * pair_stride;
        return avx512::PairedKeys{{pair01, nk > 2 ? pair01 + pair_stride : pair01}};  // nk <= 2: dropped
      });
    } else if (wide) {
      const float* kb = kbuf.data() + kh * h;
      avx512::Scores<avx512::SplitKeys>(qs.data(), nq, count, h, tail, scores.data(), [&](int64_t j, int64_t nk) {
        return avx512::SplitKeys(kb + j * key_stride, key_stride, nk);
      });
    } else {
      const float* kb = kbuf.data() + kh * h;
      for (int64_t j = 0; j < count; j += 3) {
        const int64_t nk = std::min<int64_t>(3, count - j);
        for (int64_t i = 0; i < nq; i += 4) {
          const int64_t ni = std::min<int64_t>(4, nq - i);
          kScoreTiles[ni - 1][nk - 1](qs.data() + i * h, kb + j * key_stride, key_stride, h, tail,
                                      scores.data() + i * count + j, count);
        }
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      float* o = out(i);
      const int64_t query = b * n.t + t0 + i / g;
      o[0] = (wide ? avx512::ChunkSoftmax : ChunkSoftmax)(scores.data() + i * count, count, c0, from[query], pos[query],
                                                          valid + b * n.s, scale, o[1]);
    }
    const float* vb = vbuf.data() + kh * h;
    const int64_t tile_values = wide ? 64 : 16, acc_stride = wide ? 64 : 16;
    for (int64_t i = 0; i < nq; i += 4) {
      const int64_t ni = std::min<int64_t>(4, nq - i);
      for (int64_t c = 0; c < h; c += tile_values) {
        const int64_t width = std::min<int64_t>(tile_values, h - c);
        (wide ? avx512::kValueTiles[ni - 1][(width - 1) / 16] : kValueTiles[ni - 1][width > 8 ? 1 : 0])(
            scores.data() + i * count, count, vb + c, key_stride, width, acc);
        for (int64_t r = 0; r < ni; ++r) std::copy_n(acc + r * acc_stride, width, out(i + r) + 2 + c);
      }
    }
  }
}

// out = sum_c w_c acc_c / sum_c w_c sum_c with w_c = e^(top_c - top), chunks in order;
// lse = top + log(sum_c w_c sum_c).
void Combine(const float* partial, int64_t chunks, int64_t h, float* out, float* lse) {
  const int64_t stride = h + 2;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < chunks; ++c) top = std::max(top, partial[c * stride]);
  std::fill_n(out, h, 0.0f);
  *lse = top;
  if (top == -std::numeric_limits<float>::infinity()) return;  // no visible key: zeros
  float sum = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = partial + c * stride;
    if (p[0] == -std::numeric_limits<float>::infinity()) continue;
    const float w = std::exp(p[0] - top);
    sum += w * p[1];
    for (int64_t e = 0; e < h; ++e) out[e] += w * p[2 + e];
  }
  for (int64_t e = 0; e < h; ++e) out[e] /= sum;
  *lse = top + std::log(sum);
}

// Row b of the queries reads row rows[b] of the cache, which may hold more rows than the queries:
// a continuous batch's admit prefills new prompts in place, into their slots of the batch's cache.
ffi::Error Attention(ffi::ThreadPool pool, Queries q, Cache k, Cache v, ffi::Buffer<ffi::S32, 2> pos,
                     ffi::Buffer<ffi::S32, 2> from, ffi::Buffer<ffi::PRED, 2> valid,
                     ffi::Buffer<ffi::S32, 1> rows, float scale, ffi::Result<Queries> out,
                     ffi::Result<ffi::Buffer<ffi::F32, 4>> lse) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  Shapes n{qd[0], qd[1], qd[2], qd[3], kd[1], qd[4]};
  if (kd[2] != n.kv || kd[3] != n.h || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3] ||
      rows.dimensions()[0] != n.b)
    return ffi::Error::InvalidArgument("jspec_attention: q, k, v and rows disagree in shape");
  const int32_t* cache_rows = rows.typed_data();
  for (int64_t b = 0; b < n.b; ++b)
    if (cache_rows[b] < 0 || cache_rows[b] >= kd[0])
      return ffi::Error::InvalidArgument("jspec_attention: a row outside the cache");
  const int64_t queries = n.b * n.t * n.kv * n.g;
  if (queries == 0 || n.h == 0) return ffi::Error::Success();
  // Items are (row, block of query positions, chunk of keys), so even one query over a long
  // cache keeps both cores busy, each reading its own chunk. Chunks stop at the furthest key any
  // query sees: a prefill's early chunks or a short row in a long cache would otherwise pay, in
  // partial results to write and combine, for every chunk of the cache's length.
  const int32_t* ps = pos.typed_data();
  const int64_t seen = std::min<int64_t>(n.s, int64_t{*std::max_element(ps, ps + n.b * n.t)} + 1);
  const int64_t chunks = std::max<int64_t>(1, (seen + kChunkKeys - 1) / kChunkKeys);
  // Each item copies its chunk's keys and values (Chunk): a prefill's chunk of 128 positions in
  // blocks of 16 copied each chunk 8 times, a tenth of the kernel's time. A query's result is the
  // same in any block (its scores, softmax and sums are its own), so blocks grow while the call
  // keeps kItems items for the two cores.
  int64_t block = kBlockQueries;
  while (block < kMostBlockQueries && block < n.t && n.b * ((n.t + 2 * block - 1) / (2 * block)) * chunks >= kItems)
    block *= 2;
  const int64_t t_blocks = (n.t + block - 1) / block;
  // Not cleared: Chunk writes each (query, chunk)'s top, and Combine reads no more of a chunk whose
  // top is -inf.
  std::unique_ptr<float[]> partial(new float[queries * chunks * (n.h + 2)]);
  const float *qs = q.typed_data(), *ks = k.typed_data(), *vs = v.typed_data();
  const int32_t* fs = from.typed_data();
  const bool* valids = valid.typed_data();
  float* partials = partial.get();
  ParallelFor(pool, n.b * t_blocks * chunks, [=](int64_t item) {
    const int64_t chunk = item % chunks, tb = (item / chunks) % t_blocks, b = item / (chunks * t_blocks);
    const int64_t t0 = tb * block;
    Chunk(n, qs, ks, vs, ps, fs, valids, scale, partials, chunks, b, cache_rows[b], t0, std::min(n.t, t0 + block),
          chunk);
  });
  float *o = out->typed_data(), *l = lse->typed_data();
  ParallelFor(pool, (queries + kCombineQueries - 1) / kCombineQueries, [=](int64_t item) {
    for (int64_t i = item * kCombineQueries; i < std::min(queries, (item + 1) * kCombineQueries); ++i)
      Combine(partials + i * chunks * (n.h + 2), chunks, n.h, o + i * n.h, l + i);
  });
  return ffi::Error::Success();
}

auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<Queries>()
      .Arg<Cache>()
      .Arg<Cache>()
      .Arg<ffi::Buffer<ffi::S32, 2>>()
      .Arg<ffi::Buffer<ffi::S32, 2>>()
      .Arg<ffi::Buffer<ffi::PRED, 2>>()
      .Arg<ffi::Buffer<ffi::S32, 1>>()
      .Attr<float>("scale")
      .Ret<Queries>()
      .Ret<ffi::Buffer<ffi::F32, 4>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecAttention, Attention, Binding());
