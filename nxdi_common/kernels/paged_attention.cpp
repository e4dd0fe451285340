// Paged decode attention for the CPU backends: token-generation queries attend to their sequence's
// cached keys and values where they lie, in the block KV cache, through the block table.
//
// Why a kernel: with static-shape graphs, the torch path gathers every row's blocks up to the call's
// length bucket into a dense [B, Hkv, T, D] copy and runs SDPA over the whole bucket under a mask, so
// one long sequence makes every row of the step read and copy T positions. Here each row reads only
// positions 0..position_ids[b, s] of its own blocks: the cost follows the real lengths, not the
// bucket, and nothing is copied.
//
// Registered as torch.ops.nxdi.paged_decode_attention, so torch.jit.trace records it as one graph op
// and a traced graph that uses it loads in any process that has loaded this library first.
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace nxdi_simd;

struct Shapes {
  int64_t batch, heads, queries, dim, kv_heads, block_size, num_blocks, table_width;
};

// The arithmetic, as `Ops`: a Query and an Acc(umulator) with load(src, query), zero(acc) and
// store(acc, float*); widen_k / widen_v(src, stride, count, tile): up to 16 K or V rows of the
// cache into a tile of Elem; scores_tile (a query's scaled dot products with a K tile's rows);
// probs (the softmax of a score array, as Prob, returning 1 / the sum); accumulate_tile (a V
// tile's rows weighted by probabilities, into an accumulator). float32 (FloatTiles): portable
// C++ for any head_dim, AVX-512 for head_dim = 16 * NV, AVX2 (without AVX-512) for 8 * NV; and
// bf16 dot products (Bf16DotOps) for bf16 queries and cache where the CPU has AVX512-BF16.
constexpr int64_t kMaxPortableDim = 512;

// The float32 Ops' side of attend_heads' interface: queries and accumulators are both Rows, K and
// V tiles alike widened to float32, and the probabilities float32, in the scores' own array.
template <typename Self>
struct FloatTiles {
  using Prob = float;
  using Elem = float;
  static constexpr bool kProbsInPlace = true;
  static constexpr bool kValuesInPlace = false;  // see Bf16DotOps
  static constexpr float kKvScale = 1.f;  // the cache's values are the tiles' times this
  template <typename T> void widen_k(const T* src, int64_t stride, int64_t count, float* dst) const {
    static_cast<const Self*>(this)->widen(src, stride, count, dst);
  }
  template <typename T> void widen_v(const T* src, int64_t stride, int64_t count, float* dst) const {
    static_cast<const Self*>(this)->widen(src, stride, count, dst);
  }
  float probs(float* sc, int64_t len, float* /*p: sc itself*/, int64_t /*width*/) const {
    return static_cast<const Self*>(this)->softmax(sc, len);
  }
};

struct PortableOps : FloatTiles<PortableOps> {
  struct Row { float v[kMaxPortableDim]; };
  using Query = Row;
  using Acc = Row;
  int64_t d;
  template <typename T> void load(const T* src, Row& r) const {
    for (int64_t i = 0; i < d; ++i) r.v[i] = to_float(src[i]);
  }
  void zero(Row& r) const { std::fill(r.v, r.v + d, 0.f); }
  void store(const Row& r, float* out) const { std::copy(r.v, r.v + d, out); }
  // A tile: up to 16 cache rows (K or V of one head, `stride` elements apart) as float32, d apart.
  template <typename T> void widen(const T* src, int64_t stride, int64_t count, float* dst) const {
    for (int64_t o = 0; o < count; ++o)
      for (int64_t i = 0; i < d; ++i) dst[o * d + i] = to_float(src[o * stride + i]);
  }
  // sc[o] = dot(q, tile row o) * scale for o < count.
  void scores_tile(const float* tile, int64_t count, const Row& q, float scale, float* sc) const {
    for (int64_t o = 0; o < count; ++o) {
      float a = 0.f;
      for (int64_t i = 0; i < d; ++i) a += q.v[i] * tile[o * d + i];
      sc[o] = a * scale;
    }
  }
  // acc += sum over o < count of p[o] * tile row o.
  void accumulate_tile(const float* tile, int64_t count, const float* p, Row& acc) const {
    for (int64_t o = 0; o < count; ++o)
      for (int64_t i = 0; i < d; ++i) acc.v[i] += p[o] * tile[o * d + i];
  }
  float softmax(float* sc, int64_t len) const {
    const float mx = *std::max_element(sc, sc + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) sum += (sc[t] = std::exp(sc[t] - mx));
    return 1.f / sum;
  }
};

#if defined(__AVX512F__)
// Lane i of the result: the sum of a[i]'s 16 lanes (one transposing reduction for 16 rows).
inline __m512 sum_lanes16(const __m512 (&a)[16]) {
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 even, a1 even, a0 odd, a1 odd] sums
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sum for 4 rows
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // lanes 0+1 and 2+3 of two rows-of-4 each
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88),
                       _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

// sc[o] = the lane sum of dot_row(o) * scale for o < count (16 rows: one transposing reduction).
template <typename DotRow>
void scaled_lane_sums(DotRow&& dot_row, int64_t count, float scale, float* sc) {
  if (count == 16) {
    __m512 a[16];
    for (int o = 0; o < 16; ++o) a[o] = dot_row(o);
    _mm512_storeu_ps(sc, _mm512_mul_ps(sum_lanes16(a), _mm512_set1_ps(scale)));
    return;
  }
  for (int64_t o = 0; o < count; ++o) sc[o] = _mm512_reduce_add_ps(dot_row(o)) * scale;
}

