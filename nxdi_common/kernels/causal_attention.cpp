// Causal self-attention for context encoding (prefill) on CPU, registered as
// torch.ops.nxdi.causal_attention. Flash-style: per block of 64 query positions, the keys are
// visited in chunks of up to 512 with a running (online) softmax, so no more than one chunk of
// scores exists at a time. In torch's flash kernel most of a long prompt's time is the softmax,
// not the products (perf, 1792 tokens, one thread: ~2/3 in its exp/max/sum passes), so this kernel
//   - stops each query block's keys at the block's last position (the masked triangle is 64 x 64
//     instead of a 256 x 512 diagonal block): ~25% fewer scores at 1792 tokens;
//   - runs the query heads that share a KV head as one product (M = 64 x heads per group), so
//     each packed K and V panel serves the whole group;
//   - finds each row's maximum on the raw scores and computes e^(scale s - max) with one fused
//     multiply-add and a short polynomial (exp_nonpositive16), and writes the probabilities to
//     bfloat16 with one AVX512-BF16 instruction;
//   - reads q, k, v where the QKV projection left them (any position and head strides) and writes
//     the output as [batch, seq, heads, head_dim], which the output projection reads as is.
// The products are oneDNN's brgemm through ATen where oneDNN packs the dtype (AVX-512 with AMX);
// K^T and V are packed once per (batch, KV head) into oneDNN's layout. The math is torch's: float32
// scores, scaled, e^(s - running max) summed in float32, probabilities rounded to the dtype for
// the P.V product, float32 accumulation, one division and one rounding at the end; results agree
// with torch's SDPA to the dtype's rounding (not bit for bit).
// Where oneDNN cannot pack the dtype but the CPU has AVX2 and FMA (AVX2-only CPUs, and AVX-512
// without AMX such as AMD Zen 4) a float32 variant runs on our panel tile (tile_path, below);
// bfloat16 where the CPU has AVX512-BF16 (Zen 4) runs its products on bf16 dot products instead
// (tile_path::attention_dot: 1792 tokens 1.49x the float32 variant, one core).
// bfloat16 and float16 with head_dim a multiple of 64 and scale > 0; anything else runs torch's
// SDPA inside the op, so callers need no check.
// torch.ops.nxdi.chunk_attention is the same tile path for a chunk of a prompt over the cache
// (chunked prefill): queries at given positions, each over the keys up to its own position, the
// keys read only up to the chunk's last position.
#include "panel_tile.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Which paths this build has: brgemm (AVX-512, used where oneDNN packs the dtype, i.e. AMX) and
// the float32 panel-tile path (AVX2 + FMA, so on AVX-512 CPUs too: it runs where oneDNN cannot
// pack, e.g. AMD Zen 4's AVX512-BF16 without AMX, and on AVX2-only CPUs).
#if defined(__AVX512F__)
constexpr bool kBrgemmBuilt = true;
#else
constexpr bool kBrgemmBuilt = false;
#endif
#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kTileBuilt = true;
#else
constexpr bool kTileBuilt = false;
#endif

using namespace nxdi_simd;
namespace blas = at::native::cpublas;

constexpr int64_t kQueryBlock = 64;  // query positions per block
constexpr int64_t kPanel = 64;       // keys per packed K^T panel, head-dim columns per V panel
constexpr int64_t kChunk = 512;      // keys per online-softmax step (multiple of kPanel)
// Row stride of the score and probability buffers: not a multiple of 4 KiB's worth, so rows do
// not all land in the same cache sets.
constexpr int64_t kLd = kChunk + 16;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// seq: query positions; keys: key positions read (= seq for causal attention; for a prompt
// chunk, its last query's position + 1); seq_pad: keys rounded up to whole panels.
struct Shape {
  int64_t batch, heads, kv_heads, seq, seq_pad, dim, keys;
  int64_t group() const { return heads / kv_heads; }  // query heads per KV head
};

#if defined(__AVX512F__)
// Shared by the brgemm path and the tile path's bf16 dot products (AVX-512).
// Probabilities (in [0, 1], never NaN) to the dtype: one instruction for bfloat16 where the CPU
// has AVX512-BF16 (the same round-to-nearest-even as store16, without its NaN handling).
inline void store_probs(c10::BFloat16* p, __m512 x) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#else
  store16(p, x);
#endif
}
inline void store_probs(c10::Half* p, __m512 x) { store16(p, x); }

