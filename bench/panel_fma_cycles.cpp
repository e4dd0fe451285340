// The float32 FMA tiles of panel_linear.cpp's bf16 products on Intel (dot_tile with Fma: a k pair
// of a [pairs][32] bf16 panel widened by a shift and an and, each row's x pair broadcast from a
// [pairs][rows][2] float32 buffer), copied here without torch, one core:
//
//   tiles K         each tile shape (rows x panels, FMA chains) on one panel of K inputs, in L1
//   walk K P [kb]   16 rows x 1 panel over P panels one after another (4 at a time, 4 KB
//                   prefetch as the kernel does), or with kb > 0 in blocks of kb k pairs (x stays
//                   in L1; each tile's sums reloaded between blocks)
//
// GFLOPS are measured; "% of 2 FMA/cycle" assumes a 2.66 GHz clock (this VM's Xeon ran a
// chain-free vfmadd231ps loop at 170 GFLOPS a core). On that VM two runs an hour apart differed
// by up to 1.5x (BENCHMARKS.md, session 50): compare lines of one run only, and confirm a finding
// in the real kernel with the variants alternating in one process. Build and run from the
// repository root:
//
//   g++ -O3 -march=native -std=c++20 bench/panel_fma_cycles.cpp -o /tmp/panel_fma_cycles
//   taskset -c 0 /tmp/panel_fma_cycles tiles 576
//   taskset -c 0 /tmp/panel_fma_cycles walk 576 60 && taskset -c 0 /tmp/panel_fma_cycles walk 576 60 96
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr double kGhz = 2.66;

// c[q][r] (16 floats) = sum over pairs [i0, i1) of the rows' x pairs times panel q's widened pair,
// added to c where `load`.
template <int MR, int NP, int CH>
__attribute__((noinline)) void tile(const float* xf, int64_t xs, const uint16_t* const* w,
                                    int64_t i0, int64_t i1, float* c, bool load, bool prefetch) {
  __m512 acc[CH][MR][NP];
  for (int h = 0; h < CH; ++h)
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < NP; ++q)
        acc[h][r][q] = h == 0 && load ? _mm512_loadu_ps(c + (q * MR + r) * 16) : _mm512_setzero_ps();
  for (int64_t i = i0; i + CH <= i1; i += CH) {
#pragma GCC unroll 4
    for (int h = 0; h < CH; ++h) {
      __m512 we[NP], wo[NP];
      for (int q = 0; q < NP; ++q) {
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w[q] + (i + h) * 32) + 4096, _MM_HINT_T1);
        const __m512i v = _mm512_loadu_si512(w[q] + (i + h) * 32);
        we[q] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        wo[q] = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
      }
      const float* xk = xf + 2 * (i + h) * xs;
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512 xe = _mm512_set1_ps(xk[2 * r]), xo = _mm512_set1_ps(xk[2 * r + 1]);
        for (int q = 0; q < NP; ++q)
          acc[h][r][q] = _mm512_fmadd_ps(xe, we[q], _mm512_fmadd_ps(xo, wo[q], acc[h][r][q]));
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) {
      __m512 s = acc[0][r][q];
      for (int h = 1; h < CH; ++h) s = _mm512_add_ps(s, acc[h][r][q]);
      _mm512_storeu_ps(c + (q * MR + r) * 16, s);
    }
}

template <int MR, int NP, int CH>
void tiles(int K) {
  const int64_t npairs = K / 2;
  std::vector<uint16_t> w0(npairs * 32, 0x3f00), w1(npairs * 32, 0x3f00);
  const uint16_t* w[2] = {w0.data(), w1.data()};
  std::vector<float> x(2 * npairs * 16, 0.25f), c(16 * 16 * 2);
  double best = 1e9;
  for (int round = 0; round < 30; ++round) {
    const double t = now();
    for (int i = 0; i < 1000; ++i) tile<MR, NP, CH>(x.data(), 16, w, 0, npairs, c.data(), false, false);
    best = std::min(best, (now() - t) / 1000);
  }
  const double gflops = 4.0 * MR * NP * 16 * npairs / best / 1e9;
  std::printf("%2d rows x %d panels, %d chains, K=%d: %.0f GFLOPS (%.0f%% of 2 FMA/cycle)\n", MR,
              NP, CH, K, gflops, 100.0 * gflops / (kGhz * 64));
}

void walk(int K, int P, int kb) {
  constexpr int kGroup = 4;
  const int64_t npairs = K / 2;
  P = std::max(kGroup, P / kGroup * kGroup);
  std::vector<uint16_t> w(P * npairs * 32);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint16_t>(0x3f00 + i % 7);
  std::vector<float> x(2 * npairs * 16, 0.25f), c(16 * 16 * kGroup);
  double best = 1e9;
  const int reps = std::max(1, 2000 / P);
  for (int round = 0; round < 15; ++round) {
    const double t = now();
    for (int rep = 0; rep < reps; ++rep)
      for (int p0 = 0; p0 < P; p0 += kGroup)
        for (int64_t i0 = 0; i0 < npairs; i0 += kb > 0 ? kb : npairs)
          for (int p = p0; p < p0 + kGroup; ++p) {
            const uint16_t* panel[1] = {w.data() + p * npairs * 32};
            tile<16, 1, 1>(x.data(), 16, panel, i0, std::min<int64_t>(npairs, i0 + (kb > 0 ? kb : npairs)),
                           c.data() + (p - p0) * 256, i0 > 0, true);
          }
    best = std::min(best, (now() - t) / reps);
  }
  std::printf("K=%d, %d panels (%.1f MB), k blocks of %d pairs: %.0f GFLOPS\n", K, P,
              P * npairs * 64 / 1e6, kb > 0 ? kb : static_cast<int>(npairs),
              4.0 * 16 * 16 * npairs * P / best / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::strcmp(argv[1], "tiles") == 0) {
    const int K = std::atoi(argv[2]);
    tiles<16, 1, 1>(K), tiles<16, 1, 2>(K), tiles<8, 2, 1>(K), tiles<12, 2, 1>(K);
    tiles<8, 1, 1>(K), tiles<4, 2, 1>(K), tiles<8, 2, 2>(K);
    return 0;
  }
  if (argc >= 4 && std::strcmp(argv[1], "walk") == 0) {
    walk(std::atoi(argv[2]), std::atoi(argv[3]), argc > 4 ? std::atoi(argv[4]) : 0);
    return 0;
  }
  std::fprintf(stderr, "usage: %s tiles K | walk K PANELS [K_BLOCK_PAIRS]\n", argv[0]);
  return 2;
}