template <int NV>
struct Avx512Ops : FloatTiles<Avx512Ops<NV>> {
  struct alignas(64) Row { __m512 v[NV]; };
  using Query = Row;
  using Acc = Row;
  template <typename T> void load(const T* src, Row& r) const {
    for (int j = 0; j < NV; ++j) r.v[j] = load16(src + 16 * j);
  }
  void zero(Row& r) const { for (int j = 0; j < NV; ++j) r.v[j] = _mm512_setzero_ps(); }
  template <typename T> void widen(const T* src, int64_t stride, int64_t count, float* dst) const {
    for (int64_t o = 0; o < count; ++o)
      for (int j = 0; j < NV; ++j)
        _mm512_store_ps(dst + (o * NV + j) * 16, load16(src + o * stride + 16 * j));
  }
  void scores_tile(const float* tile, int64_t count, const Row& q, float scale, float* sc) const {
    auto dot_row = [&](int64_t o) {
      const float* t = tile + o * NV * 16;
      __m512 a = _mm512_mul_ps(q.v[0], _mm512_loadu_ps(t));
      for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(q.v[j], _mm512_loadu_ps(t + 16 * j), a);
      return a;
    };
    scaled_lane_sums(dot_row, count, scale, sc);
  }
  void accumulate_tile(const float* tile, int64_t count, const float* p, Row& acc) const {
    // Two sets of sums (even and odd rows): twice the independent FMA chains.
    __m512 a[NV], e[NV];
    for (int j = 0; j < NV; ++j) a[j] = acc.v[j], e[j] = _mm512_setzero_ps();
    int64_t o = 0;
    for (; o + 2 <= count; o += 2) {
      const __m512 w0 = _mm512_set1_ps(p[o]), w1 = _mm512_set1_ps(p[o + 1]);
      for (int j = 0; j < NV; ++j) {
        a[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(tile + (o * NV + j) * 16), a[j]);
        e[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(tile + ((o + 1) * NV + j) * 16), e[j]);
      }
    }
    if (o < count) {
      const __m512 w0 = _mm512_set1_ps(p[o]);
      for (int j = 0; j < NV; ++j)
        a[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(tile + (o * NV + j) * 16), a[j]);
    }
    for (int j = 0; j < NV; ++j) acc.v[j] = _mm512_add_ps(a[j], e[j]);
  }
  void store(const Row& r, float* out) const {
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out + 16 * j, r.v[j]);
  }
  float softmax(float* sc, int64_t len) const {
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sc + i));
    if (i < len) {
      const __mmask16 m = static_cast<__mmask16>((1u << (len - i)) - 1);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, sc + i));
    }
    const __m512 vmx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), vmx));
      _mm512_storeu_ps(sc + t, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    if (t < len) {
      const __mmask16 m = static_cast<__mmask16>((1u << (len - t)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + t), vmx));
      _mm512_mask_storeu_ps(sc + t, m, e);
      vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
    }
    return 1.f / _mm512_reduce_add_ps(vsum);
  }
};

// bf16 queries on a bf16 cache, head_dim = 32 * NZ, on float32 FMAs (Avx512Ops' tiles and
// arithmetic) where the bf16 dot products are slow (bf16_dot_attention). Each 32 bf16 values
// widen to two float32 vectors without a shuffle: the even ones by a shift of each 32-bit lane,
// the odd ones by masking off its low half (vpmovzxwd, the portable widening, is a shuffle, on
// the same port as the transposing reduction). Queries, K and V rows are all widened so (dims
// in even-odd order within each 32); a dot product does not depend on the order, and store()
// puts the values' sums back in order.
template <int NZ>
struct Bf16PairFmaOps : FloatTiles<Bf16PairFmaOps<NZ>> {
  using BF16 = c10::BFloat16;
  using Base = Avx512Ops<2 * NZ>;
  using Row = typename Base::Row;
  using Query = Row;
  using Acc = Row;
  Base base;
  static __m512 even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
  static __m512 odd(__m512i x) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    return _mm512_castsi512_ps(_mm512_and_si512(x, high));
  }
  void load(const BF16* src, Row& r) const {
    for (int z = 0; z < NZ; ++z) {
      const __m512i x = _mm512_loadu_si512(src + 32 * z);
      r.v[2 * z] = even(x), r.v[2 * z + 1] = odd(x);
    }
  }
  void zero(Row& r) const { base.zero(r); }
  void widen(const BF16* src, int64_t stride, int64_t count, float* dst) const {
    for (int64_t o = 0; o < count; ++o)
      for (int z = 0; z < NZ; ++z) {
        const __m512i x = _mm512_loadu_si512(src + o * stride + 32 * z);
        _mm512_store_ps(dst + (o * NZ + z) * 32, even(x));
        _mm512_store_ps(dst + (o * NZ + z) * 32 + 16, odd(x));
      }
  }
  void scores_tile(const float* tile, int64_t count, const Row& q, float scale, float* sc) const {
    base.scores_tile(tile, count, q, scale, sc);
  }
  void accumulate_tile(const float* tile, int64_t count, const float* p, Row& acc) const {
    base.accumulate_tile(tile, count, p, acc);
  }
  float softmax(float* sc, int64_t len) const { return base.softmax(sc, len); }
  void store(const Row& r, float* out) const {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                                         15, 31);
    for (int z = 0; z < NZ; ++z) {
      _mm512_storeu_ps(out + 32 * z, _mm512_permutex2var_ps(r.v[2 * z], lo, r.v[2 * z + 1]));
      _mm512_storeu_ps(out + 32 * z + 16, _mm512_permutex2var_ps(r.v[2 * z], hi, r.v[2 * z + 1]));
    }
  }
};
#endif  // __AVX512F__

#if defined(__AVX512BF16__)
// 32 float8_e4m3fn values as the bf16 of each value times 2^-8, exactly: each byte (sign, 4
// exponent bits biased by 7, 3 mantissa bits) moved into an fp16's sign, exponent and mantissa
// reads as 2^-8 times its value, normals and subnormals alike (fp16's bias is 15); widened to
// float32 and rounded to bf16, which holds 3 mantissa bits exactly. The NaN codes (magnitude
// 0x7F) become fp16 NaN. AVX512-BW for the byte and word moves (every AVX512-BF16 CPU has it).
inline __m512i fp8x32_as_bf16_over_256(const c10::Float8_e4m3fn* p) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                               _mm512_set1_epi16(static_cast<int16_t>(0xBFFF)));
  const __mmask32 nan = _mm256_cmpeq_epi8_mask(
      _mm256_and_si256(bytes, _mm256_set1_epi8(0x7F)), _mm256_set1_epi8(0x7F));
  h = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7E00));
  const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// bf16 queries where the CPU has AVX512-BF16 (AMD Zen 4), head_dim = 32 * NZ, on a bf16 cache