// e^x for x <= 0 (scores minus their running maximum): x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// Taylor series to r^5, times 2^n. Relative error below 3e-6, a thousandth of the rounding step
// of the bfloat16 (or float16) probabilities it feeds, for 9 instructions instead of exp16's 14.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), x);
  __m512 p = _mm512_set1_ps(1.f / 120.f);
  for (float c : {1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// One chunk's softmax step for one row of raw q.k scores (n valid keys of width w, a multiple of
// 16): running max of scale * s, e^(scale * s - max) into p (zero past n), running sum; returns
// the factor by which the row's earlier output and sum shrink. scale > 0.
template <typename T>
float softmax_step16(const float* scores, int64_t n, int64_t w, float scale, float& row_max,
                     float& row_sum, T* p) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < full; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(scores + j));
  if (tail) vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, scores + full));
  const float new_max = std::max(row_max, _mm512_reduce_max_ps(vmax) * scale);
  const __m512 vscale = _mm512_set1_ps(scale), vneg = _mm512_set1_ps(-new_max);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= full; j += 32) {
    const __m512 e0 = exp_nonpositive16(_mm512_fmadd_ps(_mm512_loadu_ps(scores + j), vscale, vneg));
    const __m512 e1 =
        exp_nonpositive16(_mm512_fmadd_ps(_mm512_loadu_ps(scores + j + 16), vscale, vneg));
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    store_probs(p + j, e0);
    store_probs(p + j + 16, e1);
  }
  for (; j < full; j += 16) {
    const __m512 e = exp_nonpositive16(_mm512_fmadd_ps(_mm512_loadu_ps(scores + j), vscale, vneg));
    sum0 = _mm512_add_ps(sum0, e);
    store_probs(p + j, e);
  }
  if (tail) {
    const __m512 e = _mm512_maskz_mov_ps(
        tail, exp_nonpositive16(_mm512_fmadd_ps(_mm512_loadu_ps(scores + j), vscale, vneg)));
    sum0 = _mm512_add_ps(sum0, e);
    store_probs(p + j, e);
    j += 16;
  }
  for (; j < w; j += 16) store_probs(p + j, _mm512_setzero_ps());
  const float shrink = row_max == -std::numeric_limits<float>::infinity()
                           ? 0.f : std::exp(row_max - new_max);
  row_max = new_max;
  row_sum = row_sum * shrink + _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
  return shrink;
}

namespace brgemm_path {

// K^T of one (batch, KV head) as oneDNN-packed panels of kPanel keys ([dim x kPanel] each, keys
// past the sequence zero), and V as packed [seq_pad x kPanel] panels of head-dim columns.
template <typename T>
void pack_kv(const T* k, const T* v, int64_t k_pos_stride, int64_t v_pos_stride,
             const Shape& s, T* kp, T* vp) {
  const at::ScalarType dt = c10::CppTypeToScalarType<T>::value;
  std::vector<T> tmp(std::max(s.dim, s.seq_pad) * kPanel);
  for (int64_t p = 0; p < s.seq_pad / kPanel; ++p) {
    for (int64_t j = 0; j < kPanel; ++j) {
      const int64_t key = p * kPanel + j;
      for (int64_t d = 0; d < s.dim; ++d)
        tmp[d * kPanel + j] = key < s.seq ? k[key * k_pos_stride + d] : T(0.f);
    }
    blas::pack(s.dim, kPanel, kPanel, kPanel, dt, dt, tmp.data(), kp + p * s.dim * kPanel);
  }
  for (int64_t c = 0; c < s.dim / kPanel; ++c) {
    for (int64_t key = 0; key < s.seq_pad; ++key) {
      T* row = tmp.data() + key * kPanel;
      if (key < s.seq)
        std::memcpy(row, v + key * v_pos_stride + c * kPanel, kPanel * sizeof(T));
      else
        std::fill(row, row + kPanel, T(0.f));
    }
    blas::pack(s.seq_pad, kPanel, kPanel, kPanel, dt, dt, tmp.data(),
               vp + c * s.seq_pad * kPanel);
  }
}

// One thread's working set for a query block of `rows` = heads per group x kQueryBlock rows.
template <typename T>
struct Scratch {
  explicit Scratch(int64_t rows, int64_t dim)
      : q(rows * dim), probs(rows * kLd), scores(rows * kLd), acc(rows * dim), row_max(rows),
        row_sum(rows) {}
  std::vector<T> q, probs;  // the block's queries; one chunk's probabilities
  std::vector<float> scores, acc, row_max, row_sum;  // one chunk's scores; the running softmax
};

// The query block at `start` of one (batch, KV group): q points at the group's first head,
// out at that head's slot of position 0.
template <typename T>
void attend_block(const T* q, int64_t q_pos_stride, int64_t q_head_stride, const T* kp,
                  const T* vp, const Shape& s, int64_t start, float scale, T* out,
                  int64_t out_pos_stride, Scratch<T>& w) {
  const int64_t rows = s.group() * kQueryBlock;
  T* qbuf = w.q.data();
  T* probs = w.probs.data();
  float* scores = w.scores.data();
  float* acc = w.acc.data();
  float* row_max = w.row_max.data();
  float* row_sum = w.row_sum.data();
  for (int64_t h = 0; h < s.group(); ++h)
    for (int64_t i = 0; i < kQueryBlock; ++i) {
      T* dst = qbuf + (h * kQueryBlock + i) * s.dim;
      const int64_t pos = start + i;
      if (pos < s.seq)
        std::memcpy(dst, q + h * q_head_stride + pos * q_pos_stride, s.dim * sizeof(T));
      else
        std::fill(dst, dst + s.dim, T(0.f));
    }
  std::fill(acc, acc + rows * s.dim, 0.f);
  std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.f);
  const int64_t end = std::min(start + kQueryBlock, s.seq);
  for (int64_t c = 0; c < end; c += kChunk) {
    const int64_t width = round_up(std::min(kChunk, end - c), kPanel);
    for (int64_t p = 0; p < width / kPanel; ++p)
      blas::brgemm(rows, kPanel, s.dim, s.dim, kPanel, kLd, false, qbuf,
                   kp + (c / kPanel + p) * s.dim * kPanel, scores + p * kPanel);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = start + r % kQueryBlock;
      const int64_t n = std::min(std::min(pos + 1, s.seq) - c, width);
      const float shrink = softmax_step16(scores + r * kLd, n, width, scale, row_max[r],
                                          row_sum[r], probs + r * kLd);
      if (shrink != 1.f) {
        float* a = acc + r * s.dim;
        for (int64_t d = 0; d < s.dim; d += 16)
          _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(shrink)));
      }
    }
    for (int64_t d = 0; d < s.dim / kPanel; ++d)
      blas::brgemm(rows, kPanel, width, kLd, kPanel, s.dim, true, probs,
                   vp + d * s.seq_pad * kPanel + c * kPanel, acc + d * kPanel);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = start + r % kQueryBlock;
    if (pos >= s.seq) continue;
    const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);
    T* o = out + pos * out_pos_stride + (r / kQueryBlock) * s.dim;
    for (int64_t d = 0; d < s.dim; d += 16)
      store16(o + d, _mm512_mul_ps(_mm512_loadu_ps(acc + r * s.dim + d), inv));
  }
}

