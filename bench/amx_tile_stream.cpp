// panel_linear.cpp's AMX step (amx_block: two B tiles of weight pairs, one A tile of x rows, two
// tdpbf16ps) over a stream of weights without torch, one core: how fast the tiles read weights
// at a given number of x rows, from L1/L2 (small --kb) or from memory (64 MB), with or without
// amx_block's software prefetch (prefetcht0 or prefetcht1, DIST bytes ahead, 16 lines a tile).
// Session 57 (Intel VM with AMX): from memory 16 rows read 23.7 GB/s without the prefetch and
// 28.1 with prefetcht0 4 KB ahead (1 row 27.1 and 28.6), an hour later 27.7-28.9 against
// 29.4-29.5 (three alternating pairs); in L1 a 16-row step took 10.5-12 ns a tdpbf16ps against
// 5.6-6.7 at 1-4 rows. The machine's read bandwidth drifts: compare runs of one hour only.
//
//   g++ -O2 -march=native bench/amx_tile_stream.cpp -o /tmp/amx_tile_stream
//   /tmp/amx_tile_stream ROWS KB [PREFETCH(0 none, 1 t0, 2 t1) [DIST]]
//   /tmp/amx_tile_stream 16 65536 0 && /tmp/amx_tile_stream 16 65536 1 4096
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s ROWS(1-16) KB [PREFETCH [DIST]]\n", argv[0]);
    return 2;
  }
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::fprintf(stderr, "Linux did not grant the AMX tile state\n");
    return 1;
  }
  const int rows = std::atoi(argv[1]);
  const size_t bytes = size_t(std::atol(argv[2])) << 10;
  const int prefetch = argc > 3 ? std::atoi(argv[3]) : 0;
  const long dist = argc > 4 ? std::atol(argv[4]) : 4096;
  auto* w = static_cast<uint16_t*>(std::aligned_alloc(64, bytes + 2 * dist + 4096));
  for (size_t i = 0; i < (bytes + 2 * dist + 4096) / 2; ++i) w[i] = 0x3f80;  // bf16 1.0
  alignas(64) static uint16_t x[16 * 1024];
  std::fill(x, x + 16 * 1024, uint16_t{0x3f80});
  TileConfig cfg;
  for (int t : {0, 1, 4}) cfg.rows[t] = rows, cfg.colsb[t] = 64;  // C0, C1, A
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;       // B0, B1
  _tile_loadconfig(&cfg);
  const size_t tiles = bytes / 1024;
  alignas(64) static float c[2][16][16];
  double best = 1e9;
  for (int rep = 0; rep < 20; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    _tile_zero(0);
    _tile_zero(1);
    for (size_t t = 0; t + 1 < tiles; t += 2) {
      const char* tile = reinterpret_cast<const char*>(w) + t * 1024;
      if (prefetch != 0)
        for (int l = 0; l < 32; ++l) {
          if (prefetch == 1) _mm_prefetch(tile + dist + 64 * l, _MM_HINT_T0);
          else _mm_prefetch(tile + dist + 64 * l, _MM_HINT_T1);
        }
      _tile_loadd(6, tile, 64);
      _tile_loadd(7, tile + 1024, 64);
      _tile_loadd(4, x + (t % 32) * 32, 2048);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (rep > 2) best = std::min(best, s);
  }
  _tile_release();
  std::printf("rows %d, %zu KB of weights, prefetch %d (%ld B ahead): %.2f ns a tdpbf16ps, "
              "%.1f GB/s of weights (c %.0f)\n", rows, bytes >> 10, prefetch, dist,
              best / tiles * 1e9, bytes / best / 1e9, c[0][0][0]);
  return 0;
}