// or (KV = float8_e4m3fn) a float8 one: the products on vdpbf16ps (two bf16 products summed
// into a float32 lane) straight from the cache's rows, instead of widening every row to float32
// and multiplying there. Scores: a query row's bf16 pairs against a key row's (exact products,
// float32 sums). Values: two positions' rows interleaved (unpack{lo,hi}_epi16, so lane pairs
// are (v[t][d], v[t+1][d])) against the pair of their probabilities, which are rounded to bf16
// for it; the accumulator's lanes then hold the dims in unpack order, put back in store().
// Subnormal inputs are flushed to zero (vdpbf16ps' DAZ), the one visible difference from the
// float32 path (tests tell the paths apart by it). A float8 row is made bf16 as it is loaded
// (its values times 2^-8, kKvScale: exact, and clear of bf16's subnormals), which costs a few
// instructions per 32 values where widening to float32 cost ~10 per 16 and then float32 FMAs.
template <int NZ, typename KV = c10::BFloat16>
struct Bf16DotOps {
  using BF16 = c10::BFloat16;
  using Prob = BF16;
  using Elem = BF16;
  static constexpr bool kProbsInPlace = false;
  static constexpr bool kFloat8 = std::is_same_v<KV, c10::Float8_e4m3fn>;
  static constexpr float kKvScale = kFloat8 ? 256.f : 1.f;
  // A bf16 cache's V rows are read where they lie (accumulate_rows), each pair interleaved in
  // registers once for up to kGroup queries, instead of interleaved into a tile in memory and
  // read back once per query: 1.13x the kernel (one thread, 16 rows of 640 positions, cache
  // resident; bench/bench_paged_op.py). K rows are still copied into the tile first: the scores
  // read straight from the cache ran 1.25x slower (the copy's plain loads bring the rows into L1
  // at full speed for all queries of the KV head; the dot products' own loads did not). A
  // float8 cache's rows are converted into the tile once for all of a KV head's queries.
  static constexpr bool kValuesInPlace = !kFloat8;
  static constexpr int kGroup = 4;
  struct alignas(64) Query { __m512i v[NZ]; };
  // [2z]: unpacklo's dims of 32z.. (see store), [2z + 1]: unpackhi's.
  struct alignas(64) Acc { __m512 v[2 * NZ]; };
  static __m512i row(const BF16* p) { return _mm512_loadu_si512(p); }
  static __m512i row(const c10::Float8_e4m3fn* p) { return fp8x32_as_bf16_over_256(p); }
  static __m512bh tile_pair(const BF16* tile, int64_t i) {  // the tile's i-th 32 values
    return (__m512bh)_mm512_load_si512(tile + i * 32);
  }
  void load(const BF16* src, Query& r) const {
    for (int z = 0; z < NZ; ++z) r.v[z] = row(src + 32 * z);
  }
  void zero(Acc& a) const { for (int j = 0; j < 2 * NZ; ++j) a.v[j] = _mm512_setzero_ps(); }
  // K rows as they are (float8: as bf16), d apart.
  void widen_k(const KV* src, int64_t stride, int64_t count, BF16* dst) const {
    for (int64_t o = 0; o < count; ++o)
      for (int z = 0; z < NZ; ++z)
        _mm512_store_si512(dst + (o * NZ + z) * 32, row(src + o * stride + 32 * z));
  }
  // V rows 2i and 2i + 1 interleaved: pair i's 2 * NZ vectors (a zero row after an odd count's
  // last).
  void widen_v(const KV* src, int64_t stride, int64_t count, BF16* dst) const {
    for (int64_t i = 0; 2 * i < count; ++i) {
      __m512i v[2 * NZ];
      interleave_pair(src + 2 * i * stride, stride, 2 * i + 1 < count, v);
      for (int k = 0; k < 2 * NZ; ++k) _mm512_store_si512(dst + (i * 2 * NZ + k) * 32, v[k]);
    }
  }
  // Rows r0 and r0 + stride (zeros for the second without `pair`) interleaved: v[2z] and
  // v[2z + 1] are unpack{lo,hi}_epi16 of their values 32z.. (the Acc order).
  static void interleave_pair(const KV* r0, int64_t stride, bool pair, __m512i (&v)[2 * NZ]) {
    for (int z = 0; z < NZ; ++z) {
      const __m512i a = row(r0 + 32 * z);
      const __m512i b = pair ? row(r0 + stride + 32 * z) : _mm512_setzero_si512();
      v[2 * z] = _mm512_unpacklo_epi16(a, b);
      v[2 * z + 1] = _mm512_unpackhi_epi16(a, b);
    }
  }
  void scores_tile(const BF16* tile, int64_t count, const Query& q, float scale, float* sc) const {
    auto dot_row = [&](int64_t o) {
      __m512 a = _mm512_setzero_ps();
      for (int z = 0; z < NZ; ++z)
        a = _mm512_dpbf16_ps(a, (__m512bh)q.v[z], tile_pair(tile, o * NZ + z));
      return a;
    };
    scaled_lane_sums(dot_row, count, scale, sc);
  }
  // accumulate_tile for G queries at once on `count` cache rows `stride` elements apart, read in
  // place: each pair of rows is interleaved once, in registers, for all G. Query j takes pairs
  // 0..pairs[j] (its probabilities zero past its position, as in accumulate_tile); a last row
  // without a partner (odd count) pairs with zeros.
  template <int G>
  void accumulate_rows(const KV* rows, int64_t stride, int64_t count, const BF16* const* p,
                       const int64_t* pairs, Acc* const* acc) const {
    __m512 a[G][2 * NZ];
    int64_t most = 0;
    for (int j = 0; j < G; ++j) {
      for (int k = 0; k < 2 * NZ; ++k) a[j][k] = acc[j]->v[k];
      most = std::max(most, pairs[j]);
    }
    for (int64_t i = 0; i < most; ++i) {
      __m512i v[2 * NZ];
      interleave_pair(rows + 2 * i * stride, stride, 2 * i + 1 < count, v);
      for (int j = 0; j < G; ++j) {
        if (i >= pairs[j]) continue;
        const __m512bh w = pair_at(p[j] + 2 * i);
        for (int k = 0; k < 2 * NZ; ++k) a[j][k] = _mm512_dpbf16_ps(a[j][k], (__m512bh)v[k], w);
      }
    }
    for (int j = 0; j < G; ++j)
      for (int k = 0; k < 2 * NZ; ++k) acc[j]->v[k] = a[j][k];
  }
  // The softmax of sc[0, len) as bf16 in p[0, len), zeros in p[len, width); returns 1 / the sum.
  float probs(float* sc, int64_t len, BF16* p, int64_t width) const {
    const float inv = Avx512Ops<1>{}.softmax(sc, len);
    int64_t t = 0;
    for (; t + 16 <= len; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc + t)));
    for (; t < len; ++t) p[t] = BF16(sc[t]);
    std::fill(p + len, p + width, BF16(0.f));
    return inv;
  }
  // acc += p[t] * v[t] for t < count (pairs: p[count] is zero or count is even).
  void accumulate_tile(const BF16* tile, int64_t count, const BF16* p, Acc& acc) const {
    __m512 a[2 * NZ], e[2 * NZ];  // even and odd pairs: twice the independent chains
    for (int j = 0; j < 2 * NZ; ++j) a[j] = acc.v[j], e[j] = _mm512_setzero_ps();
    auto pair_of = [&](int64_t i) { return pair_at(p + 2 * i); };
    const int64_t pairs = (count + 1) / 2;
    int64_t i = 0;
    for (; i + 2 <= pairs; i += 2) {
      const __m512bh w0 = pair_of(i), w1 = pair_of(i + 1);
      for (int j = 0; j < 2 * NZ; ++j) {
        a[j] = _mm512_dpbf16_ps(a[j], tile_pair(tile, i * 2 * NZ + j), w0);
        e[j] = _mm512_dpbf16_ps(e[j], tile_pair(tile, (i + 1) * 2 * NZ + j), w1);
      }
    }
    if (i < pairs) {
      const __m512bh w0 = pair_of(i);
      for (int j = 0; j < 2 * NZ; ++j)
        a[j] = _mm512_dpbf16_ps(a[j], tile_pair(tile, i * 2 * NZ + j), w0);
    }
    for (int j = 0; j < 2 * NZ; ++j) acc.v[j] = _mm512_add_ps(a[j], e[j]);
  }
  // unpack{lo,hi}_epi16 order back to dims: lane l of [2z + h] is dim 32z + 8 (l / 4) + 4h + l % 4.
  void store(const Acc& acc, float* out) const {
    alignas(64) float lanes[16];
    for (int z = 0; z < NZ; ++z)
      for (int h = 0; h < 2; ++h) {
        _mm512_store_ps(lanes, acc.v[2 * z + h]);
        for (int l = 0; l < 16; ++l) out[32 * z + 8 * (l / 4) + 4 * h + l % 4] = lanes[l];
      }
  }
};
#endif