template <typename T>
void causal_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           float scale, at::Tensor& out, const Shape& s) {
  const T* qd = q.data_ptr<T>();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const int64_t pairs = s.batch * s.kv_heads, panel_elems = s.seq_pad * s.dim;
  // Every element is written by pack(); no zero-fill first.
  const at::Tensor kpack_t = at::empty({2, pairs * panel_elems}, q.options());
  T* kpack = kpack_t.data_ptr<T>();
  T* vpack = kpack + pairs * panel_elems;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / s.kv_heads, g = i % s.kv_heads;
      pack_kv(kd + b * k.stride(0) + g * k.stride(1), vd + b * v.stride(0) + g * v.stride(1),
              k.stride(2), v.stride(2), s, kpack + i * panel_elems,
              vpack + i * panel_elems);
    }
  });
  const int64_t blocks = (s.seq + kQueryBlock - 1) / kQueryBlock;
  const int64_t rows = s.group() * kQueryBlock;
  at::parallel_for(0, pairs * blocks, 1, [&](int64_t begin, int64_t end) {
    Scratch<T> scratch(rows, s.dim);
    for (int64_t i = begin; i < end; ++i) {
      // Later blocks have more keys: hand them out first.
      const int64_t pair = i % pairs, block = blocks - 1 - i / pairs;
      const int64_t b = pair / s.kv_heads, g = pair % s.kv_heads;
      attend_block(qd + b * q.stride(0) + g * s.group() * q.stride(1), q.stride(2), q.stride(1),
                   kpack + pair * panel_elems, vpack + pair * panel_elems, s,
                   block * kQueryBlock, scale, od + b * out.stride(0) + g * s.group() * s.dim,
                   out.stride(1), scratch);
    }
    blas::brgemm_release();
  });
}

}  // namespace brgemm_path
#endif  // __AVX512F__

