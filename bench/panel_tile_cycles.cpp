// Cycles per k step of the AVX2 panel tiles (nxdi_common/kernels/panel_tile.h) for 1-6 rows, one
// core, the panel in L1/L2: what a tile costs without memory in the way. Build and run from the
// repository root (torch's headers from the venv; the "3.1 GHz" is an assumed clock, so compare
// the rows with each other, or versions of the tile in the same run):
//
//   T=.venv/lib/python3.11/site-packages/torch/include
//   g++ -O3 -march=native -std=c++20 -ffp-contract=off -I nxdi_common/kernels -isystem $T \
//       bench/panel_tile_cycles.cpp -o /tmp/panel_tile_cycles && /tmp/panel_tile_cycles 576
#include "panel_tile.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename W>
void measure(const char* name, int K) {
  std::vector<W> w(K * nxdi_tile::kNR, W(0.5f));
  std::vector<float> x(nxdi_tile::kMR * K, 0.25f), c(nxdi_tile::kMR * nxdi_tile::kNR);
  for (int rows = 1; rows <= nxdi_tile::kMR; ++rows) {
    double best = 1e9;
    for (int round = 0; round < 20; ++round) {
      const double t = now();
      for (int i = 0; i < 2000; ++i)
        nxdi_tile::tile_rows(rows, x.data(), K, w.data(), K, c.data());
      best = std::min(best, (now() - t) / 2000);
    }
    const double cycles = best * 3.1e9;
    std::printf("%s panel, %d rows, K=%d: %.1f cycles a k step, %.2f FMAs a cycle\n", name, rows,
                K, cycles / K, 2.0 * rows * K / cycles);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int K = argc > 1 ? std::atoi(argv[1]) : 576;
  measure<float>("float32", K);
  measure<c10::BFloat16>("bfloat16", K);
}