// `count` Ts of this thread's scratch number `Slot`, 64-byte aligned, grown as needed and kept for
// later calls. Nothing in it is read before it is written: a std::vector<T>(count) per call
// zeroed every element (for bf16 probabilities one 2-byte store at a time: ~8% of the kernel).
template <typename T, int Slot>
T* scratch(int64_t count) {
  thread_local std::vector<float> buf;
  const size_t floats = (count * sizeof(T) + sizeof(float) - 1) / sizeof(float) + 16;
  if (buf.size() < floats) buf.resize(floats);
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(buf.data()) / sizeof(float) % 16;
  return reinterpret_cast<T*>(buf.data() + (16 - misaligned) % 16);
}

// The values of `count` V rows (positions pos..) for queries q0..q0+nq of one KV head, read in
// place (Ops::kValuesInPlace), kGroup queries per pass over the rows; each query takes the rows
// up to its own position, in pairs.
template <typename Ops, typename kv_t>
void accumulate_in_place(const Ops& ops, const kv_t* rows, int64_t stride, int64_t count,
                         int64_t pos, int64_t q0, int64_t nq, const int64_t* last,
                         typename Ops::Prob* probs, int64_t pn, typename Ops::Acc* acc) {
  constexpr int G = Ops::kGroup;
  for (int64_t g0 = 0; g0 < nq; g0 += G) {
    const typename Ops::Prob* p[G];
    typename Ops::Acc* a[G];
    int64_t pairs[G];
    int used = 0;
    for (int64_t qi = q0 + g0; qi < q0 + std::min(nq, g0 + G); ++qi) {
      const int64_t use = std::min(count, last[qi] + 1 - pos);
      if (use <= 0) continue;
      p[used] = probs + qi * pn + pos, a[used] = acc + qi, pairs[used] = (use + 1) / 2;
      ++used;
    }
    switch (used) {
      case 4: ops.template accumulate_rows<4>(rows, stride, count, p, pairs, a); break;
      case 3: ops.template accumulate_rows<3>(rows, stride, count, p, pairs, a); break;
      case 2: ops.template accumulate_rows<2>(rows, stride, count, p, pairs, a); break;
      case 1: ops.template accumulate_rows<1>(rows, stride, count, p, pairs, a); break;
      default: break;
    }
  }
}

// How many blocks ahead of the one it reads attend_heads prefetches (that block's rows a chunk at
// a time between the tiles' steps): NXDI_ATTENTION_PREFETCH_AHEAD=1-4 where set (read once),
// else 2, or 1 on Intel, where the chunked prefetch was tuned at 1 (sessions 45-50) and 2 has not
// been measured. AMD Zen 4 (session 62), 2 against 1 in alternating processes: a decode step of
// the bundled model on one thread (bench/bench_tkg_step.py, contiguous blocks, 3 rounds) 4 rows
// x 2048 positions 0.90-0.93x the time, 2 x 256 + 2 x 2048 0.78-0.92x, lower in every round;
// two threads, 16 x 576, 0.97-1.03x. The op alone (bench/bench_paged_op.py, blocks in a random
// order, 5 rounds): one thread 4 x 2048 lower in 4 rounds of 5, 8 x 576 in 3; two threads
// 16 x 576 in 4 (median 8.2 against 8.6 ms). A scratch sweep of 1-4 (4 rounds): 3 and 4 ahead
// slower than 2 on one thread's 4 x 2048 in every round.
int64_t prefetch_blocks_ahead() {
  static const int64_t ahead = [] {
    const char* env = std::getenv("NXDI_ATTENTION_PREFETCH_AHEAD");
    if (env != nullptr && *env != '\0') return std::clamp<int64_t>(std::atoll(env), 1, 4);
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") ? int64_t{1} : int64_t{2};
  }();
  return ahead;
}

// Part `seg` of `segments` of a row's positions (whole blocks, front to back) attended by one
// task, when a step has fewer rows than threads (run): per query, the largest score, the sum of
// exp(score - that) and the values weighted by those exps; merged by merge_segments.
struct Segment {
  int64_t seg, segments;
  float* partial;  // [queries of the row][dim + 2] (values, max, sum), or null: one segment, to out
  bool then_next_row = false;  // the task runs row b + 1 (all of it) next: prefetch its start
};