#if defined(__AVX2__) && defined(__FMA__)
namespace tile_path {

// Where oneDNN cannot pack the dtype (AVX2 only; AVX-512 without AMX): the same query blocks, key
// chunks and online softmax in float32, the products by our panel tile (panel_tile.h). K is
// widened once per (batch, KV head) into panels of 16 keys (kp[p][d][j] = K[16p + j][d]) and V
// into panels of 16 head-dim columns (vp[c][key][j] = V[key][16c + j]). Probabilities stay
// float32 (torch rounds them to the dtype), so results are nearer float32 attention than torch's.
using nxdi_tile::kMR;
using nxdi_tile::kNR;
using nxdi_tile::tile_rows;

// 16 keys at a time: their rows widened 8 values per instruction into `rows`, then K's
// transposed into its panel and V's 16-column pieces copied into theirs (an element at a time
// this took ~3 ms per layer for 1792 keys, as much as a 64-query chunk's products).
template <typename T>
void widen_kv(const T* k, const T* v, int64_t k_pos_stride, int64_t v_pos_stride,
              const Shape& s, float* kp, float* vp) {
  std::vector<float> rows(kNR * s.dim);
  auto widen_rows = [&](const T* src, int64_t stride, int64_t first) {
    for (int64_t j = 0; j < kNR; ++j)
      for (int64_t d = 0; d < s.dim; d += 8)
        _mm256_storeu_ps(rows.data() + j * s.dim + d, first + j < s.keys
                             ? load8(src + (first + j) * stride + d) : _mm256_setzero_ps());
  };
  for (int64_t p = 0; p < s.seq_pad / kNR; ++p) {
    widen_rows(k, k_pos_stride, p * kNR);
    for (int64_t d = 0; d < s.dim; ++d)
      for (int64_t j = 0; j < kNR; ++j) kp[(p * s.dim + d) * kNR + j] = rows[j * s.dim + d];
    widen_rows(v, v_pos_stride, p * kNR);
    for (int64_t j = 0; j < kNR; ++j)
      for (int64_t c = 0; c < s.dim / kNR; ++c)
        std::copy_n(rows.data() + j * s.dim + c * kNR, kNR,
                    vp + (c * s.seq_pad + p * kNR + j) * kNR);
  }
}

// e^x for x <= 0 as exp_nonpositive16 computes it (below -87: e^-87).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147180559945309f), x);
  __m256 p = _mm256_set1_ps(1.f / 120.f);
  for (float c : {1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// softmax_step16 (above) 8 at a time, probabilities in float32; w a multiple of 8.
float softmax_step(const float* scores, int64_t n, int64_t w, float scale, float& row_max,
                   float& row_sum, float* p) {
  const int64_t full = n / 8 * 8;
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < full; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(scores + j));
  float mx = reduce_max8(vmax);
  for (int64_t j = full; j < n; ++j) mx = std::max(mx, scores[j]);
  const float new_max = std::max(row_max, mx * scale);
  const __m256 vscale = _mm256_set1_ps(scale), vneg = _mm256_set1_ps(-new_max);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j < full; j += 8) {
    const __m256 e = exp_nonpositive8(_mm256_fmadd_ps(_mm256_loadu_ps(scores + j), vscale, vneg));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(p + j, e);
  }
  if (j < n) {
    const __m256 keep = _mm256_castsi256_ps(first_lanes8(n - j));
    const __m256 e = _mm256_and_ps(
        keep, exp_nonpositive8(_mm256_fmadd_ps(_mm256_loadu_ps(scores + j), vscale, vneg)));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(p + j, e);
    j += 8;
  }
  for (; j < w; j += 8) _mm256_storeu_ps(p + j, _mm256_setzero_ps());
  const float shrink = row_max == -std::numeric_limits<float>::infinity()
                           ? 0.f : std::exp(row_max - new_max);
  row_max = new_max;
  row_sum = row_sum * shrink + reduce_add8(sum);
  return shrink;
}

// One thread's working set for a query block: its queries in Q (float32, or bf16 for the dot
// products, whose probabilities are bf16 too: probs16, else probs), one chunk's scores and
// probabilities, the running softmax and the accumulators.
template <typename Q>
struct Scratch {
  static constexpr bool kDot = std::is_same_v<Q, c10::BFloat16>;
  Scratch(int64_t rows, int64_t dim)
      : q(rows * dim), probs(kDot ? 0 : rows * kLd), scores(rows * kLd), acc(rows * dim),
        row_max(rows), row_sum(rows), probs16(kDot ? rows * kLd : 0) {}
  std::vector<Q> q;
  std::vector<float> probs, scores, acc, row_max, row_sum;
  std::vector<c10::BFloat16> probs16;
};

// rows [r0, r0 + n) of the block: scores[r][0, width) = q_r . key c + j (all `width` keys from c).
void block_scores(const float* q, const float* kp, const Shape& s, int64_t c, int64_t width,
                  float* scores, int64_t r0, int n) {
  float t[kMR * kNR];
  for (int64_t p = 0; p < width / kNR; ++p) {
    tile_rows(n, q + r0 * s.dim, s.dim, kp + (c / kNR + p) * s.dim * kNR, s.dim, t);
    for (int r = 0; r < n; ++r)
      std::copy(t + r * kNR, t + (r + 1) * kNR, scores + (r0 + r) * kLd + p * kNR);
  }
}

// rows [r0, r0 + n): acc[r] += probs[r][0, width) . V[c, c + width).
void block_values(const float* probs, const float* vp, const Shape& s, int64_t c, int64_t width,
                  float* acc, int64_t r0, int n) {
  float t[kMR * kNR];
  for (int64_t d = 0; d < s.dim / kNR; ++d) {
    tile_rows(n, probs + r0 * kLd, kLd, vp + (d * s.seq_pad + c) * kNR, width, t);
    for (int r = 0; r < n; ++r) {
      float* a = acc + (r0 + r) * s.dim + d * kNR;
      for (int64_t j = 0; j < kNR; ++j) a[j] += t[r * kNR + j];
    }
  }
}

// Keys query `pos` attends to: 0..pos (causal, last == nullptr) or 0..last[pos] (a prompt
// chunk: last holds the queries' positions in the cache); padding rows past s.seq read like the
// last query.
inline int64_t key_limit(const Shape& s, const int64_t* last, int64_t pos) {
  if (last == nullptr) return std::min(pos + 1, s.seq);
  return std::min(last[std::min(pos, s.seq - 1)] + 1, s.keys);
}

// Start the query block at `start`: its queries (zero past s.seq) into the scratch, the running
// softmax and accumulators reset. Returns the keys of its longest row.
template <typename Q, typename T>
int64_t begin_block(const T* q, int64_t q_pos_stride, int64_t q_head_stride, const Shape& s,
                    int64_t start, const int64_t* last, Scratch<Q>& w) {
  for (int64_t h = 0; h < s.group(); ++h)
    for (int64_t i = 0; i < kQueryBlock; ++i) {
      Q* dst = w.q.data() + (h * kQueryBlock + i) * s.dim;
      const int64_t pos = start + i;
      for (int64_t d = 0; d < s.dim; ++d)  // a bf16 query stays exact through float32
        dst[d] = Q(pos < s.seq ? to_float(q[h * q_head_stride + pos * q_pos_stride + d]) : 0.f);
    }
  std::fill(w.acc.begin(), w.acc.end(), 0.f);
  std::fill(w.row_max.begin(), w.row_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(w.row_sum.begin(), w.row_sum.end(), 0.f);
  int64_t end = 0;
  for (int64_t pos = start; pos < std::min(start + kQueryBlock, s.seq); ++pos)
    end = std::max(end, key_limit(s, last, pos));
  return end;
}

// Row r's online-softmax step over the chunk of `width` keys from c: its probabilities into
// w.probs (zero where the row has none of these keys) and its accumulator rescaled.
template <typename Q>
void softmax_row(const Shape& s, const int64_t* last, int64_t start, int64_t r, int64_t c,
                 int64_t width, float scale, Scratch<Q>& w) {
  const int64_t keys = std::min(key_limit(s, last, start + r % kQueryBlock) - c, width);
  float* probs = w.probs.data() + r * kLd;
  if (keys <= 0) {
    std::fill(probs, probs + width, 0.f);
    return;
  }
  const float shrink = softmax_step(w.scores.data() + r * kLd, keys, width, scale, w.row_max[r],
                                    w.row_sum[r], probs);
  if (shrink != 1.f)
    for (int64_t d = 0; d < s.dim; ++d) w.acc[r * s.dim + d] *= shrink;
}

// The block's output rows: accumulator / softmax sum, in T, as [position, head, head_dim].
template <typename Q, typename T>
void end_block(const Shape& s, int64_t start, const Scratch<Q>& w, T* out,
               int64_t out_pos_stride) {
  for (int64_t r = 0; r < s.group() * kQueryBlock; ++r) {
    const int64_t pos = start + r % kQueryBlock;
    if (pos >= s.seq) continue;
    const __m256 inv = _mm256_set1_ps(1.f / w.row_sum[r]);
    T* o = out + pos * out_pos_stride + (r / kQueryBlock) * s.dim;
    for (int64_t d = 0; d < s.dim; d += 8)
      store8(o + d, _mm256_mul_ps(_mm256_loadu_ps(w.acc.data() + r * s.dim + d), inv));
  }
}

template <typename T>
void attend_block(const T* q, int64_t q_pos_stride, int64_t q_head_stride, const float* kp,
                  const float* vp, const Shape& s, int64_t start, const int64_t* last,
                  float scale, T* out, int64_t out_pos_stride, Scratch<float>& w) {
  const int64_t rows = s.group() * kQueryBlock;
  const int64_t end = begin_block(q, q_pos_stride, q_head_stride, s, start, last, w);
  for (int64_t c = 0; c < end; c += kChunk) {
    const int64_t width = round_up(std::min(kChunk, end - c), kNR);
    for (int64_t r0 = 0; r0 < rows; r0 += kMR) {
      const int n = static_cast<int>(std::min<int64_t>(kMR, rows - r0));
      block_scores(w.q.data(), kp, s, c, width, w.scores.data(), r0, n);
      for (int64_t r = r0; r < r0 + n; ++r) softmax_row(s, last, start, r, c, width, scale, w);
      block_values(w.probs.data(), vp, s, c, width, w.acc.data(), r0, n);
    }
  }
  end_block(s, start, w, out, out_pos_stride);
}

// Both variants' driver: K and V of each (batch, KV head) packed once by `pack` into P panels,
// then `attend` over every query block, the longest first. last: nullptr (causal) or the
// queries' [batch, seq] positions (chunk_attention).
template <typename P, typename Q, typename T, typename Pack, typename Attend>
void run_blocks(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
                at::Tensor& out, const Shape& s, const int64_t* last, Pack pack, Attend attend) {
  const T* qd = q.data_ptr<T>();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  T* od = out.data_ptr<T>();
  const int64_t pairs = s.batch * s.kv_heads, panel_elems = s.seq_pad * s.dim;
  std::vector<P> packed(2 * pairs * panel_elems);  // `pack` writes every element
  P* kp = packed.data();
  P* vp = kp + pairs * panel_elems;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / s.kv_heads, g = i % s.kv_heads;
      pack(kd + b * k.stride(0) + g * k.stride(1), vd + b * v.stride(0) + g * v.stride(1),
           k.stride(2), v.stride(2), s, kp + i * panel_elems, vp + i * panel_elems);
    }
  });
  const int64_t blocks = (s.seq + kQueryBlock - 1) / kQueryBlock;
  at::parallel_for(0, pairs * blocks, 1, [&](int64_t begin, int64_t end) {
    Scratch<Q> scratch(s.group() * kQueryBlock, s.dim);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t pair = i % pairs, block = blocks - 1 - i / pairs;  // longest blocks first
      const int64_t b = pair / s.kv_heads, g = pair % s.kv_heads;
      attend(qd + b * q.stride(0) + g * s.group() * q.stride(1), q.stride(2), q.stride(1),
             kp + pair * panel_elems, vp + pair * panel_elems, s, block * kQueryBlock,
             last == nullptr ? nullptr : last + b * s.seq, scale,
             od + b * out.stride(0) + g * s.group() * s.dim, out.stride(1), scratch);
    }
  });
}

