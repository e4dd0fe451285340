// Shared by our CPU kernels: conversions between the cache/activation dtypes and float32, one
// float at a time, 16 at a time (AVX-512) and 8 at a time (AVX2), and a vector e^x. The vector
// conversions round exactly as c10's scalar ones do (round to nearest even; bf16 NaN is 0x7FC0),
// so a kernel's vector body and its scalar tail agree, and both agree with torch's own casts.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <limits>

namespace nxdi_simd {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
template <typename T> inline T from_float(float x) { return static_cast<T>(x); }

// prefetcht1 (into L2) as an asm statement, which the compiler keeps. GCC 12 -O3 deleted the
// paged attention kernel's loops of __builtin_prefetch outright after unrelated edits around
// them (a runtime condition in the lambda that held them was enough; no prefetch instruction
// left in the object), and the kernel took 1.5x the time from memory (BENCHMARKS.md, session
// 48). tests/test_paged_attention.py checks the built library for the kernels' prefetches.
inline void prefetch_l2(const void* p) {
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
}
// prefetcht0 (into L1), kept the same way.
inline void prefetch_l1(const void* p) {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m512i wide =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// float8_e4m3fn (sign, 4 exponent bits biased by 7, 3 mantissa bits): its 7 magnitude bits moved
// to the top of an fp32's exponent and mantissa read as that value times 2^-120, normals and
// subnormals alike (the fp32 is then subnormal or small, multiplied exactly); then the sign, and
// NaN for the magnitude 0x7F (e4m3fn has no infinities).
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(v, _mm512_set1_epi32(0x7F));
  __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)),
                           _mm512_set1_ps(0x1p120f));
  f = _mm512_castsi512_ps(_mm512_or_si512(
      _mm512_castps_si512(f), _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24)));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
  return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// e^x: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^7 (relative error < 1e-8),
// times 2^n with scalef. Below -87 the result is e^-87 (a normal float; callers add or scale it
// away); past ln(FLT_MAX) it overflows to infinity, as std::exp does.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, high bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);  // ln2, low bits
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
// float32 -> bfloat16 bits (in the low 16 bits of each lane), rounded to nearest even, NaN 0x7FC0.
inline __m512i bf16_bits16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}
inline void store16(c10::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits16(x)));
}
inline void store16(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// x rounded to T and back: what a torch op whose result is a T tensor hands the next op.
template <typename T> inline __m512 round16(__m512 x);
template <> inline __m512 round16<float>(__m512 x) { return x; }
template <> inline __m512 round16<c10::BFloat16>(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(x), 16));
}
template <> inline __m512 round16<c10::Half>(__m512 x) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

#if defined(__AVX512BF16__)
// The bf16 pair (x[0], x[1]) in every 32-bit lane, straight from memory: one side of vdpbf16ps,
// whose lanes add x[0] w[2l] + x[1] w[2l + 1].
inline __m512bh pair_at(const c10::BFloat16* x) {
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// Two rows of 16 bf16 (row[j], next[j]) interleaved into 16 pairs: (row[0], next[0], row[1],
// next[1], ...), the order vdpbf16ps takes a weight pair in; next null reads as zeros.
inline __m512i interleave_rows(const c10::BFloat16* row, const c10::BFloat16* next) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24,
                                       8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  const __m256i b = next != nullptr ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(next))
                                    : _mm256_setzero_si256();
  return _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
}
#endif

// The same, 8 at a time, for CPUs with AVX2 and FMA but not AVX-512 (kernels use these only where
// __AVX512F__ is not defined, so AVX-512 machines keep their 16-wide code).
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// float8_e4m3fn as load16 reads it (above).
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
  __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)),
                           _mm256_set1_ps(0x1p120f));
  f = _mm256_castsi256_ps(_mm256_or_si256(
      _mm256_castps_si256(f), _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24)));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F)));
  return _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
}

// e^x as exp16 computes it; 2^n is applied as two exact power-of-two factors (no scalef), so
// the result overflows to infinity past ln(FLT_MAX) as std::exp does.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(89.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  for (float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i ni = _mm256_cvtps_epi32(n);  // -126..129
  const __m256i half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
  auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(rest));
}

inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
// float32 -> bfloat16 bits (low 16 bits of each lane), rounded to nearest even, NaN 0x7FC0.
inline __m256i bf16_bits8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline void store8(c10::BFloat16* p, __m256 x) {
  const __m256i b = bf16_bits8(x);  // 8 x 32-bit lanes -> 8 x 16-bit
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(c10::Half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T> inline __m256 round8(__m256 x);
template <> inline __m256 round8<float>(__m256 x) { return x; }
template <> inline __m256 round8<c10::BFloat16>(__m256 x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16));
}
template <> inline __m256 round8<c10::Half>(__m256 x) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline float reduce_add8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// Lanes 0..n-1 set (n <= 8), for maskload/maskstore.
inline __m256i first_lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

}  // namespace nxdi_simd