// Row b, all KV heads (query head h reads KV head h / group): per token, each KV head's K (then
// V) row is loaded once for all of its query heads and positions, and the row's blocks (of its
// segment) are read front to back. Block ids and positions are checked where they are used.
template <typename Ops, typename q_t, typename kv_t>
void attend_heads(const Ops& ops, const Shapes& s, const q_t* q, const kv_t* kc, const kv_t* vc,
                  const int64_t* table, const int64_t* pos, float scale, q_t* out, int64_t b,
                  Segment part) {
  using Prob = typename Ops::Prob;
  using Elem = typename Ops::Elem;
  const int64_t d = s.dim, group = s.heads / s.kv_heads;
  const int64_t per_kv = group * s.queries, nq = s.kv_heads * per_kv;
  const int64_t token_stride = s.kv_heads * d, limit = s.table_width * s.block_size;
  // Query qi = h * queries + i: contiguous in q and out from row b's first, first_row.
  const int64_t first_row = b * nq;
  std::vector<typename Ops::Query> qv(nq);
  std::vector<typename Ops::Acc> acc(nq);
  std::vector<int64_t> last(nq);
  int64_t n = 0;
  for (int64_t qi = 0; qi < nq; ++qi) {
    ops.load(q + (first_row + qi) * d, qv[qi]);
    ops.zero(acc[qi]);
    last[qi] = pos[b * s.queries + qi % s.queries];
    TORCH_CHECK(last[qi] >= 0 && last[qi] < limit, "paged_decode_attention: positions must lie "
                "in the block table's 0..", limit - 1, ", got ", last[qi]);
    n = std::max(n, last[qi] + 1);
  }
  // This task's positions [p0, p1): whole blocks, the row's blocks shared out front to back.
  const int64_t seg_blocks = (n + s.block_size - 1) / s.block_size;
  const int64_t per_seg = (seg_blocks + part.segments - 1) / part.segments * s.block_size;
  const int64_t p0 = std::min(n, part.seg * per_seg), p1 = std::min(n, p0 + per_seg);
  // Block by block, the next block prefetched; in a block, each KV head's rows 16 at a time are
  // made a tile once for all of its queries (widened to float32, or, on the bf16 dot products, K
  // as it is and V in interleaved pairs). Scores past a query's own position are
  // computed but never read; values are accumulated only up to each query's own position (past it
  // the cache may hold anything).
  constexpr int64_t kTile = 16;
  // visit(first, count, base, next): the block of positions first.., its count positions at
  // base, and the base of the block to prefetch meanwhile (stream_at; null: none).
  auto for_each_block = [&](const kv_t* cache, auto&& visit) {
    auto at = [&](int64_t i) {
      const int64_t block = table[b * s.table_width + i];
      TORCH_CHECK(block >= 0 && block < s.num_blocks, "paged_decode_attention: block ids must "
                  "lie in the cache's 0..", s.num_blocks - 1, ", got ", block);
      return cache + block * s.block_size * token_stride;
    };
    // Each block's visit prefetches the block `ahead` places on in this task's stream of blocks:
    // the row's K blocks (of its segment), then its V blocks, then (part.then_next_row) the next
    // row's K blocks. So the K pass's last blocks prefetch the V pass's first, and the V pass's
    // the next row's first (its block ids checked there; past its table, nothing). Until session
    // 33 each pass started unprefetched; AMD Zen 4, two threads, 30 layers' caches from memory,
    // the targets alternating in one process (16 rounds): 16 rows x 576 positions 0.968x the
    // time (lower in 15 rounds), 8 x 1792 0.987x, 4 x 256 0.994x. How far ahead:
    // prefetch_blocks_ahead.
    const int64_t first_block = p0 / s.block_size;
    const int64_t blocks = p0 < p1 ? (p1 - 1) / s.block_size + 1 - first_block : 0;
    // The stream's j-th block: this pass's block first_block + j, then the blocks after it.
    auto stream_at = [&](int64_t j) -> const kv_t* {
      if (j < blocks) return at(first_block + j);
      j -= blocks;
      if (cache == kc) return j < blocks ? vc + (at(first_block + j) - kc) : nullptr;
      if (!part.then_next_row || j >= s.table_width) return nullptr;
      const int64_t block = table[(b + 1) * s.table_width + j];
      return block >= 0 && block < s.num_blocks ? kc + block * s.block_size * token_stride
                                                : nullptr;
    };
    const int64_t ahead = prefetch_blocks_ahead();
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t first = p0 + j * s.block_size;
      visit(first, std::min(s.block_size, p1 - first), at(first_block + j), stream_at(j + ahead));
    }
  };
  // Head hk's rows t0..t0+m of the next block, into L2 ahead of their use. prefetcht1, not t0:
  // on AMD Zen 4 (one thread, 8 rows of 1792 positions, 30 layers' caches) t0 prefetches held
  // the kernel to 7.4 GB/s from DRAM, t1 doubles it (14.7), a block or two ahead alike.
  auto prefetch = [&](const kv_t* next, int64_t hk, int64_t t0, int64_t m) {
    if (next == nullptr) return;
    const int64_t row_bytes = d * static_cast<int64_t>(sizeof(kv_t));
    for (int64_t o = t0; o < t0 + m; ++o) {
      const char* p = reinterpret_cast<const char*>(next + o * token_stride + hk * d);
      for (int64_t off = 0; off < row_bytes; off += 64) prefetch_l2(p + off);
    }
  };
  // The tile at hand's rows of the next block are prefetched a chunk at a time between the
  // tile's steps (drip_from: one chunk before the widening; drip: one after it and one after
  // each query's scores or values; the rest after the tile), not all at once before it: on the
  // Intel VM (Xeon family 6 model 207) a burst of 32 prefetches held up the widening's own
  // reads from L2 behind them. 30 layers' caches from memory, in one process with the two
  // alternating (12 rounds): 16 rows x 576 positions, two threads 0.866x the time, one thread
  // 0.836x; 32 x 576 0.867x; 4 x 1792 0.888x; one row of 576 on two threads 0.869x. On AMD
  // Zen 3 (AVX2; session 51, 10 rounds) from memory 0.871x, 0.852x, -, 0.895x, 0.921x alike;
  // with one layer's cache warm in L2/L3 there, 16 x 576 1.146x (a decode step reads from memory).
  const kv_t* drip_next = nullptr;
  int64_t drip_hk = 0, drip_row = 0, drip_end = 0, drip_rows = 0;
  auto drip = [&] {
    const int64_t m = std::min(drip_rows, drip_end - drip_row);
    if (m <= 0) return;
    prefetch(drip_next, drip_hk, drip_row, m);
    drip_row += m;
  };
  auto drip_from = [&](const kv_t* next, int64_t hk, int64_t t0, int64_t m) {
    drip_next = next, drip_hk = hk, drip_row = t0, drip_end = t0 + m;
    drip_rows = (m + per_kv) / (per_kv + 1);  // per_kv + 1 chunks before the tile's last query
    drip();
  };
  // The tile is 64-byte aligned: unaligned vector stores and reloads of it cost a third more.
  float* const scores = scratch<float, 0>(nq * n);
  Elem* const tile_p = scratch<Elem, 1>(kTile * d);
  // Probabilities: in the scores' array, or (bf16) in their own, a query's row zero past its
  // position (probs() writes the zeros) so that a pair read one past a query's last position
  // reads a zero.
  const int64_t pn = Ops::kProbsInPlace ? n : n + 2;
  Prob* const probs = Ops::kProbsInPlace ? reinterpret_cast<Prob*>(scores)
                                         : scratch<Prob, 2>(nq * pn);
  // use(hk, pos, m, rows): the tile holds KV head hk's rows for positions pos..pos+m-1 (V's
  // only without kValuesInPlace), which lie in the cache from `rows` on, token_stride apart.
  auto for_each_tile = [&](const kv_t* cache, auto&& widen, auto&& use) {
    for_each_block(cache, [&](int64_t first, int64_t count, const kv_t* base, const kv_t* next) {
      for (int64_t hk = 0; hk < s.kv_heads; ++hk)
        for (int64_t t0 = 0; t0 < count; t0 += kTile) {
          const int64_t m = std::min(kTile, count - t0);
          drip_from(next, hk, t0, m);
          const kv_t* rows = base + t0 * token_stride + hk * d;
          if (!Ops::kValuesInPlace || cache == kc)  // else the V pass reads `rows` itself
            widen(rows, token_stride, m, tile_p);
          drip();
          use(hk, first + t0, m, rows);  // drip()s after each query
          prefetch(drip_next, drip_hk, drip_row, drip_end - drip_row);
        }
    });
  };
  auto widen_k = [&](auto... a) { ops.widen_k(a...); };
  auto widen_v = [&](auto... a) { ops.widen_v(a...); };
  const float tile_scale = scale * Ops::kKvScale;  // scores of tiles that hold K / kKvScale
  for_each_tile(kc, widen_k, [&](int64_t hk, int64_t pos, int64_t m, const kv_t*) {
    for (int64_t qi = hk * per_kv, end = qi + per_kv; qi < end; ++qi) {
      ops.scores_tile(tile_p, m, qv[qi], tile_scale, scores + qi * n + pos);
      drip();
    }
  });
  // Per query, the softmax of its scores in [p0, min(p1, its position + 1)): 1 / the sum of
  // exps, and (segments) the largest score they are taken from; none: a query before p0.
  std::vector<float> inv_sum(nq, 0.f), top(nq, -std::numeric_limits<float>::infinity());
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t len = std::min(p1, last[qi] + 1) - p0;
    if (len <= 0) continue;
    float* sc = scores + qi * n + p0;
    if (part.partial != nullptr) top[qi] = *std::max_element(sc, sc + len);
    inv_sum[qi] = ops.probs(sc, len, probs + qi * pn + p0, pn - p0);
  }
  for_each_tile(vc, widen_v, [&](int64_t hk, int64_t pos, int64_t m, const kv_t* rows) {
    if constexpr (Ops::kValuesInPlace) {
      accumulate_in_place(ops, rows, token_stride, m, pos, hk * per_kv, per_kv,
                          last.data(), probs, pn, acc.data());
      return;
    }
    for (int64_t qi = hk * per_kv, end = qi + per_kv; qi < end; ++qi) {
      const int64_t use = std::min(m, last[qi] + 1 - pos);
      if (use > 0) ops.accumulate_tile(tile_p, use, probs + qi * pn + pos, acc[qi]);
      drip();
    }
  });
  if (part.partial != nullptr) {  // the values' weighted sums, the max, the sum of exps
    for (int64_t qi = 0; qi < nq; ++qi) {
      float* dst = part.partial + qi * (d + 2);
      ops.store(acc[qi], dst);
      for (int64_t j = 0; j < d; ++j) dst[j] *= Ops::kKvScale;
      dst[d] = top[qi];
      dst[d + 1] = inv_sum[qi] > 0.f ? 1.f / inv_sum[qi] : 0.f;
    }
    return;
  }
  std::vector<float> tmp(d);
  for (int64_t qi = 0; qi < nq; ++qi) {
    ops.store(acc[qi], tmp.data());
    q_t* dst = out + (first_row + qi) * d;
    const float out_scale = inv_sum[qi] * Ops::kKvScale;  // (exact: a power of two)
    for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<q_t>(tmp[j] * out_scale);
  }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Avx512Ops' algorithm 8 floats at a time, for head_dim = 8 * NV on CPUs without AVX-512.