template <typename T>
void causal_attention_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           float scale, at::Tensor& out, const Shape& s,
                           const int64_t* last = nullptr) {
  run_blocks<float, float, T>(q, k, v, scale, out, s, last, widen_kv<T>, attend_block<T>);
}

#if defined(__AVX512BF16__)
// bfloat16 inputs where the CPU has AVX512-BF16 dot products (AMD Zen 4): the same blocks,
// chunks and online softmax, the products by vdpbf16ps (two bf16 products summed into a float32
// per lane: twice the float32 path's products per instruction, and 16 lanes, not 8). K is packed
// once per (batch, KV head) into panels of 16 keys with head-dim pairs interleaved
// (kb[p][i][j][e] = K[16p + j][2i + e]), V into panels of 16 head-dim columns with key pairs
// interleaved (vb[c][i][j][e] = V[2i + e][16c + j]); probabilities are rounded to bf16 for the
// P.V product, as torch's flash kernel rounds them to the dtype. Sums stay float32.
// Register tiles of 6 rows x 4 panels (24 sums; each broadcast serves 4 panels), written straight
// to the scores and added straight into the accumulators, a 16-lane softmax that writes bf16
// probabilities directly, and K / V packed 32 bits / one vpermw at a time: one layer of the
// bundled model, 2048 tokens, one Zen 4 core, 35.5-36.1 -> 30.1-30.3 ms (8 rows x 1 panel
// through a float copy, the 8-lane softmax and an element-wise pack before); the products now
// run at ~88% of the core's vdpbf16ps peak (3.65 G/s measured), so this path is compute-bound.
constexpr int kDotRows = 6;    // query rows per register tile
constexpr int kDotPanels = 4;  // panels per register tile: 64 keys, or 64 head-dim columns

