// The register tile of our panel products: x (float32 rows) times a panel of 16 columns stored
// k-major ([K, 16], float32 / bfloat16 / float16 / int8), up to 6 rows at a time, sums in float32.
// kernels/panel_linear.cpp multiplies linear weights with it, and causal_attention.cpp its
// scores and values on CPUs without AVX-512.
#pragma once

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace nxdi_tile {

using nxdi_simd::to_float;
inline float to_float(int8_t x) { return x; }

constexpr int64_t kNR = 16;  // columns per panel
constexpr int kMR = 6;       // rows per register tile

// Whether tile() widens a panel's even and odd columns apart (widen16, below).
template <typename W>
constexpr bool kEvenOdd =
#if defined(__AVX2__) && defined(__FMA__)
    std::is_same_v<W, c10::BFloat16>;
#else
    false;
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The k-th row of a panel (16 weights) as two float32 vectors: columns 0-7 and 8-15, or for
// bfloat16 (kEvenOdd) the even columns and the odd ones: a bf16 is the top half of a float32,
// so each 32-bit lane (columns 2i, 2i + 1) gives the even one by a shift and the odd one by an
// and, where widening in column order takes three shuffles and two shifts (vpmovzxwd twice and
// an extract, on the ports the shifts also use). tile() puts the sums back in column order.
inline void widen16(const c10::BFloat16* w, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void widen16(const c10::Half* w, __m256& lo, __m256& hi) {
  lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8)));
}
inline void widen16(const int8_t* w, __m256& lo, __m256& hi) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}
inline void widen16(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}

// c[r * 16 + j] = sum over k of x[r * ldx + k] * panel[k * 16 + j], for r < MR. The row loops
// are unrolled by pragma: left to itself GCC kept the twelve sums in registers but also stored
// them to the stack on every k, which held the kernel to a third of its speed. Step k prefetches
// line k of `ahead` into L2 while k < ahead_lines: bytes the caller reads after these (the rest
// of its stream of panels), so that reading them from memory overlaps this tile's arithmetic.
// With `stream` > 0 the tile also prefetches (into L1) the panel's bytes `stream` ahead of those
// it reads, one line per 64 bytes: where the caller reads the panel from memory in place.
// The weights go through registers (the empty asm): with two to four rows GCC folded their
// loads into the FMAs instead, one load per FMA, and AMD Zen 3 ran those tiles at half the
// FMAs per cycle (it issues about 1.5 vector loads a cycle here).
// One or two rows keep two sets of sums, even and odd k, added at the end: one set is 2 or 4
// chains of FMAs, which wait on each other's 4-cycle latency (Zen 3: 3.7-3.8 cycles a k step
// for 2 or 4 FMAs). In one process alternating with one set: a product of 1 x 576 by 576 x 960
// in cache, one thread, 0.77x the time (1 x 1536 by 1536 x 576 0.71x; 2 rows 0.74-0.88x); the
// 121 products of a decode step from memory, two threads, 0.96x (1 and 2 rows); a decode step
// of the bundled model, 1 row, 0.93x. From three rows the 12 sums and their operands no longer
// fit the 16 ymm registers (3 rows 0.99-1.07x slower).
template <int MR, typename W>
void tile(const float* x, int64_t ldx, const W* panel, int64_t K, float* c,
          const char* ahead = nullptr, int64_t ahead_lines = 0, int64_t stream = 0) {
  constexpr int S = MR <= 2 ? 2 : 1;  // sets of sums: k steps an iteration
  constexpr int64_t kStepBytes = kNR * static_cast<int64_t>(sizeof(W));
  constexpr int64_t kIterBytes = S * kStepBytes;
  // stream prefetch: lines an iteration, or iterations a line (one of the two is 1)
  constexpr int kLines = kIterBytes >= 64 ? static_cast<int>(kIterBytes / 64) : 1;
  constexpr int64_t kEvery = kIterBytes >= 64 ? 1 : 64 / kIterBytes;
  const char* streamed = reinterpret_cast<const char*>(panel) + stream;
  __m256 acc[S][MR][2];
#pragma GCC unroll 8
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) acc[s][r][0] = acc[s][r][1] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + S <= K; k += S) {
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s)
      if (k + s < ahead_lines) nxdi_simd::prefetch_l2(ahead + 64 * (k + s));
    if (stream > 0 && (k / S) % kEvery == 0) {
#pragma GCC unroll 4
      for (int l = 0; l < kLines; ++l) nxdi_simd::prefetch_l1(streamed + k * kStepBytes + 64 * l);
    }
    __m256 lo[S], hi[S];
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s) {
      widen16(panel + (k + s) * kNR, lo[s], hi[s]);
      asm("" : "+x"(lo[s]), "+x"(hi[s]));
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s) {
        const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k + s);
        acc[s][r][0] = _mm256_fmadd_ps(xb, lo[s], acc[s][r][0]);
        acc[s][r][1] = _mm256_fmadd_ps(xb, hi[s], acc[s][r][1]);
      }
  }
  if (k < K) {  // S == 2 and K odd: the last step on the first set
    if (k < ahead_lines) nxdi_simd::prefetch_l2(ahead + 64 * k);
    __m256 lo, hi;
    widen16(panel + k * kNR, lo, hi);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[0][r][0] = _mm256_fmadd_ps(xb, lo, acc[0][r][0]);
      acc[0][r][1] = _mm256_fmadd_ps(xb, hi, acc[0][r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    __m256 lo = acc[0][r][0], hi = acc[0][r][1];
    if constexpr (S == 2) lo = _mm256_add_ps(lo, acc[1][r][0]), hi = _mm256_add_ps(hi, acc[1][r][1]);
    if constexpr (kEvenOdd<W>) {  // even and odd columns back in order
      const __m256 a = _mm256_unpacklo_ps(lo, hi), b = _mm256_unpackhi_ps(lo, hi);
      lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
    }
    _mm256_storeu_ps(c + r * kNR, lo);
    _mm256_storeu_ps(c + r * kNR + 8, hi);
  }
}
#else
template <int MR, typename W>
void tile(const float* x, int64_t ldx, const W* panel, int64_t K, float* c,
          const char* = nullptr, int64_t = 0, int64_t = 0) {
  std::fill(c, c + MR * kNR, 0.f);
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MR; ++r) {
      const float xv = x[r * ldx + k];
      for (int64_t j = 0; j < kNR; ++j) c[r * kNR + j] += xv * to_float(panel[k * kNR + j]);
    }
}
#endif

template <typename W>
void tile_rows(int rows, const float* x, int64_t ldx, const W* panel, int64_t K, float* c,
               const char* ahead = nullptr, int64_t ahead_lines = 0, int64_t stream = 0) {
  switch (rows) {
    case 1: return tile<1>(x, ldx, panel, K, c, ahead, ahead_lines, stream);
    case 2: return tile<2>(x, ldx, panel, K, c, ahead, ahead_lines, stream);
    case 3: return tile<3>(x, ldx, panel, K, c, ahead, ahead_lines, stream);
    case 4: return tile<4>(x, ldx, panel, K, c, ahead, ahead_lines, stream);
    case 5: return tile<5>(x, ldx, panel, K, c, ahead, ahead_lines, stream);
    default: return tile<kMR>(x, ldx, panel, K, c, ahead, ahead_lines, stream);
  }
}

}  // namespace nxdi_tile