template <int NV>
struct Avx2Ops : FloatTiles<Avx2Ops<NV>> {
  struct alignas(32) Row { __m256 v[NV]; };
  using Query = Row;
  using Acc = Row;
  template <typename T> void load(const T* src, Row& r) const {
    for (int j = 0; j < NV; ++j) r.v[j] = load8(src + 8 * j);
  }
  void zero(Row& r) const { for (int j = 0; j < NV; ++j) r.v[j] = _mm256_setzero_ps(); }
  template <typename T> void widen(const T* src, int64_t stride, int64_t count, float* dst) const {
    for (int64_t o = 0; o < count; ++o)
      for (int j = 0; j < NV; ++j)
        _mm256_store_ps(dst + (o * NV + j) * 8, load8(src + o * stride + 8 * j));
  }
  __m256 dot_row(const float* tile, int64_t o, const Row& q) const {
    const float* t = tile + o * NV * 8;
    __m256 a = _mm256_mul_ps(q.v[0], _mm256_load_ps(t));
    for (int j = 1; j < NV; ++j) a = _mm256_fmadd_ps(q.v[j], _mm256_load_ps(t + 8 * j), a);
    return a;
  }
  void scores_tile(const float* tile, int64_t count, const Row& q, float scale, float* sc) const {
    int64_t o = 0;
    for (; o + 8 <= count; o += 8) {  // 8 dot products' lanes summed together by a hadd tree
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = dot_row(tile, o + i, q);
      const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20),
                                     _mm256_permute2f128_ps(t0, t1, 0x31));
      _mm256_storeu_ps(sc + o, _mm256_mul_ps(r, _mm256_set1_ps(scale)));
    }
    for (; o < count; ++o) sc[o] = reduce_add8(dot_row(tile, o, q)) * scale;
  }
  void accumulate_tile(const float* tile, int64_t count, const float* p, Row& acc) const {
    __m256 a[NV], e[NV];  // even and odd rows: twice the independent FMA chains
    for (int j = 0; j < NV; ++j) a[j] = acc.v[j], e[j] = _mm256_setzero_ps();
    int64_t o = 0;
    for (; o + 2 <= count; o += 2) {
      const __m256 w0 = _mm256_set1_ps(p[o]), w1 = _mm256_set1_ps(p[o + 1]);
      for (int j = 0; j < NV; ++j) {
        a[j] = _mm256_fmadd_ps(w0, _mm256_load_ps(tile + (o * NV + j) * 8), a[j]);
        e[j] = _mm256_fmadd_ps(w1, _mm256_load_ps(tile + ((o + 1) * NV + j) * 8), e[j]);
      }
    }
    if (o < count) {
      const __m256 w0 = _mm256_set1_ps(p[o]);
      for (int j = 0; j < NV; ++j)
        a[j] = _mm256_fmadd_ps(w0, _mm256_load_ps(tile + (o * NV + j) * 8), a[j]);
    }
    for (int j = 0; j < NV; ++j) acc.v[j] = _mm256_add_ps(a[j], e[j]);
  }
  void store(const Row& r, float* out) const {
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(out + 8 * j, r.v[j]);
  }
  float softmax(float* sc, int64_t len) const {
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sc + i));
    float mx = reduce_max8(vmax);
    for (; i < len; ++i) mx = std::max(mx, sc[i]);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), vmx));
      _mm256_storeu_ps(sc + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    if (t < len) {
      const __m256i m = first_lanes8(len - t);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(sc + t, m), vmx));
      _mm256_maskstore_ps(sc + t, m, e);
      vsum = _mm256_add_ps(vsum, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
    }
    return 1.f / reduce_add8(vsum);
  }
};
#endif

// Whether bf16 queries on a bf16 cache run on the bf16 dot products (Bf16DotOps) rather than
// on float32 FMAs (Bf16PairFmaOps): NXDI_ATTENTION_BF16_DOT=1/0 where set (read once), else
// everywhere but Intel. On this project's Intel VM (Xeon family 6 model 207, no AMX) vdpbf16ps
// runs at a quarter of vfmadd231ps' instruction rate (panel_linear.cpp, fma_min_rows) and the
// FMAs won: one decode step's 30 layers (bench/bench_paged_op.py, a copy alternating the paths
// in one process, 10-30 rounds) 16 rows x 576 positions from memory, two threads, 0.88x the
// time; 2 rows in L2, one thread, 0.88x, and the shift-and-mask widening 0.965x of that again
// against the portable widening (Avx512Ops). A float8 cache keeps the dot products everywhere:
// widening float8 to float32 (load16) took 2.8x as long there.
bool bf16_dot_attention() {
  static const bool on = [] {
    const char* env = std::getenv("NXDI_ATTENTION_BF16_DOT");
    if (env != nullptr && *env != '\0') return std::atoi(env) != 0;
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") == 0;
  }();
  return on;
}