// For q < NP panels (panel q at panel + q * stride) and r < MR rows: c[r * ldc + 16q + j] =
// (Accumulate: c[...] +) sum over pairs i of a[r][2i, 2i + 2) . panel_q[i] (32 bf16: 16 lanes
// x 2). Each broadcast pair of a serves NP panels and each panel load MR rows, with MR x NP
// independent sums in flight.
template <int MR, int NP, bool Accumulate>
void dot_rows(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* panel, int64_t stride,
              int64_t pairs, float* c, int64_t ldc) {
  __m512 acc[MR][NP];
#pragma GCC unroll 24
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh w[NP];
#pragma GCC unroll 4
    for (int q = 0; q < NP; ++q)
      w[q] = (__m512bh)_mm512_loadu_si512(panel + q * stride + i * 2 * kNR);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh xp = pair_at(a + r * lda + 2 * i);
#pragma GCC unroll 4
      for (int q = 0; q < NP; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], xp, w[q]);
    }
  }
#pragma GCC unroll 24
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) {
      float* dst = c + r * ldc + q * kNR;
      _mm512_storeu_ps(dst, Accumulate ? _mm512_add_ps(_mm512_loadu_ps(dst), acc[r][q])
                                       : acc[r][q]);
    }
}

// dot_rows for n (1..kDotRows) rows.
template <int NP, bool Accumulate>
void dot_tile(int n, const c10::BFloat16* a, int64_t lda, const c10::BFloat16* panel,
              int64_t stride, int64_t pairs, float* c, int64_t ldc) {
  static_assert(kDotRows == 6);
  switch (n) {
    case 1: return dot_rows<1, NP, Accumulate>(a, lda, panel, stride, pairs, c, ldc);
    case 2: return dot_rows<2, NP, Accumulate>(a, lda, panel, stride, pairs, c, ldc);
    case 3: return dot_rows<3, NP, Accumulate>(a, lda, panel, stride, pairs, c, ldc);
    case 4: return dot_rows<4, NP, Accumulate>(a, lda, panel, stride, pairs, c, ldc);
    case 5: return dot_rows<5, NP, Accumulate>(a, lda, panel, stride, pairs, c, ldc);
    default: return dot_rows<6, NP, Accumulate>(a, lda, panel, stride, pairs, c, ldc);
  }
}

using BF16 = c10::BFloat16;

