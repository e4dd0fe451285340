// The floor under a decode step's paged attention: the same bytes read in the same order with no
// arithmetic. 30 layers of the bundled model's block KV cache (3 KV heads x 64 bf16 a token,
// 16-token blocks, each row's 36 blocks of 576 positions contiguous, as a fresh block manager
// hands them out), K then V of each row, the rows shared between the threads; a 512 MB stream
// read before each step, as a decode step's weight products leave the caches. Compare its time
// with bench/bench_paged_op.py's for the same rows (that script's tables are random, this one's
// contiguous; bench/bench_tkg_step.py's are contiguous).
//
//   order 0: the kernel's order (each block: per KV head, its 16 rows of 128 bytes)
//   order 1: the same with the next block prefetched into L2 at each block's start
//   order 2: each block's lines front to back
//
// Build and run from the repository root:
//
//   g++ -O2 -march=native -fopenmp bench/kv_read_floor.cpp -o /tmp/kv_read_floor
//   /tmp/kv_read_floor 16 0 2      # rows, order, threads
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s ROWS ORDER(0-2) THREADS\n", argv[0]);
    return 2;
  }
  const int rows = std::atoi(argv[1]), order = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  constexpr int kLayers = 30, kPositions = 576, kBlock = 16, kBlocks = kPositions / kBlock;
  constexpr int kRowBytes = 3 * 64 * 2;  // a token's K (or V): 3 KV heads x 64 bf16
  const size_t per_layer = size_t(rows) * kPositions * kRowBytes;  // K (or V) of one layer
  const size_t total = per_layer * 2 * kLayers;
  char* kv = static_cast<char*>(std::aligned_alloc(1 << 21, total));
  madvise(kv, total, MADV_HUGEPAGE);  // as the KV cache managers allocate it
  std::memset(kv, 1, total);
  const size_t stream_bytes = size_t(512) << 20;
  char* stream = static_cast<char*>(std::aligned_alloc(1 << 21, stream_bytes));
  std::memset(stream, 2, stream_bytes);
  std::vector<double> steps;
  float sink = 0;
  for (int rep = 0; rep < 12; ++rep) {
    __m512 s = _mm512_setzero_ps();
    for (size_t i = 0; i < stream_bytes; i += 64)
      s = _mm512_add_ps(s, _mm512_load_ps(reinterpret_cast<const float*>(stream + i)));
    sink += _mm512_reduce_add_ps(s);
    const auto start = std::chrono::steady_clock::now();
    for (int layer = 0; layer < kLayers; ++layer) {
#pragma omp parallel for num_threads(threads) reduction(+ : sink) schedule(static)
      for (int r = 0; r < rows; ++r) {
        __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
        auto line = [](const char* p) { return _mm512_load_ps(reinterpret_cast<const float*>(p)); };
        for (int pass = 0; pass < 2; ++pass) {  // K, then V
          const char* base = kv + (size_t(layer) * 2 + pass) * per_layer +
                             size_t(r) * kPositions * kRowBytes;
          for (int blk = 0; blk < kBlocks; ++blk) {
            const char* block = base + size_t(blk) * kBlock * kRowBytes;
            if (order == 1 && blk + 1 < kBlocks)
              for (int off = 0; off < kBlock * kRowBytes; off += 64)
                _mm_prefetch(block + kBlock * kRowBytes + off, _MM_HINT_T1);
            if (order == 2) {
              for (int off = 0; off < kBlock * kRowBytes; off += 128) {
                a = _mm512_add_ps(a, line(block + off));
                b = _mm512_add_ps(b, line(block + off + 64));
              }
            } else {
              for (int head = 0; head < 3; ++head)
                for (int t = 0; t < kBlock; ++t) {
                  const char* p = block + t * kRowBytes + head * 128;
                  a = _mm512_add_ps(a, line(p));
                  b = _mm512_add_ps(b, line(p + 64));
                }
            }
          }
        }
        sink += _mm512_reduce_add_ps(_mm512_add_ps(a, b));
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rep >= 2) steps.push_back(seconds);
  }
  std::sort(steps.begin(), steps.end());
  const double median = steps[steps.size() / 2];
  std::printf("rows %d order %d threads %d: %.2f ms a step (%d layers), %.1f GB/s%s\n", rows, order,
              threads, median * 1e3, kLayers, total / median / 1e9, sink == 1.f ? " " : "");
  return 0;
}