// attend_heads with the fastest Ops for this head_dim.
template <typename q_t, typename kv_t, typename... Args>
void attend_heads_any(const Shapes& s, const q_t* q, const kv_t* k, const kv_t* v, Args... args) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<q_t, c10::BFloat16> &&
                (std::is_same_v<kv_t, c10::BFloat16> ||
                 std::is_same_v<kv_t, c10::Float8_e4m3fn>)) {
    if (!std::is_same_v<kv_t, c10::BFloat16> || bf16_dot_attention()) switch (s.dim) {
      case 32: return attend_heads(Bf16DotOps<1, kv_t>{}, s, q, k, v, args...);
      case 64: return attend_heads(Bf16DotOps<2, kv_t>{}, s, q, k, v, args...);
      case 96: return attend_heads(Bf16DotOps<3, kv_t>{}, s, q, k, v, args...);
      case 128: return attend_heads(Bf16DotOps<4, kv_t>{}, s, q, k, v, args...);
      default: break;
    }
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<kv_t, c10::BFloat16>) {
    switch (s.dim) {
      case 32: return attend_heads(Bf16PairFmaOps<1>{}, s, q, k, v, args...);
      case 64: return attend_heads(Bf16PairFmaOps<2>{}, s, q, k, v, args...);
      case 96: return attend_heads(Bf16PairFmaOps<3>{}, s, q, k, v, args...);
      case 128: return attend_heads(Bf16PairFmaOps<4>{}, s, q, k, v, args...);
      default: break;
    }
  }
#endif
#if defined(__AVX512F__)
  switch (s.dim) {
    case 16: return attend_heads(Avx512Ops<1>{}, s, q, k, v, args...);
    case 32: return attend_heads(Avx512Ops<2>{}, s, q, k, v, args...);
    case 48: return attend_heads(Avx512Ops<3>{}, s, q, k, v, args...);
    case 64: return attend_heads(Avx512Ops<4>{}, s, q, k, v, args...);
    case 80: return attend_heads(Avx512Ops<5>{}, s, q, k, v, args...);
    case 96: return attend_heads(Avx512Ops<6>{}, s, q, k, v, args...);
    case 128: return attend_heads(Avx512Ops<8>{}, s, q, k, v, args...);
    default: break;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  switch (s.dim) {
    case 16: return attend_heads(Avx2Ops<2>{}, s, q, k, v, args...);
    case 32: return attend_heads(Avx2Ops<4>{}, s, q, k, v, args...);
    case 48: return attend_heads(Avx2Ops<6>{}, s, q, k, v, args...);
    case 64: return attend_heads(Avx2Ops<8>{}, s, q, k, v, args...);
    case 80: return attend_heads(Avx2Ops<10>{}, s, q, k, v, args...);
    case 96: return attend_heads(Avx2Ops<12>{}, s, q, k, v, args...);
    case 128: return attend_heads(Avx2Ops<16>{}, s, q, k, v, args...);
    default: break;
  }
#endif
  attend_heads(PortableOps{{}, s.dim}, s, q, k, v, args...);
}

// out[b, h, i] from the segments' partial sums of row b (Segment): each segment's exps rescaled
// to the largest score of all, then the values' sums divided by the exps' sum.
template <typename q_t>
void merge_segments(const Shapes& s, const float* partials, int64_t segments, q_t* out) {
  const int64_t d = s.dim, row_queries = s.heads * s.queries, part_size = row_queries * (d + 2);
  std::vector<float> sum(d);
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t qi = 0; qi < row_queries; ++qi) {
      auto at = [&](int64_t seg) {
        return partials + (b * segments + seg) * part_size + qi * (d + 2);
      };
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t seg = 0; seg < segments; ++seg) top = std::max(top, at(seg)[d]);
      std::fill(sum.begin(), sum.end(), 0.f);
      float total = 0.f;
      for (int64_t seg = 0; seg < segments; ++seg) {
        const float* p = at(seg);
        if (p[d + 1] == 0.f) continue;  // no positions of this query in the segment
        const float w = std::exp(p[d] - top);
        total += p[d + 1] * w;
        for (int64_t j = 0; j < d; ++j) sum[j] += p[j] * w;
      }
      q_t* dst = out + (b * row_queries + qi) * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<q_t>(sum[j] / total);
    }
}

// The kernel's operands where they lie: q and out [B, H, S, D] (q's dtype), K and V
// [num_blocks, block_size, Hkv, D] (the cache's dtype), block_table [B, W] and position_ids
// [B, S] int64, all contiguous.
struct Operands {
  at::ScalarType q_type, kv_type;
  const void *q, *k, *v;
  const int64_t *table, *pos;
  void* out;
};

template <typename q_t, typename kv_t>
void run(const Shapes& s, const Operands& o, double scale) {
  const q_t* qp = static_cast<const q_t*>(o.q);
  const kv_t* kp = static_cast<const kv_t*>(o.k);
  const kv_t* vp = static_cast<const kv_t*>(o.v);
  const int64_t* tp = o.table;
  const int64_t* pp = o.pos;
  q_t* op = static_cast<q_t*>(o.out);
  // A task is a row's positions for all KV heads: its blocks read front to back, every byte of
  // each block used. With fewer rows than threads each row is cut into segments of whole blocks,
  // one a thread, merged afterwards (merge_segments). Until 2026-11-26 such a row was split by KV
  // head instead; with 3 KV heads on two threads each read 128 of every 384 bytes of a token, and
  // two threads were no faster than one (bench/bench_paged_op.py --rows 1 --length 1792 on AMD
  // Zen 4: 2.2-2.8 ms a step against 1.6-2.3 with two segments). With 3 rows on two threads,
  // segments (balancing the work) were no faster than whole rows: from memory this kernel is
  // bound by memory, not by the dot products.
  const int64_t threads = at::get_num_threads();
  const int64_t segments = s.batch < threads ? (threads + s.batch - 1) / s.batch : 1;
  const int64_t row_queries = s.heads * s.queries, part_size = row_queries * (s.dim + 2);
  std::vector<float> partials(segments > 1 ? s.batch * segments * part_size : 0);
  at::parallel_for(0, s.batch * segments, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const Segment part{task % segments, segments,
                         segments > 1 ? partials.data() + task * part_size : nullptr,
                         segments == 1 && task + 1 < end};
      attend_heads_any(s, qp, kp, vp, tp, pp, static_cast<float>(scale), op, task / segments,
                       part);
    }
  });
  if (segments > 1) merge_segments(s, partials.data(), segments, op);
}