void pack_kv_pairs(const BF16* k, const BF16* v, int64_t k_pos_stride, int64_t v_pos_stride,
                   const Shape& s, BF16* kb, BF16* vb) {
  const int64_t half = s.dim / 2, key_pairs = s.seq_pad / 2;
  // K: each key's head-dim pairs (32 bits) to lane j of its panel's pair rows.
  auto* kb32 = reinterpret_cast<uint32_t*>(kb);
  for (int64_t key = 0; key < s.seq_pad; ++key) {
    uint32_t* dst = kb32 + (key / kNR) * half * kNR + key % kNR;
    if (key < s.keys) {
      const BF16* src = k + key * k_pos_stride;
      for (int64_t i = 0; i < half; ++i) std::memcpy(dst + i * kNR, src + 2 * i, 4);
    } else {
      for (int64_t i = 0; i < half; ++i) dst[i * kNR] = 0;
    }
  }
  // V: keys 2i and 2i + 1 interleaved, 16 head-dim columns at a time (one vpermw).
  const BF16 zeros[kNR] = {};
  for (int64_t i = 0; i < key_pairs; ++i) {
    const int64_t k0 = 2 * i, k1 = 2 * i + 1;
    for (int64_t c = 0; c < s.dim / kNR; ++c) {
      const BF16* row = k0 < s.keys ? v + k0 * v_pos_stride + c * kNR : zeros;
      const BF16* next = k1 < s.keys ? v + k1 * v_pos_stride + c * kNR : nullptr;
      _mm512_storeu_si512(vb + (c * key_pairs + i) * 2 * kNR, interleave_rows(row, next));
    }
  }
}

// Row r's online-softmax step over the chunk of `width` keys from c, as softmax_row but 16 lanes
// at a time and with the probabilities written to bf16 directly (softmax_step16).
void softmax_row_dot(const Shape& s, const int64_t* last, int64_t start, int64_t r, int64_t c,
                     int64_t width, float scale, Scratch<BF16>& w) {
  const int64_t keys = std::min(key_limit(s, last, start + r % kQueryBlock) - c, width);
  BF16* probs = w.probs16.data() + r * kLd;
  if (keys <= 0) {
    std::fill(probs, probs + width, BF16(0.f));
    return;
  }
  const float shrink = softmax_step16(w.scores.data() + r * kLd, keys, width, scale,
                                      w.row_max[r], w.row_sum[r], probs);
  if (shrink != 1.f) {
    float* a = w.acc.data() + r * s.dim;
    for (int64_t d = 0; d < s.dim; d += 16)
      _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(shrink)));
  }
}

// A query block's rows in tiles of kDotRows: the tile's scores against the chunk's keys, 64 at a
// time (kDotPanels panels of 16), straight into w.scores; each row's softmax step; then the
// tile's probabilities times V, 64 head-dim columns at a time, added into w.acc.
void attend_block_dot(const BF16* q, int64_t q_pos_stride, int64_t q_head_stride, const BF16* kb,
                      const BF16* vb, const Shape& s, int64_t start, const int64_t* last,
                      float scale, BF16* out, int64_t out_pos_stride, Scratch<BF16>& w) {
  const int64_t rows = s.group() * kQueryBlock, half = s.dim / 2;
  const int64_t end = begin_block(q, q_pos_stride, q_head_stride, s, start, last, w);
  const int64_t k_panel = half * 2 * kNR, v_panel = s.seq_pad * kNR;  // values a panel
  for (int64_t c = 0; c < end; c += kChunk) {
    const int64_t width = round_up(std::min(kChunk, end - c), kNR);
    for (int64_t r0 = 0; r0 < rows; r0 += kDotRows) {
      const int n = static_cast<int>(std::min<int64_t>(kDotRows, rows - r0));
      const BF16* qr = w.q.data() + r0 * s.dim;
      float* scores = w.scores.data() + r0 * kLd;
      int64_t p = 0;
      for (; p + kDotPanels <= width / kNR; p += kDotPanels)
        dot_tile<kDotPanels, false>(n, qr, s.dim, kb + (c / kNR + p) * k_panel, k_panel, half,
                                    scores + p * kNR, kLd);
      for (; p < width / kNR; ++p)
        dot_tile<1, false>(n, qr, s.dim, kb + (c / kNR + p) * k_panel, k_panel, half,
                           scores + p * kNR, kLd);
      for (int64_t r = r0; r < r0 + n; ++r) softmax_row_dot(s, last, start, r, c, width, scale, w);
      for (int64_t d = 0; d < s.dim / kNR; d += kDotPanels)
        dot_tile<kDotPanels, true>(n, w.probs16.data() + r0 * kLd, kLd,
                                   vb + d * v_panel + c * kNR, v_panel, width / 2,
                                   w.acc.data() + r0 * s.dim + d * kNR, s.dim);
    }
  }
  end_block(s, start, w, out, out_pos_stride);
}

// causal_attention_impl on bf16 dot products (last as there).
void attention_dot(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
                   at::Tensor& out, const Shape& s, const int64_t* last = nullptr) {
  run_blocks<BF16, BF16, BF16>(q, k, v, scale, out, s, last, pack_kv_pairs, attend_block_dot);
}
#endif  // __AVX512BF16__

}  // namespace tile_path
#endif  // __AVX2__ && __FMA__

