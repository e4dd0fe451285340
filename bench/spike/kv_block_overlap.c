// A C model of the AVX2 paged decode attention's K pass (nxdi_common/kernels/paged_attention.cpp,
// Avx2Ops), to try memory/compute overlap schemes without rebuilding the kernel. Per 6 KB block
// (16 positions x 3 KV heads x 64 bf16) and KV head: the head's 16 rows widened into a float32
// tile, three queries' scores against it (eight rows at a time, a hadd tree), and the next
// block's rows of that head prefetched (prefetcht1) as the kernel does. Blocks are visited in a
// random order over 256 MB on huge pages (memory), or over 64 blocks that stay in L2 (warm).
// One thread; prints GB/s of blocks read.
//
//   gcc -O2 -mavx2 -mfma bench/spike/kv_block_overlap.c -o /tmp/kv_block_overlap
//   taskset -c 1 /tmp/kv_block_overlap warm|memory none|burst|spread
//
// Session 52 (AMD Zen 3, a few runs): warm 6.9-7.4 GB/s; memory 2.5-3.8 without prefetch,
// 4.4-4.8 with the burst, 5.0-5.7 spread over the tile's work. The times nearly add up (1/4.6 ~
// 1/7.2 + 1/12.9, the last a plain read of random 6 KB blocks with the next one prefetched), as
// they do in the kernel (BENCHMARKS.md, nxdi_common "Session 52").
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { kBlock = 6144, kRowBytes = 384, kHeadBytes = 128, kRows = 16, kDim = 64, kQueries = 3 };

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Line `line` (0..31) of head hk's 16 rows in block `b`.
static void prefetch_line(const char* b, int hk, int line) {
  _mm_prefetch(b + (line / 2) * kRowBytes + hk * kHeadBytes + (line % 2) * 64, _MM_HINT_T1);
}

int main(int argc, char** argv) {
  const int warm = argc > 1 && strcmp(argv[1], "warm") == 0;
  const char* scheme = argc > 2 ? argv[2] : "burst";
  const int burst = strcmp(scheme, "burst") == 0, spread = strcmp(scheme, "spread") == 0;
  const size_t blocks = (256u << 20) / kBlock;
  char* buf = aligned_alloc(2 << 20, blocks * kBlock);
  madvise(buf, blocks * kBlock, MADV_HUGEPAGE);
  memset(buf, 0x3f, blocks * kBlock);
  int* order = malloc(blocks * sizeof(int));
  srand(1);
  for (size_t i = 0; i < blocks; i++) order[i] = warm ? (int)(i % 64) : (int)i;
  for (size_t i = blocks - 1; !warm && i > 0; i--) {
    const size_t j = (size_t)rand() % (i + 1);
    const int t = order[i];
    order[i] = order[j], order[j] = t;
  }
  static float tile[kRows * kDim] __attribute__((aligned(64)));
  float scores[kQueries * kRows];
  __m256 q[kQueries][8];
  for (int h = 0; h < kQueries; h++)
    for (int j = 0; j < 8; j++) q[h][j] = _mm256_set1_ps(0.01f * (h + j));
  double best = 1e9;
  __m256 sink = _mm256_setzero_ps();
  for (int rep = 0; rep < 3; rep++) {
    const double t0 = now();
    for (size_t i = 0; i < blocks; i++) {
      const char* b = buf + (size_t)order[i] * kBlock;
      const char* next = i + 1 < blocks ? buf + (size_t)order[i + 1] * kBlock : NULL;
      for (int hk = 0; hk < 3; hk++) {
        int line = 0;  // the next block's lines of this head prefetched so far
        if (next != NULL && burst)
          for (; line < 2 * kRows; line++) prefetch_line(next, hk, line);
        for (int r = 0; r < kRows; r++) {
          if (next != NULL && spread && line < 2 * kRows) prefetch_line(next, hk, line++);
          const unsigned short* row = (const unsigned short*)(b + r * kRowBytes + hk * kHeadBytes);
          for (int z = 0; z < 4; z++) {  // 16 bf16: even values by a shift, odd by a mask
            const __m256i x = _mm256_loadu_si256((const __m256i*)(row + 16 * z));
            _mm256_store_ps(tile + r * kDim + 16 * z, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
            _mm256_store_ps(tile + r * kDim + 16 * z + 8, _mm256_castsi256_ps(_mm256_and_si256(
                x, _mm256_set1_epi32((int)0xFFFF0000u))));
          }
        }
        for (int h = 0; h < kQueries; h++)
          for (int o = 0; o < kRows; o += 8) {
            for (int u = 0; next != NULL && spread && u < 3 && line < 2 * kRows; u++)
              prefetch_line(next, hk, line++);
            __m256 a[8];
            for (int k = 0; k < 8; k++) a[k] = _mm256_mul_ps(q[h][0], _mm256_load_ps(tile + (o + k) * kDim));
            for (int j = 1; j < 8; j++)
              for (int k = 0; k < 8; k++)
                a[k] = _mm256_fmadd_ps(q[h][j], _mm256_load_ps(tile + (o + k) * kDim + 8 * j), a[k]);
            const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            _mm256_storeu_ps(scores + h * kRows + o, _mm256_add_ps(
                _mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31)));
          }
        sink = _mm256_add_ps(sink, _mm256_loadu_ps(scores));
      }
    }
    const double dt = now() - t0;
    if (dt < best) best = dt;
  }
  volatile float keep = _mm256_cvtss_f32(sink);
  (void)keep;
  printf("%s, prefetch %s: %.1f GB/s\n", warm ? "warm" : "memory", scheme,
         blocks * (double)kBlock / best / 1e9);
  return 0;
}
