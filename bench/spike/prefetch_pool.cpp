// Design spike (not used by the services): does an idle second thread that streams the next
// weights into the caches during a decode step's serial stretches shorten the step?
// A step is modelled as the bundled model's products in module order (30 layers of qkv 1.1 MB,
// o 0.66 MB, gate_up 3.5 MB, down 1.77 MB, then a 57 MB LM head), each read by two threads in
// contiguous halves with AVX-512 loads (a batch-1 product is a read at memory speed), a serial
// stretch of compute on the main thread after each product (--gap-us) and after the LM head
// (--step-gap-us). Between products the second thread either spins (mode spin) or reads the
// fronts of the next products' two halves, 4 KB of each in turn, until new work arrives or it
// is --ahead-mb past the main thread (mode prefetch). Modes alternate step by step.
//   g++ -O2 -march=native -pthread bench/spike/prefetch_pool.cpp -o /tmp/prefetch_pool
//   /tmp/prefetch_pool [gap_us] [step_gap_us] [ahead_mb] [steps] [step-only]
// step-only: prefetch only in the stretch after the LM head.
#include <immintrin.h>
#include <atomic>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

struct Product { size_t off, size; };
static std::vector<Product> products;
static unsigned char* arena;
static std::atomic<long> generation{0};   // bumped by the main thread per product
static std::atomic<long> finished{0};     // products the worker finished
static std::atomic<bool> prefetching{false}, quit{false};
static std::atomic<size_t> current{0};
static std::atomic<long> gap{0};          // the product whose both halves are read (a serial stretch)    // index of the product being or last read
static volatile long long sink;

static long long read_range(const unsigned char* p, size_t n) {
  __m512i acc = _mm512_setzero_si512();
  for (size_t i = 0; i + 256 <= n; i += 256) {
    acc = _mm512_add_epi32(acc, _mm512_load_si512(p + i));
    acc = _mm512_add_epi32(acc, _mm512_load_si512(p + i + 64));
    acc = _mm512_add_epi32(acc, _mm512_load_si512(p + i + 128));
    acc = _mm512_add_epi32(acc, _mm512_load_si512(p + i + 192));
  }
  return _mm512_reduce_add_epi32(acc);
}

static void spin_compute(double us) {
  auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds((long)(us * 1000));
  double x = 1.0;
  while (std::chrono::steady_clock::now() < until) for (int i = 0; i < 50; ++i) x = x * 1.0000001 + 1e-9;
  sink += (long long)x;
}

static bool step_only = false;

static void worker(size_t ahead_bytes) {
  long seen = 0;
  while (!quit.load(std::memory_order_relaxed)) {
    long g = generation.load(std::memory_order_acquire);
    if (g != seen) {
      seen = g;
      const Product& p = products[current.load()];
      size_t half = p.size / 2 / 256 * 256;
      sink += read_range(arena + p.off + half, p.size - half);
      finished.store(g, std::memory_order_release);
      continue;
    }
    if (!prefetching.load(std::memory_order_relaxed) ||
        (step_only && current.load() + 1 != products.size()) ||
        gap.load(std::memory_order_acquire) != seen) { _mm_pause(); continue; }
    // Stream the next products' half fronts while no work has arrived.
    size_t j = (current.load() + 1) % products.size(), pos = 0, done = 0;
    while (generation.load(std::memory_order_acquire) == seen && done < ahead_bytes) {
      const Product& p = products[j];
      size_t half = p.size / 2;
      if (pos >= half) { j = (j + 1) % products.size(); pos = 0; continue; }
      size_t n = std::min<size_t>(4096, half - pos);
      sink += read_range(arena + p.off + pos, n);
      sink += read_range(arena + p.off + half + pos, n);
      pos += n; done += 2 * n;
    }
    while (generation.load(std::memory_order_acquire) == seen && !quit.load()) _mm_pause();
  }
}

int main(int argc, char** argv) {
  double gap_us = argc > 1 ? atof(argv[1]) : 4, step_gap_us = argc > 2 ? atof(argv[2]) : 900;
  size_t ahead = (size_t)((argc > 3 ? atof(argv[3]) : 16) * (1 << 20));
  int steps = argc > 4 ? atoi(argv[4]) : 60;
  step_only = argc > 5 && !strcmp(argv[5], "step-only");
  const size_t sizes[4] = {576 * 960 * 2, 576 * 576 * 2, 576 * 3072 * 2, 1536 * 576 * 2};
  size_t off = 0;
  for (int l = 0; l < 30; ++l)
    for (size_t s : sizes) { products.push_back({off, s}); off += (s + 4095) / 4096 * 4096; }
  products.push_back({off, (size_t)49152 * 576 * 2}); off += products.back().size;
  arena = (unsigned char*)aligned_alloc(4096, off);
  for (size_t i = 0; i < off; ++i) arena[i] = (unsigned char)(i * 131);
  std::thread t(worker, ahead);
  std::vector<double> ms[2];
  long g = 0;
  for (int s = 0; s < steps; ++s) {
    int mode = (s / 10) % 2;  // ten steps each; a block's first step follows the other mode's gap
    prefetching.store(mode == 1);
    auto t0 = std::chrono::steady_clock::now();
    for (size_t k = 0; k < products.size(); ++k) {
      current.store(k);
      generation.store(++g, std::memory_order_release);
      const Product& p = products[k];
      sink += read_range(arena + p.off, p.size / 2 / 256 * 256);
      while (finished.load(std::memory_order_acquire) != g) _mm_pause();
      gap.store(g, std::memory_order_release);
      spin_compute(k + 1 == products.size() ? step_gap_us : gap_us);
    }
    double e = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s % 10 != 0) ms[mode].push_back(e);
  }
  quit.store(true); generation.store(++g); t.join();
  for (int m = 0; m < 2; ++m) std::sort(ms[m].begin(), ms[m].end());
  double a = ms[0][ms[0].size() / 2], b = ms[1][ms[1].size() / 2];
  printf("%s gap %.1f us, step gap %.0f us, ahead %.0f MB: spin %.3f ms, prefetch %.3f ms, %.3fx\n",
         step_only ? "step-only" : "all gaps", gap_us, step_gap_us, ahead / 1048576.0, a, b, a / b);
  return 0;
}
