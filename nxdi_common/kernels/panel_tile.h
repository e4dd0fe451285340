// The register tile of our panel products: x (float32 rows) times a panel of 16 columns stored
// k-major ([K, 16], float32 / bfloat16 / float16 / int8), up to 6 rows at a time, sums in float32.
// kernels/panel_linear.cpp multiplies linear weights with it, and causal_attention.cpp its
// scores and values on CPUs without AVX-512.
#pragma once

#include "simd.h"

#include <algorithm>
#include <cstdint>

namespace nxdi_tile {

using nxdi_simd::to_float;
inline float to_float(int8_t x) { return x; }

constexpr int64_t kNR = 16;  // columns per panel
constexpr int kMR = 6;       // rows per register tile

#if defined(__AVX2__) && defined(__FMA__)
// The k-th row of a panel (16 weights) as two float32 vectors.
inline void widen16(const c10::BFloat16* w, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
  hi = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
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
// them to the stack on every k, which held the kernel to a third of its speed.
template <int MR, typename W>
void tile(const float* x, int64_t ldx, const W* panel, int64_t K, float* c) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 lo, hi;
    widen16(panel + k * kNR, lo, hi);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
      acc[r][0] = _mm256_fmadd_ps(xb, lo, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, hi, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(c + r * kNR, acc[r][0]);
    _mm256_storeu_ps(c + r * kNR + 8, acc[r][1]);
  }
}
#else
template <int MR, typename W>
void tile(const float* x, int64_t ldx, const W* panel, int64_t K, float* c) {
  std::fill(c, c + MR * kNR, 0.f);
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < MR; ++r) {
      const float xv = x[r * ldx + k];
      for (int64_t j = 0; j < kNR; ++j) c[r * kNR + j] += xv * to_float(panel[k * kNR + j]);
    }
}
#endif

template <typename W>
void tile_rows(int rows, const float* x, int64_t ldx, const W* panel, int64_t K, float* c) {
  switch (rows) {
    case 1: return tile<1>(x, ldx, panel, K, c);
    case 2: return tile<2>(x, ldx, panel, K, c);
    case 3: return tile<3>(x, ldx, panel, K, c);
    case 4: return tile<4>(x, ldx, panel, K, c);
    case 5: return tile<5>(x, ldx, panel, K, c);
    default: return tile<kMR>(x, ldx, panel, K, c);
  }
}

}  // namespace nxdi_tile
