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
// The weights go through registers (the empty asm): with two to four rows GCC folded their
// loads into the FMAs instead, one load per FMA, and AMD Zen 3 ran those tiles at half the
// FMAs per cycle (it issues about 1.5 vector loads a cycle here).
template <int MR, typename W>
void tile(const float* x, int64_t ldx, const W* panel, int64_t K, float* c,
          const char* ahead = nullptr, int64_t ahead_lines = 0) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (k < ahead_lines) nxdi_simd::prefetch_l2(ahead + 64 * k);
    __m256 lo, hi;
    widen16(panel + k * kNR, lo, hi);
    asm("" : "+x"(lo), "+x"(hi));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, lo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, hi, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    __m256 lo = acc[r][0], hi = acc[r][1];
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
          const char* = nullptr, int64_t = 0) {
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
               const char* ahead = nullptr, int64_t ahead_lines = 0) {
  switch (rows) {
    case 1: return tile<1>(x, ldx, panel, K, c, ahead, ahead_lines);
    case 2: return tile<2>(x, ldx, panel, K, c, ahead, ahead_lines);
    case 3: return tile<3>(x, ldx, panel, K, c, ahead, ahead_lines);
    case 4: return tile<4>(x, ldx, panel, K, c, ahead, ahead_lines);
    case 5: return tile<5>(x, ldx, panel, K, c, ahead, ahead_lines);
    default: return tile<kMR>(x, ldx, panel, K, c, ahead, ahead_lines);
  }
}

}  // namespace nxdi_tile