template <typename q_t>
void dispatch_kv(const Shapes& s, const Operands& o, double scale) {
  switch (o.kv_type) {
    case at::kFloat: return run<q_t, float>(s, o, scale);
    case at::kBFloat16: return run<q_t, c10::BFloat16>(s, o, scale);
    case at::kHalf: return run<q_t, c10::Half>(s, o, scale);
    case at::kFloat8_e4m3fn: return run<q_t, c10::Float8_e4m3fn>(s, o, scale);
    default: TORCH_CHECK(false, "paged_decode_attention: k_cache dtype ", o.kv_type,
                         " is not supported (float32, bfloat16, float16, float8_e4m3fn)");
  }
}

void attend(const Shapes& s, const Operands& o, double scale) {
  switch (o.q_type) {
    case at::kFloat: return dispatch_kv<float>(s, o, scale);
    case at::kBFloat16: return dispatch_kv<c10::BFloat16>(s, o, scale);
    case at::kHalf: return dispatch_kv<c10::Half>(s, o, scale);
    default: TORCH_CHECK(false, "paged_decode_attention: q dtype ", o.q_type,
                         " is not supported (float32, bfloat16, float16)");
  }
}

// The checks of the operands' shapes that both ops make (s from q and the cache; k_dim: the
// cache's head_dim).
void check_shapes(const Shapes& s, int64_t k_dim, const at::Tensor& table, const at::Tensor& pos) {
  TORCH_CHECK(k_dim == s.dim, "paged_decode_attention: head_dim of q (", s.dim,
              ") and of the cache (", k_dim, ") differ");
  TORCH_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "paged_decode_attention: ", s.heads,
              " query heads are not a multiple of ", s.kv_heads, " KV heads");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == s.batch,
              "paged_decode_attention: block_table must be [B, W] with B = ", s.batch);
  TORCH_CHECK(pos.dim() == 2 && pos.size(0) == s.batch && pos.size(1) == s.queries,
              "paged_decode_attention: position_ids must be [B, S] = [", s.batch, ", ", s.queries, "]");
  TORCH_CHECK(s.dim <= kMaxPortableDim, "paged_decode_attention: head_dim ", s.dim,
              " is over ", kMaxPortableDim);
}

// q [B, H, S, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table [B, W];
// position_ids [B, S]: query s of row b attends to positions 0..position_ids[b, s], position p
// lying in block block_table[b, p / block_size] at offset p % block_size. Query head h reads KV
// head h / (H / Hkv), as SDPA's enable_gqa does. Returns [B, H, S, D] in q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& position_ids, double scale) {
  TORCH_CHECK(q_in.dim() == 4, "paged_decode_attention: q must be [B, H, S, D], got ", q_in.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: k_cache and v_cache must both be [blocks, block_size, Hkv, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: k_cache and v_cache dtypes differ");
  const at::Tensor q = q_in.contiguous(), k = k_cache.contiguous(), v = v_cache.contiguous();
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor pos = position_ids.to(at::kLong).contiguous();
  Shapes s{q.size(0), q.size(1), q.size(2), q.size(3), k.size(2), k.size(1), k.size(0),
           table.size(1)};
  check_shapes(s, k.size(3), table, pos);
  at::Tensor out = at::empty(q.sizes(), q.options());
  attend(s, {q.scalar_type(), k.scalar_type(), q.const_data_ptr(), k.const_data_ptr(),
             v.const_data_ptr(), table.const_data_ptr<int64_t>(), pos.const_data_ptr<int64_t>(),
             out.mutable_data_ptr()}, scale);
  return out;
}

// paged_decode_attention as a decode layer calls it: q [B, S, H, D] as rope_qk_store returns it,
// the model's whole cache [layers, 2 (K, V), blocks, block_size, Hkv, D] and the layer; returns
// [B, S, H * D], the layout o_proj takes. One node of a traced graph instead of eight (the
// cache's four selects, two transposes and a flatten around paged_decode_attention), each of
// which costs the TorchScript interpreter ~0.6 us: 210 nodes of a 30-layer decode step's 678.
at::Tensor paged_decode_attention_layer(const at::Tensor& q, const at::Tensor& cache,
                                        int64_t layer, const at::Tensor& block_table,
                                        const at::Tensor& position_ids, double scale) {
  TORCH_CHECK(q.dim() == 4, "paged_decode_attention_layer: q must be [B, S, H, D], got ",
              q.sizes());
  TORCH_CHECK(cache.dim() == 6 && cache.size(1) == 2, "paged_decode_attention_layer: cache must "
              "be [layers, 2, blocks, block_size, Hkv, D], got ", cache.sizes());
  TORCH_CHECK(layer >= 0 && layer < cache.size(0), "paged_decode_attention_layer: layer ", layer,
              " is not in 0..", cache.size(0) - 1);
  if (q.size(1) == 1 && q.is_contiguous() && cache.is_contiguous() &&
      block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
      position_ids.scalar_type() == at::kLong && position_ids.is_contiguous()) {
    // One query a row (a decode step): q [B, 1, H, D] lies as the kernel's [B, H, 1, D], and its
    // output as o_proj's [B, 1, H * D]; the layer's K and V are found by their offsets. No views
    // made: the four selects, two transposes, reshape and conversions of the general path below
    // cost ~7 us a call right after a product has streamed its weights through the caches (the
    // op 30.8 us against 24 in its kernel; the Intel VM with AMX, session 56).
    Shapes s{q.size(0), q.size(2), 1, q.size(3), cache.size(4), cache.size(3), cache.size(2),
             block_table.size(1)};
    check_shapes(s, cache.size(5), block_table, position_ids);
    const auto* layer_kv = static_cast<const char*>(cache.const_data_ptr()) +
                           layer * cache.stride(0) * cache.element_size();
    at::Tensor out = at::empty({s.batch, 1, s.heads * s.dim}, q.options());
    attend(s, {q.scalar_type(), cache.scalar_type(), q.const_data_ptr(), layer_kv,
               layer_kv + cache.stride(1) * cache.element_size(),
               block_table.const_data_ptr<int64_t>(), position_ids.const_data_ptr<int64_t>(),
               out.mutable_data_ptr()}, scale);
    return out;
  }
  const at::Tensor kv = cache.select(0, layer);
  const at::Tensor out = paged_decode_attention(q.transpose(1, 2), kv.select(0, 0),
                                                kv.select(0, 1), block_table, position_ids, scale);
  return out.transpose(1, 2).reshape({q.size(0), q.size(1), q.size(2) * q.size(3)});
}

}  // namespace

TORCH_LIBRARY(nxdi, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor position_ids, float scale) -> Tensor");
  m.def("paged_decode_attention_layer(Tensor q, Tensor cache, int layer, Tensor block_table, "
        "Tensor position_ids, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdi, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_decode_attention_layer", &paged_decode_attention_layer);
}