#if defined(__AVX2__) && defined(__FMA__)
// The tile path: bf16 on the dot products where the CPU has them, else in float32.
void run_tile(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
              at::Tensor& out, const Shape& s, const int64_t* last) {
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16) return tile_path::attention_dot(q, k, v, scale, out, s, last);
#endif
  if (q.scalar_type() == at::kBFloat16)
    tile_path::causal_attention_impl<c10::BFloat16>(q, k, v, scale, out, s, last);
  else
    tile_path::causal_attention_impl<c10::Half>(q, k, v, scale, out, s, last);
}
#endif

// The brgemm path where it was chosen, else the tile path (the caller checked one is built).
template <typename T>
void run(bool brgemm, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
         at::Tensor& out, const Shape& s) {
#if defined(__AVX512F__)
  if (brgemm) return brgemm_path::causal_attention_impl<T>(q, k, v, scale, out, s);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  run_tile(q, k, v, scale, out, s, nullptr);
#endif
}

// q [B, H, S, D], k and v [B, Hkv, S, D] (any strides with the last dimension contiguous):
// causal attention of every position over positions 0..itself, query head h reading KV head
// h / (H / Hkv). Returns [B, S, H, D], contiguous.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "causal_attention: q, k, v must be [batch, heads, seq, head_dim]");
  const Shape s{q.size(0), q.size(1), k.size(1), q.size(2), round_up(q.size(2), kPanel),
                q.size(3), q.size(2)};
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == s.batch && k.size(2) == s.seq &&
                  k.size(3) == s.dim && s.kv_heads > 0 && s.heads % s.kv_heads == 0,
              "causal_attention: k and v must be [batch, kv_heads, seq, head_dim] with kv_heads "
              "dividing the query heads; got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "causal_attention: q, k, v must share one dtype");
  const at::ScalarType dtype = q.scalar_type();
  const bool shape_ok = (dtype == at::kBFloat16 || dtype == at::kHalf) && s.dim % kPanel == 0 &&
                        q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && scale > 0;
  const bool brgemm = shape_ok && kBrgemmBuilt && blas::could_pack(dtype);
  if (!brgemm && !(shape_ok && kTileBuilt)) {
    return at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, scale, true)
        .transpose(1, 2).contiguous();
  }
  at::Tensor out = at::empty({s.batch, s.seq, s.heads, s.dim}, q.options());
  if (dtype == at::kBFloat16)
    run<c10::BFloat16>(brgemm, q, k, v, static_cast<float>(scale), out, s);
  else
    run<c10::Half>(brgemm, q, k, v, static_cast<float>(scale), out, s);
  return out;
}

// A chunk of a prompt over the cache: q [B, H, S, D] at positions [B, S] (int64), k and v
// [B, Hkv, T, D] (the sequence's cache gathered, positions 0..T-1; last dimension contiguous);
// query s of row b attends to keys 0..positions[b, s]. Returns [B, S, H, D], contiguous. The
// float32 tile path where it applies (as causal_attention's, reading only up to the chunk's
// last position), else torch's SDPA under the equivalent mask.
at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& positions, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "chunk_attention: q, k, v must be [batch, heads, positions, head_dim]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) &&
                  k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "chunk_attention: k and v must be [batch, kv_heads, cache_len, head_dim] with "
              "kv_heads dividing the query heads; got q ", q.sizes(), ", k ", k.sizes(), ", v ",
              v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "chunk_attention: q, k, v must share one dtype");
  TORCH_CHECK(positions.dim() == 2 && positions.size(0) == q.size(0) &&
                  positions.size(1) == q.size(2),
              "chunk_attention: positions must be [batch, queries] = [", q.size(0), ", ",
              q.size(2), "], got ", positions.sizes());
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const int64_t cache_len = k.size(2);
  if (pos.numel() == 0) return at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());
  const int64_t lo = pos.min().item<int64_t>(), hi = pos.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < cache_len, "chunk_attention: positions must lie in 0..",
              cache_len - 1, " (the cache length), got ", lo, "..", hi);
  const Shape s{q.size(0), q.size(1), k.size(1), q.size(2), round_up(hi + 1, kPanel), q.size(3),
                hi + 1};
  const at::ScalarType dtype = q.scalar_type();
  const bool tile = kTileBuilt && (dtype == at::kBFloat16 || dtype == at::kHalf) &&
                    s.dim % kPanel == 0 && q.stride(3) == 1 && k.stride(3) == 1 &&
                    v.stride(3) == 1 && scale > 0;
  if (!tile) {
    const at::Tensor allowed = at::arange(cache_len, pos.options()).view({1, 1, 1, cache_len})
                                   .le(pos.view({s.batch, 1, s.seq, 1}));
    return at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, scale, true)
        .transpose(1, 2).contiguous();
  }
  at::Tensor out = at::empty({s.batch, s.seq, s.heads, s.dim}, q.options());
#if defined(__AVX2__) && defined(__FMA__)
  run_tile(q, k, v, static_cast<float>(scale), out, s, pos.const_data_ptr<int64_t>());
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("chunk_attention(Tensor q, Tensor k, Tensor v, Tensor positions, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdi, CPU, m) {
  m.impl("causal_attention", &causal_attention);
  m.impl("chunk_attention", &chunk_attention);
}
