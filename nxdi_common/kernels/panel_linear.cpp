// Linear layers for x86 CPUs (with AMX, bfloat16 pairs run on its tiles: run_amx below). Without
// bfloat16 dot products (AVX2, or AVX-512 without avx512_bf16) torch's bfloat16 GEMM converts
// element by element and runs 5-8x slower than its float32 one (a 512-row prefill projection
// 55 ms against 7 ms on an AMD EPYC with AVX2), and oneDNN cannot pack bfloat16 weights at all;
// with AVX512-BF16 (AMD Zen 4) the bfloat16 path below (run_dot) reads a one-row product's
// weights faster than oneDNN. Here the weights stay in their 16-bit dtype, reordered once at
// load into panels of 16 output columns, k-major:
//
//     panels [P, K, 16]: panels[p, k, j] = W[16p + j, k]  (zero past the last output)
//
// so one 32-byte load brings the k-th input's weights for 16 outputs, widened to float32 with a
// shift (bf16) or F16C (fp16), and a 6-row x 16-column tile of float32 sums is kept in registers:
// each weight loaded is used for up to 6 input rows, each input value for 16 outputs. Sums are
// float32; the result is rounded once to the dtype after bias and residual are added, as torch's
// addmm does.
//
// With bfloat16 dot products (run_dot) bfloat16 panels may come with their rows already in pairs
// (pack_panels' `pairs` layout, what modules/linear.py packs on such CPUs):
//
//     pairs [P, ceil(K / 2), 32]: pairs[p, i, 2j + h] = W[16p + j, 2i + h]  (zero past K)
//
// the order the dot products take them in, so the tiles load 64 bytes per k pair and shuffle
// nothing; from [P, K, 16] panels every tile interleaves each pair itself (a vpermw on the port
// the dot products also use). Any other path multiplies pairs as panels after reordering them.
//
// int8 weights (modules/quantization.py) use the same panels, 16 bytes a row, and a float32 scale
// per output that multiplies the sums before bias and residual: w = int8 * scale, so the product
// reads half the bytes of bfloat16, which is what a one-row (decode) product is bound by.
//
// Registered as torch.ops.nxdi.panel_linear in the same library as our other kernels.
#include "panel_tile.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace nxdi_fused {
at::Tensor rms_norm_of(const at::Tensor& x, const at::Tensor& weight, double eps);
// rms_norm's rows on the calling thread (no parallel region).
void rms_norm_here(const c10::BFloat16* x, const c10::BFloat16* w, c10::BFloat16* out,
                   int64_t rows, int64_t n, float eps);
}

namespace {

using namespace nxdi_simd;
using nxdi_tile::kMR;
using nxdi_tile::kNR;
using nxdi_tile::tile_rows;

constexpr int64_t kPanelsPerTask = 4;  // a task: 64 output columns (for_each_task)
constexpr int64_t kRowBlockBytes = 256 * 1024;  // float32 input rows a task keeps near the core
constexpr int64_t kWidenRows = kMR + 1;  // from this many rows a panel is widened once (run)
constexpr int kDotMR = 8;  // rows per tile of the bf16 dot-product path (run_dot)
constexpr int kFmaMR = 16;  // rows per tile of its float32 FMA variant (one panel past kDotMR)
constexpr int kOnTheFlyRows = 32;  // up to this many rows run_dot interleaves panels in the tiles
constexpr int kOneStreamRows = 4;  // up to this many rows run_dot reads one stream (dot_tile)

struct Problem {
  int64_t M, K, N, P;  // rows, inputs, outputs, panels
  const float* scale;  // [N] per-output multipliers of the sums, or null
};

// out[m, n] = dtype(c * scale[n] + bias[n] + residual[m, n]) for the tile's rows and its panel's
// valid columns; scale, bias and residual may be null. A plain loop on purpose: with each row as
// one AVX-512 load, add and rounded store instead (cad6bb7), 256-row products on AMD Zen 4 took
// up to 1.35x longer (bench_projections --rows 256, one thread, five alternating rounds: 320-365
// vs 274-355 ms for the 121 products), and a decode worker's 256-token prefill piece 1.18x
// (bench_chunked_prefill --length 512 --chunks 256: 356-376 vs 299-309 ms), the same outputs bit
// for bit; 1 and 16 rows were within noise either way. Loading the row as two 256-bit halves or
// keeping the function out of line did not recover it.
template <typename T>
void store_tile(const float* c, int rows, int64_t m0, int64_t n0, const Problem& pb,
                const T* bias, const T* residual, T* out) {
  const int64_t cols = std::min(kNR, pb.N - n0);
  for (int r = 0; r < rows; ++r) {
    const int64_t row = (m0 + r) * pb.N + n0;
    for (int64_t j = 0; j < cols; ++j) {
      float v = c[r * kNR + j];
      if (pb.scale != nullptr) v *= pb.scale[n0 + j];
      if (bias != nullptr) v += to_float(bias[n0 + j]);
      if (residual != nullptr) v += to_float(residual[row + j]);
      out[row + j] = from_float<T>(v);
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// store_tile with each full row of 16 as one AVX-512 load, adds and rounded store (the same
// operations in the same order, so the same bits; a partial panel takes the loop), for the AMX
// products (run_amx). On the Intel VM with AMX (session 57; the 121 products of a decode step
// alone, two threads, in one process with this and the loop alternating, 12 rounds): 1 row
// 0.990x the time, 16 rows 0.972-0.986x, 32 rows 0.947x, 64 rows 0.906x, 256 rows 0.843x, 512
// rows 0.847x; the bundled model's decode step at 576 positions 0.29 ms (1 row) and 0.33 ms (16
// rows) shorter. AMD Zen 4's products (no AMX) keep the loop, for the reason above.
template <typename T>
void store_tile_rows16(const float* c, int rows, int64_t m0, int64_t n0, const Problem& pb,
                       const T* bias, const T* residual, T* out) {
  if (pb.N - n0 < kNR || pb.scale != nullptr)
    return store_tile(c, rows, m0, n0, pb, bias, residual, out);
  const __m512 b = bias != nullptr ? load16(bias + n0) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    const int64_t row = (m0 + r) * pb.N + n0;
    __m512 v = _mm512_loadu_ps(c + r * kNR);
    if (bias != nullptr) v = _mm512_add_ps(v, b);
    if (residual != nullptr) v = _mm512_add_ps(v, load16(residual + row));
    store16(out + row, v);
  }
}
#endif

// Whether run's tiles prefetch at all (panel_rows: a widened panel's next one, and where
// stream_prefetch() a panel read in place): NXDI_PANEL_PREFETCH=1/0 where set, read once, or the
// op panel_prefetch, for A/B runs in one process; by default on.
std::atomic<bool>& prefetch_setting() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("NXDI_PANEL_PREFETCH");
    return env == nullptr || *env == '\0' || std::atoi(env) != 0;
  }()};
  return on;
}

// Whether a decode batch's product makes x's pairs (and its norm) in each thread
// (x_for_this_thread) rather than on the calling thread before it: NXDI_PANEL_X_PER_THREAD=1/0
// where set, read once, or the op panel_x_per_thread, for A/B runs in one process; by default on.
std::atomic<bool>& x_per_thread_setting() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("NXDI_PANEL_X_PER_THREAD");
    return env == nullptr || *env == '\0' || std::atoi(env) != 0;
  }()};
  return on;
}

// The CPU's family as CPUID leaf 1 reports it (base family, plus the extended family where the
// base is 0xF): AMD Zen 4 0x19, Zen 5 0x1A; 0 where CPUID has no leaf 1.
unsigned cpu_family() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return 0;
  const unsigned base = (eax >> 8) & 0xF;
  return base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
}

// Whether panels read in place from memory prefetch their stream in software (and AMX tiles of
// up to kAmxBlockRows rows, amx_block):
// NXDI_PANEL_STREAM_PREFETCH=1 or 0 where set (read once), else on Intel CPUs, on AMD Zen 5 and
// later, and where the library is built without AVX512-BF16 (AVX2 only, e.g. AMD Zen 3), not on
// AMD Zen 4. With AVX512-BF16 it decides for up to kOneStreamRows rows of the dot-product path
// (run_dot, whose comment has the Zen 4 and Intel figures); everywhere it decides for
// panel_rows' tiles of panels read in place (bfloat16 and float32 panels at any rows, float16
// and int8 up to kMR).
// On AMD Zen 3 (AVX2) the tiles' prefetch (prefetcht0, kStreamBytes ahead) cut the time of the
// 121 products of a decode step read from memory, bf16 panels, two threads, in one process with
// it on and off alternating (panel_prefetch, 12 rounds): 1 row 0.89x, 2 rows 0.82x, 3 rows 0.83x,
// 4 rows 0.78x, 8 rows 0.86x, 16 rows 0.95x; float16 and int8 panels 1-6 rows 0.80-0.98x,
// float32 1-6 rows 0.84-1.01x, 16 rows 1.04x. (In a sweep, 1-4 KB ahead were within noise of
// each other for 1-2 rows; 2-4 KB gained most from 4 rows, 8 KB lost at 16.) A whole decode
// step of the bundled model, 256 positions, two threads, on and off alternating: 1 row 0.97x,
// 4 rows 0.87x, 16 rows 0.84x the time.
// On AMD Zen 5 (family 0x1A, session 53) it is on as on Intel: a batch-1 decode step of the
// bundled model (512 cached positions, two threads) with the few-row prefetch on and off
// alternating in one process (a scratch switch, 10 rounds) took 0.934x the time on (8 rounds
// of 10 lower); in separate processes the 121 products of a step 0.85x.
bool stream_prefetch() {
  static const bool on = [] {
    const char* env = std::getenv("NXDI_PANEL_STREAM_PREFETCH");
    if (env != nullptr && *env != '\0') return std::atoi(env) != 0;
#if defined(__AVX512BF16__)
    __builtin_cpu_init();
    if (__builtin_cpu_is("intel") != 0) return true;
    return cpu_family() >= 0x1A;
#else
    return true;
#endif
  }();
  return on;
}
constexpr int64_t kStreamBytes = 4096;  // how far ahead panel_rows' tiles prefetch a panel

// One panel times rows [m0, m1) of x into out. With many rows a float16 or int8 panel is
// widened to float32 once (wide, 16 x K) and the tiles read that: the widening then costs once
// per panel instead of once per 6 rows. A bfloat16 panel is read in place: its widening in the
// tile (a shift and an and, panel_tile.h) costs less than a pass over `wide` (on AMD Zen 3, one
// product of 16 x 576 by 576 x 1536 in cache ran at the tile's FMA peak either way).
// The rows are shared evenly among the fewest tiles of at most kMR (16 rows: 6, 5, 5, not 6, 6,
// 4; 8 rows 4 + 4, not 6 + 2): a tile of 1 or 2 rows waits on its few FMA chains.
// Unless prefetch_setting() is off, a widened panel's first tile prefetches the next panel in
// memory (where the walk goes next), whose widening pass has nothing to overlap it otherwise:
// on AMD Zen 3, 16 rows of bf16 panels when they were widened too, 0.95x the time (the 121
// products of a decode step, two threads, 15 rounds alternating in one process). Panels read
// in place do not take that prefetch (there it made 8 and 16 rows 1.1x slower, all of the next
// panel's lines at once); where stream_prefetch() every tile prefetches its own panel
// kStreamBytes ahead of its reads instead, a line at a time.
template <typename T, typename W>
void panel_rows(const Problem& pb, const float* x, const W* panel, int64_t p, int64_t m0,
                int64_t m1, const T* bias, const T* residual, T* out, std::vector<float>& wide) {
  float c[kMR * kNR];
  const bool widen = !std::is_same_v<W, float> && !nxdi_tile::kEvenOdd<W> && m1 - m0 >= kWidenRows;
  if (widen) {
    wide.resize(pb.K * kNR);
    for (int64_t i = 0; i < pb.K * kNR; ++i) wide[i] = to_float(panel[i]);
  }
  // a widened panel (16- or 8-bit) has fewer lines than K: the first tile prefetches them all
  const int64_t panel_bytes = pb.K * kNR * static_cast<int64_t>(sizeof(W));
  const char* next = reinterpret_cast<const char*>(panel) + panel_bytes;
  const bool prefetch = prefetch_setting().load(std::memory_order_relaxed);
  int64_t next_lines = widen && p + 1 < pb.P && prefetch ? (panel_bytes + 63) / 64 : 0;
  const int64_t stream = prefetch && stream_prefetch() ? kStreamBytes : 0;
  const int64_t tiles = (m1 - m0 + kMR - 1) / kMR;
  for (int64_t m = m0, t = 0; m < m1; ++t) {
    const int rows = static_cast<int>((m1 - m + tiles - t - 1) / (tiles - t));
    if (widen)
      tile_rows(rows, x + m * pb.K, pb.K, wide.data(), pb.K, c, next, next_lines);
    else
      tile_rows(rows, x + m * pb.K, pb.K, panel, pb.K, c, nullptr, 0, stream);
    store_tile(c, rows, m, p * kNR, pb, bias, residual, out);
    next_lines = 0;
    m += rows;
  }
}

// Tasks are (group of panels, block of rows), panel-major: a thread's tasks walk its panels once
// and the input rows (kept within kRowBlockBytes a block; x_bytes per input value) again for each
// group; a block's rows are a multiple of the tile's. panel(p, np, m0, m1, scratch) computes
// rows [m0, m1) of the np (at most `step`) panels from p; `scratch` is one Scratch per parallel
// chunk, made before its first task and destroyed after its last.
template <typename Scratch = std::vector<float>, typename F>
void for_each_task(const Problem& pb, int64_t x_bytes, int64_t tile, int step, F&& panel) {
  const int64_t block_rows = std::max<int64_t>(
      tile, kRowBlockBytes / (x_bytes * std::max<int64_t>(pb.K, 1)) / tile * tile);
  const int64_t row_blocks = (pb.M + block_rows - 1) / block_rows;
  // A few tasks that the threads cannot share evenly leave one thread idle at the end of the
  // product: o_proj's and down_proj's 9 tasks run 5 : 4 on two threads. Such a product takes
  // tasks of `step` panels instead (18 tasks, 9 : 9); the tile walks `step` panels at a time
  // either way. The bundled model's products in one process, two threads, ten alternating
  // rounds: 8 rows 0.981x the time, 16 rows 0.970x, one row unchanged (0.993x).
  int64_t per_task = kPanelsPerTask;
  const int64_t threads = at::get_num_threads();
  const int64_t tasks = (pb.P + per_task - 1) / per_task * row_blocks;
  if (threads > 1 && tasks % threads != 0 && tasks < 8 * threads) per_task = step;
  const int64_t groups = (pb.P + per_task - 1) / per_task;
  at::parallel_for(0, groups * row_blocks, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / row_blocks, rb = task % row_blocks;
      const int64_t m_end = std::min(pb.M, (rb + 1) * block_rows);
      const int64_t p_end = std::min(pb.P, (g + 1) * per_task);
      for (int64_t p = g * per_task; p < p_end; p += step)
        panel(p, static_cast<int>(std::min<int64_t>(step, p_end - p)), rb * block_rows, m_end,
              scratch);
    }
  });
}

template <typename T, typename W>
void run(const Problem& pb, const float* x, const W* panels, const T* bias, const T* residual,
         T* out) {
  for_each_task(pb, sizeof(float), kMR, 1, [&](int64_t p, int, int64_t m0, int64_t m1,
                                               auto& wide) {
    panel_rows(pb, x, panels + p * pb.K * kNR, p, m0, m1, bias, residual, out, wide);
  });
}

#if defined(__AVX512BF16__)
// bfloat16 x times bfloat16 panels with the CPU's bf16 dot products (AVX512-BF16, e.g. AMD Zen 4,
// which has no AMX): vdpbf16ps adds x[k] w[k] + x[k+1] w[k+1] to each float32 sum, so the panel's
// rows k and k+1 are interleaved (one vpermw) and each row's (x[k], x[k+1]) pair is broadcast.
// Products of two bf16 values are exact in float32 and the instruction's sums are float32 sums
// (rounded to nearest even; inputs and results below float32's normal range flushed to zero), so
// the result is the exact product to float32 summation error, rounded once to the dtype, as on
// the float32 path (the k order of the sums differs, so not bit for bit). Twice the
// multiply-adds per instruction of widening to float32, and no widening (the rows are
// interleaved by simd.h's interleave_rows).

// The panel's rows 2i and 2i + 1 interleaved (32 values; with K odd the last pair's second row
// is zero): read from `pairs` where the weights come in pairs or dot_panel_rows interleaved them
// once, else made here.
struct PanelPairs {
  const c10::BFloat16* panel;  // [K, 16]
  const __m512i* pairs;        // [ceil(K / 2)] interleaved, or null (then `panel` is [K, 16])
  int64_t K;
  bool prefetch;               // read from memory by several rows: prefetch kPrefetchBytes ahead
  int64_t bytes;               // the panel's, in memory (panels lie one after another)
  int64_t next = 0;            // >0: prefetch line i + next instead (dot_panel_rows)
  __attribute__((always_inline)) __m512bh operator()(int64_t i) const {
    if (pairs != nullptr) return (__m512bh)_mm512_loadu_si512(pairs + i);
    return (__m512bh)interleave_rows(panel + 2 * i * kNR,
                                     2 * i + 1 < K ? panel + (2 * i + 1) * kNR : nullptr);
  }
};

// For q < NP panels: c[q][r * 16 + j] = sum over k of x_r[k] * W_q[k][j], r < MR, where row r's
// pair i (x_r[2i], x_r[2i + 1]) is xp[i * xs + r] (pack_pairs; an odd K's last pair is
// (x_r[K - 1], 0)); c[q] starts at c + q * kDotMR * 16. Each broadcast pair serves NP panels.
// With few sums in flight the k pairs alternate between two sets of them, so the dot products'
// latency overlaps. The lambdas and PanelPairs::operator() are forced inline: when GCC kept
// either out of line (it did after small unrelated edits here) the sums went through memory and
// a 16-row decode step's products took 2.3x as long.
// Read from memory (a decode batch's tiles), each panel's line kPrefetchBytes ahead is
// prefetched into L2 (prefetcht1). Past a panel's end that line is the same panel's of the next
// NP, which the walk reads next: the next panel in memory is one this walk is reading already
// (until session 32 the prefetches went there, and each pair of panels started its first 4 KB
// unprefetched). The 121 products of a decode step, two threads, in one process with the two
// targets alternating over ten rounds: 8 rows 0.952x the time, 16 rows 0.940x, 64 and 256 rows
// 0.99x; a whole decode step of 8 and 16 rows x 576 positions 0.953x (every round lower).
// AMD Zen 4, the 121 products of a decode step, one thread (bench_projections.py, two runs each
// way): 8 rows 18.8-19.2 -> 15.6-16.0 ms, 16 rows 30.6-32.4 -> 25.9-27.1; 1 row unchanged
// (13.8-14.7). In a sweep of distances 2 KB gained less and 8-16 KB less again; prefetcht0 less.
// Up to kOneStreamRows rows (a batch-1 step, and the batches of 2-4 a lightly loaded decode
// worker runs) read one panel at a time, on AMD Zen 4 with no software prefetch: a single stream
// that the hardware prefetchers follow best (one row, one thread, 141 MB of panels, alternating
// runs: 20.0-20.6 GB/s, against 17.1-17.9 with two prefetched panels, 14.6 with one prefetched
// panel, and 20-25 for a float32 sum over the same bytes). Until session 43 only one row did:
// the 121 products of 2 / 3 / 4 rows took 12.2-12.9 / 13.2 / 12.3-14.4 ms as two prefetched
// panels, 9.3-10.7 / 9.8-10.7 / 10.2-11.2 as one stream, and 12.2-14.2 as one prefetched panel
// (bench_projections.py, one thread, pairs, alternating runs); from 6 rows on two prefetched
// panels win (8 rows 11.6-12.7 against 14.4-15.4); 5 rows were even.
// On Intel (a 2-vCPU Xeon, family 6 model 207, without AMX) the same single stream is read
// faster with that prefetch than without: one core pulls far less from memory by itself than a
// Zen 4 core (the bench_model probe: 12.4 GB/s on one thread, 18-24 on two) and the hardware
// prefetchers alone leave it idle. The 121 products of a decode step, pairs on one huge-page
// arena, separate processes alternating (/tmp spike, session 45): one row, one thread 25-43 ms
// without, 19-24 with; one row, two threads 14.3-20.3 -> 11.1 ms (24 GB/s, what the probe
// reads); four rows, two threads 22.3-30.6 -> 12.8-15.1. The distance mattered little there
// (2-32 KB within noise; prefetcht0 even, prefetchnta 1.5x slower). So few rows prefetch on
// Intel and AMD Zen 5, not on Zen 4 (stream_prefetch).
constexpr int64_t kPrefetchBytes = 4096;

// Rows from which a product multiplies on float32 FMAs instead of the bf16 dot products
// (NXDI_PANEL_FMA_MIN_ROWS, read once; 0 never): by default 0 except on Intel, where vdpbf16ps
// is half-rate. This 2-vCPU Xeon (family 6 model 207, no AMX), one core, a chain-free loop of
// each instruction on zmm registers (g++ -O2 -march=native, pinned): vdpbf16ps 1.31-1.33 G/s =
// 83-85 GFLOPS, vfmadd231ps 5.31 G/s = 170 GFLOPS; on AMD Zen 4 the dot products ran 234 GFLOPS,
// twice what its FMAs do. Widening a pair of bf16 panel rows to two float32 vectors is a shift
// and an and (no shuffles), so a tile of 8 rows x 2 panels does 32 FMAs and 4 widening
// operations a k pair where the dot products take 16 at half the rate. One product of 16 x 576
// by 576 x 1536 in L2, one thread: 83-85 GFLOPS on the dot products, 138-142 on FMAs (8 x 2
// tiles); 4 rows 73 -> 105-113, 2 rows even (64-67 against 58-64), hence from 4 rows. The 121
// products of a decode step, two threads, alternating processes (bench_projections.py): 16 rows
// 33.7-34.4 -> 21.1-27.7 ms, 64 rows 123-125 -> 70-84; a 512-token prefill in panels
// (bench_prefill.py --skip-attention) 1718-1750 -> 1084-1318 ms, faster than oneDNN's 1535-1714.
int64_t fma_min_rows() {
  static const int64_t rows = [] {
    const char* env = std::getenv("NXDI_PANEL_FMA_MIN_ROWS");
    if (env != nullptr && *env != '\0') return std::max<int64_t>(0, std::atoll(env));
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0 ? int64_t{4} : int64_t{0};
  }();
  return rows;
}

// x's rows as the float32 FMA tiles read them: tiles of kFmaMR rows (the tile of rows m.. at
// 2 * m * npairs), pair-major ([npairs][the tile's rows][2]), the pair (x[2i], x[2i + 1]) as
// floats (an odd K's last one (x[K - 1], 0)), so that a tile broadcasts each value straight from
// memory, no shuffle.
//
// Eight pairs of up to 16 rows at a time: each row's 16 values widened in a register (8 pairs,
// one per 64-bit lane), then 8 x 8 transposes of those lanes put each pair's rows together. The
// element-by-element loop it replaced took ~1 ns a value, on one thread while the other waited:
// the 121 products of a 16-row decode step, two threads, in one process with the two
// alternating (20 rounds): 0.966x the time (8 rows 0.964x, 4 rows 0.990x), the same outputs.
const float* widen_rows(const c10::BFloat16* x, int64_t M, int64_t K, std::vector<float>& buf) {
  const int64_t npairs = (K + 1) / 2;
  buf.resize(2 * M * npairs);
  auto widen_tile = [&](int64_t m) {
    const int64_t rows = std::min<int64_t>(kFmaMR, M - m);
    float* dst = buf.data() + 2 * m * npairs;
    int64_t i0 = 0;
    for (; i0 + 8 <= K / 2; i0 += 8)
      for (int64_t g = 0; g < rows; g += 8) {  // rows g..g+7 (the missing ones zero, unstored)
        const int valid = static_cast<int>(std::min<int64_t>(8, rows - g));
        __m512i r[8], t[8];
        for (int j = 0; j < 8; ++j)
          r[j] = j < valid ? _mm512_castps_si512(load16(x + (m + g + j) * K + 2 * i0))
                           : _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2) {  // [row j pair 2l, row j + 1 pair 2l] in 128-bit lane l
          t[j] = _mm512_unpacklo_epi64(r[j], r[j + 1]);
          t[j + 1] = _mm512_unpackhi_epi64(r[j], r[j + 1]);
        }
        for (int j = 0; j < 8; j += 4) {  // rows j..j+3, pairs {0,4}, {1,5}, {2,6}, {3,7}
          r[j] = _mm512_shuffle_i64x2(t[j], t[j + 2], 0x88);
          r[j + 1] = _mm512_shuffle_i64x2(t[j + 1], t[j + 3], 0x88);
          r[j + 2] = _mm512_shuffle_i64x2(t[j], t[j + 2], 0xDD);
          r[j + 3] = _mm512_shuffle_i64x2(t[j + 1], t[j + 3], 0xDD);
        }
        const __mmask8 mask = static_cast<__mmask8>((1u << valid) - 1);
        for (int j = 0; j < 4; ++j) {  // pairs j and j + 4 of all eight rows
          float* at = dst + ((i0 + j) * rows + g) * 2;
          _mm512_mask_storeu_epi64(at, mask, _mm512_shuffle_i64x2(r[j], r[j + 4], 0x88));
          _mm512_mask_storeu_epi64(at + 8 * rows, mask, _mm512_shuffle_i64x2(r[j], r[j + 4], 0xDD));
        }
      }
    for (int64_t r = 0; r < rows; ++r) {  // the pairs past the last eight, and an odd K's last
      const c10::BFloat16* row = x + (m + r) * K;
      for (int64_t i = i0; i < npairs; ++i) {
        dst[(i * rows + r) * 2] = to_float(row[2 * i]);
        dst[(i * rows + r) * 2 + 1] = 2 * i + 1 < K ? to_float(row[2 * i + 1]) : 0.f;
      }
    }
  };
  const int64_t tiles = (M + kFmaMR - 1) / kFmaMR;
  if (M <= kOnTheFlyRows) {
    for (int64_t t = 0; t < tiles; ++t) widen_tile(t * kFmaMR);
  } else {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) widen_tile(t * kFmaMR);
    });
  }
  return buf.data();
}

// Subnormal inputs and results flushed to zero while in scope, as vdpbf16ps does (and without
// the microcode assists Intel's FMAs take on them otherwise).
struct FlushSubnormals {
  unsigned saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040u); }  // FTZ | DAZ
  ~FlushSubnormals() { _mm_setcsr(saved); }
};

// With Fma false, xp is the packed uint32 pairs and the sums are vdpbf16ps's; with Fma true it is
// x's pairs as floats (widen_rows) and each pair of panel rows is widened to two float32 vectors
// (the even row a shift, the odd one an and) for two FMAs per row and panel, the odd one first
// as vdpbf16ps sums them (on this Xeon the results were the dot products' bit for bit wherever
// both kept the same chains). Up to 16 rows with one panel (16 sums), 8 with two.
template <int MR, int NP, bool Fma>
void dot_tile(const void* xp_in, int64_t xs, const PanelPairs* w_at, int64_t K, float* c) {
  constexpr int kChains = Fma ? (MR * NP < 8 ? 2 : 1) : (MR * NP <= 3 ? 2 : 1);
  __m512 acc[kChains][MR][NP];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < kChains; ++h)
      for (int q = 0; q < NP; ++q) acc[h][r][q] = _mm512_setzero_ps();
  const int64_t npairs = (K + 1) / 2;
  int64_t i = 0;
  const bool prefetch = w_at[0].prefetch;
  // One k pair (chain h): NP panels' pairs, each row's x pair broadcast from its packed place.
  auto step = [&](int64_t k, int h) __attribute__((always_inline)) {
    if constexpr (Fma) {
      __m512 we[NP], wo[NP];
      for (int q = 0; q < NP; ++q) {
        const __m512i w = (__m512i)w_at[q](k);
        we[q] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        wo[q] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(-65536)));
      }
      const float* xk = static_cast<const float*>(xp_in) + 2 * k * xs;
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512 xe = _mm512_set1_ps(xk[2 * r]), xo = _mm512_set1_ps(xk[2 * r + 1]);
        for (int q = 0; q < NP; ++q)
          acc[h][r][q] = _mm512_fmadd_ps(xe, we[q], _mm512_fmadd_ps(xo, wo[q], acc[h][r][q]));
      }
    } else {
      __m512bh w[NP];
      for (int q = 0; q < NP; ++q) w[q] = w_at[q](k);
      const uint32_t* xk = static_cast<const uint32_t*>(xp_in) + k * xs;
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(xk[r]));
        for (int q = 0; q < NP; ++q) acc[h][r][q] = _mm512_dpbf16_ps(acc[h][r][q], x, w[q]);
      }
    }
  };
  // The k pairs up to `end`, prefetching the line `ahead` bytes past each pair's.
  auto pairs_to = [&](int64_t end, int64_t ahead) __attribute__((always_inline)) {
    for (; i + kChains <= end; i += kChains) {
      if (prefetch)  // a pair of panel rows is one 64-byte line
        for (int q = 0; q < NP; ++q)
          for (int h = 0; h < kChains; ++h)
            prefetch_l2(reinterpret_cast<const char*>(w_at[q].panel + 2 * (i + h) * kNR) +
                        ahead);
#pragma GCC unroll 2
      for (int h = 0; h < kChains; ++h) step(i + h, h);
    }
  };
  // kPrefetchBytes ahead; from the pair whose line ahead is past the panel's end, the lines are
  // the next NP panels'. With `next` (a tile after the first), the next NP panels' whole.
  const int64_t bytes = w_at[0].bytes;
  if (w_at[0].next > 0) {
    pairs_to(npairs, w_at[0].next);
  } else {
    const int64_t within = std::max<int64_t>(0, (bytes - kPrefetchBytes) / 64);
    pairs_to(std::min(npairs, within), kPrefetchBytes);
    pairs_to(npairs, kPrefetchBytes + (NP - 1) * bytes);
  }
  for (; i < npairs; ++i) step(i, 0);  // an odd pair left by two chains
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
    for (int q = 0; q < NP; ++q) {
      __m512 sum = acc[0][r][q];
      if (kChains == 2) sum = _mm512_add_ps(sum, acc[kChains - 1][r][q]);
      _mm512_storeu_ps(c + q * kDotMR * kNR + r * kNR, sum);
    }
}

template <bool Fma, int... MRs>
void dot_tile_rows(int rows, int np, const void* xp, const PanelPairs* w_at,
                   int64_t K, float* c, std::integer_sequence<int, MRs...>) {
  auto one = [&](auto mr) {
    constexpr int MR = decltype(mr)::value;
    if constexpr (MR <= kDotMR) {
      if (np == 2) return dot_tile<MR, 2, Fma>(xp, rows, w_at, K, c);
    }
    dot_tile<MR, 1, Fma>(xp, rows, w_at, K, c);
  };
  ((rows == MRs + 1 ? one(std::integral_constant<int, MRs + 1>{}) : void()), ...);
}

// np (1 or 2) panels from p times rows [m0, m1) of x (as pack_pairs packed it, xp). Up to
// kOnTheFlyRows rows (a decode batch) every tile interleaves the panels' row pairs as it reads
// them, so reading the weights from memory overlaps the dot products (interleaving them first,
// in a pass of its own, made 16 rows 1.5x slower); with more rows each panel is interleaved once
// into `scratch` (K * 16 values a panel) and read by every tile of kDotMR rows.
using BF16 = c10::BFloat16;
// With `paired` weights (pairs layout) the tiles read the pairs from the weights themselves.
// Given xf (xp widened: widen_pairs) the tiles multiply on float32 FMAs (fma_min_rows).
void dot_panel_rows(const Problem& pb, const uint32_t* xp, const float* xf, const BF16* panels,
                    bool paired,
                    int64_t p, int np, int64_t m0, int64_t m1, const BF16* bias,
                    const BF16* residual, BF16* out, std::vector<float>& scratch,
                    int64_t dot_tw = kDotMR) {
  const int64_t npairs = (pb.K + 1) / 2;
  PanelPairs w_at[2];
  const bool prefetch = pb.M > kOneStreamRows || stream_prefetch();  // few: one stream (dot_tile)
  const int64_t stride = paired ? npairs * 2 * kNR : pb.K * kNR;  // values a panel
  for (int q = 0; q < np; ++q) {
    const BF16* panel = panels + (p + q) * stride;
    w_at[q] = {panel, paired ? reinterpret_cast<const __m512i*>(panel) : nullptr, pb.K, prefetch,
               stride * static_cast<int64_t>(sizeof(BF16))};
  }
  if (!paired && m1 - m0 > kOnTheFlyRows) {
    scratch.resize(np * npairs * 16 + 16);  // 64-byte pairs, 16 floats each, room to align
    auto* pairs = reinterpret_cast<__m512i*>(
        (reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    for (int q = 0; q < np; ++q) {
      for (int64_t i = 0; i < npairs; ++i)
        _mm512_store_si512(pairs + q * npairs + i, (__m512i)w_at[q](i));
      w_at[q].pairs = pairs + q * npairs;
      w_at[q].prefetch = false;
    }
  }
  float c[2 * kDotMR * kNR];
  static_assert(kFmaMR * kNR <= 2 * kDotMR * kNR);
  const int64_t tile = xf != nullptr ? kFmaMR : dot_tw;
  // The tile products of rows m.. (rows of them) by n panels from w: x's pairs packed (xp, the
  // dot products) or widened (xf, float32 FMAs).
  auto tiles = [&](int rows, int n, const PanelPairs* w, int64_t m, auto mrs) {
    if (xf == nullptr) return dot_tile_rows<false>(rows, n, xp + m * npairs, w, pb.K, c, mrs);
    dot_tile_rows<true>(rows, n, xf + 2 * m * npairs, w, pb.K, c, mrs);
  };
  for (int64_t m = m0; m < m1; m += tile) {
    const int rows = static_cast<int>(std::min<int64_t>(tile, m1 - m));
    // The first tile reads the panels from memory, the later ones from L2 (a pair of panels is
    // 36-98 KB): the second prefetches, line for line as it goes, the np panels the walk reads
    // next, so that memory works under every tile instead of the first alone (which then finds
    // its lines in L2). Measured before 9-16 rows became one tile (run_dot): AMD Zen 4, the 121
    // products of a decode step, two threads, in one process with it on and off alternating
    // (12 rounds): 16 rows 0.950x the time (11 lower), 32 rows 0.970x; a whole decode step of 16
    // rows x 576 positions 0.968-0.986x. It now serves 17-32 rows.
    if (paired && prefetch)
      for (int q = 0; q < np; ++q) w_at[q].next = m == m0 + tile ? np * w_at[q].bytes : 0;
    if (rows > kDotMR) {  // more rows than two panels' sums fit in registers: one panel at a time
      for (int q = 0; q < np; ++q) {
        tiles(rows, 1, w_at + q, m, std::make_integer_sequence<int, kFmaMR>{});
        store_tile(c, rows, m, (p + q) * kNR, pb, bias, residual, out);
      }
      continue;
    }
    tiles(rows, np, w_at, m, std::make_integer_sequence<int, kDotMR>{});
    for (int q = 0; q < np; ++q)
      store_tile(c + q * kDotMR * kNR, rows, m, (p + q) * kNR, pb, bias, residual, out);
  }
}

// x's rows as the tiles read them: 32-bit pairs (x[2i], x[2i + 1]), an odd K's last one
// (x[K - 1], 0); in tiles of `tw` rows, the tile of rows m.. at m * npairs, pair-major
// ([npairs][the tile's rows]), so that a tile finds each pair of all its rows at one pointer and
// constant offsets. With x's rows read in place (ldx apart) the 8 x 2 tile kept 8 row pointers,
// and the compiler spilled them and the loop bounds to the stack or vector registers. Packed,
// the inner loop holds no spills; AMD Zen 4, two threads, alternating processes of
// bench_tkg_step.py --batches 1 8 16 --lengths 576 (10 rounds): 16 rows 0.989x the step time
// (lower in 8 of 10 rounds), 8 rows 1.008x, 1 row 0.987x (one row with an even K is not
// copied); one thread, one product of 16 x 576 by 576 x 3072 with the weights in L2: 200 ->
// 209 GFLOPS (the dot products' peak here: 234). 512 rows (a prefill's products) 0.99x.
const uint32_t* pack_pairs(const BF16* x, int64_t M, int64_t K, std::vector<uint32_t>& buf,
                           int64_t tw = kDotMR) {
  const int64_t npairs = (K + 1) / 2;
  if (M == 1 && K % 2 == 0) return reinterpret_cast<const uint32_t*>(x);  // already so
  if (buf.size() < static_cast<size_t>(M * npairs)) buf.resize(M * npairs);  // (never shrunk)
  auto pack_tile = [&](int64_t m) {
    const int64_t rows = std::min<int64_t>(tw, M - m);
    uint32_t* dst = buf.data() + m * npairs;
    int64_t i0 = 0;
    if (rows % kDotMR == 0) {  // 8 pairs of 8 rows at a time: an 8 x 8 transpose of 32-bit values
      for (; i0 + 8 <= K / 2; i0 += 8)
        for (int64_t g = 0; g < rows; g += kDotMR) {
          __m256 r[8], t[8];
          for (int j = 0; j < 8; ++j)
            r[j] = _mm256_loadu_ps(reinterpret_cast<const float*>(x + (m + g + j) * K + 2 * i0));
          for (int j = 0; j < 8; j += 2) {
            t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
            t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
          }
          for (int j = 0; j < 8; j += 4) {
            r[j] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(1, 0, 1, 0));
            r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], _MM_SHUFFLE(3, 2, 3, 2));
            r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(1, 0, 1, 0));
            r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], _MM_SHUFFLE(3, 2, 3, 2));
          }
          float* out = reinterpret_cast<float*>(dst + i0 * rows + g);
          for (int j = 0; j < 4; ++j) {
            _mm256_storeu_ps(out + j * rows, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
            _mm256_storeu_ps(out + (j + 4) * rows, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
          }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const c10::BFloat16* row = x + (m + r) * K;
      for (int64_t i = i0; i < K / 2; ++i) std::memcpy(dst + i * rows + r, row + 2 * i, 4);
      if (K % 2 != 0) dst[(npairs - 1) * rows + r] = row[K - 1].x;
    }
  };
  const int64_t tiles = (M + tw - 1) / tw;
  if (M <= kOnTheFlyRows) {
    for (int64_t t = 0; t < tiles; ++t) pack_tile(t * tw);
  } else {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) pack_tile(t * tw);
    });
  }
  return buf.data();
}

// Whether run_dot's threads each make x's pairs for themselves (x_for_this_thread): a decode
// batch's rows (up to kOnTheFlyRows) on the bf16 dot products.
bool packs_per_thread(int64_t M) {
  return M <= kOnTheFlyRows && !(fma_min_rows() > 0 && M >= fma_min_rows()) &&
         x_per_thread_setting().load(std::memory_order_relaxed);
}

// x's rows, first RMS-normed by `norm` where given (rms_norm's arithmetic), packed as the tiles
// read them (pack_pairs), in buffers of the calling thread that only grow. Each thread of a
// decode batch's product makes them for itself as it starts its part. Until session 63 they were
// made on the calling thread before the parallel region, in a fresh (zero-filled) buffer, and
// the norm in a tensor of its own, while the other thread waited: perf of a 16-row step on AMD
// Zen 4 (two threads, 21.5 ms) put ~0.9 ms of the calling thread's lone work there (the zero
// fills 0.4, the norm 0.3, the packing 0.2). Each thread still norms and packs all the rows, so
// what goes is the fills, the allocations and the norm's own output: the step, in one process
// with the two alternating (bench/ab_tkg_step.py --without x-per-thread, 160-240 steps each),
// 16 rows x 576 positions 0.27 and 0.19 ms shorter in two runs (~1%), 4 and 8 rows 0.07-0.08 ms,
// 1 row 0.02-0.2 ms; one thread even (0.08 / -0.11 ms). The same bits either way.
const uint32_t* x_for_this_thread(const BF16* x, const BF16* norm, float eps, int64_t M,
                                  int64_t K, int64_t tw) {
  thread_local std::vector<BF16> normed;
  thread_local std::vector<uint32_t> packed;
  if (norm != nullptr) {
    if (normed.size() < static_cast<size_t>(M * K)) normed.resize(M * K);
    nxdi_fused::rms_norm_here(x, norm, normed.data(), M, K, eps);
    x = normed.data();
  }
  return pack_pairs(x, M, K, packed, tw);
}

// With `norm` (given only where panel_linear found packs_per_thread) x's rows are RMS-normed by
// it (eps) first, in each thread; a norm decides per_thread by itself, so that the switch
// flipped between panel_linear's look and this one cannot leave the norm undone.
void run_dot(const Problem& pb, const BF16* x, const BF16* norm, float eps, const BF16* panels,
             bool paired, const BF16* bias, const BF16* residual, BF16* out) {
  const int step = pb.M <= kOneStreamRows ? 1 : 2;  // few rows: one panel at a time (dot_tile)
  const bool fma = fma_min_rows() > 0 && pb.M >= fma_min_rows();
  const bool per_thread = norm != nullptr || packs_per_thread(pb.M);
  std::vector<uint32_t> packed;
  std::vector<float> widened;
  // 9-16 rows: one tile of all of them a panel (16 sums), each panel read once; more rows: 8 x 2
  // tiles. Up to session 60 every batch ran 8 x 2 tiles, so that 16 rows read each pair of panels
  // twice, the second time from L2 with memory idle. AMD Zen 4, the 121 products of a decode step,
  // two threads, in one process with the two alternating (12 rounds): 16 rows 0.943x and 0.978x
  // the time in two runs, 12 rows 0.924x; a whole decode step of 576 positions 0.976x at 16 rows
  // (12 rounds of 12 lower), 0.980x at 12; 24 and 32 rows as 16-row tiles 0.996-0.997x (not
  // taken). The same sums in the same order: the same bits.
  const int64_t dot_tw = !fma && pb.M > kDotMR && pb.M <= kFmaMR ? kFmaMR : kDotMR;
  const uint32_t* xp = fma || per_thread ? nullptr : pack_pairs(x, pb.M, pb.K, packed, dot_tw);
  const float* xf = fma ? widen_rows(x, pb.M, pb.K, widened) : nullptr;
  const int64_t tile = fma ? kFmaMR : dot_tw;
  struct Chunk {
    std::vector<float> buf;
    const uint32_t* xp = nullptr;  // per_thread: this thread's pairs, once it has made them
  };
  for_each_task<Chunk>(pb, sizeof(BF16), tile, step, [&](int64_t p, int np, int64_t m0,
                                                         int64_t m1, Chunk& chunk) {
    std::optional<FlushSubnormals> flush;
    if (fma) flush.emplace();
    if (per_thread && chunk.xp == nullptr)
      chunk.xp = x_for_this_thread(x, norm, eps, pb.M, pb.K, dot_tw);
    dot_panel_rows(pb, per_thread ? chunk.xp : xp, xf, panels, paired, p, np, m0, m1, bias,
                   residual, out, chunk.buf, dot_tw);
  });
}
#endif  // __AVX512BF16__

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// bfloat16 x times bfloat16 pairs with AMX tiles (Intel Sapphire Rapids and later). The pairs
// layout is already the layout of an AMX B tile: 16 rows of 64 bytes, row i holding the pair
// (W[j, 2i], W[j, 2i + 1]) for the 16 outputs j of a panel, so 32 inputs of one panel are one
// tile loaded straight from the weights (stride 64) and 16 or fewer rows of x by 32 inputs are
// an A tile loaded straight from x (stride 2K). A block of up to 32 rows times two panels is two
// A tiles, two B tiles and four float32 C tiles (tiles 4-5, 6-7 and 0-3): each weight tile
// serves 32 rows, each x tile 32 outputs. tdpbf16ps sums pairs of exact products into float32
// sums, as vdpbf16ps does (run_dot), so the result rounds as that path's does (the order of the
// sums differs, so not bit for bit).
//
// Linux hands a process the tile state only on request (arch_prctl(ARCH_REQ_XCOMP_PERM)); where
// that is refused the dot-product path runs. The tile configuration is a thread's state that
// oneDNN (packed linear weights, the causal attention's brgemm) also sets, so each parallel chunk
// loads ours and releases the tiles when it is done.
constexpr int kAmxRows = 16;      // rows of an A / C tile
constexpr int kAmxK = 32;         // bfloat16 inputs of an A tile row / pairs of a B tile x 2
constexpr int kAmxBlockRows = 2 * kAmxRows;

bool amx_granted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// Rows from which a product runs on AMX tiles (NXDI_PANEL_AMX_MIN_ROWS, read once; 0 turns the
// tiles off, for comparisons): below it the dot-product path. By default every product: on the
// Intel VM (2 vCPUs, two threads, bench/bench_projections.py) a decode step's 121 products took
// 10.9-11.1 ms on the tiles at one row, 12.1-13.6 on the dot products, 15.1-15.3 with
// oneDNN-packed weights; at 16 rows 12.3, 27.4 and 15.8-15.9 ms.
int64_t amx_min_rows() {
  static const int64_t rows = [] {
    const char* env = std::getenv("NXDI_PANEL_AMX_MIN_ROWS");
    return env != nullptr ? std::max<int64_t>(0, std::atoll(env)) : int64_t{1};
  }();
  return rows;
}

bool amx_tiles_run() { return amx_min_rows() > 0 && amx_granted(); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles for an A block of r0 + r1 rows (r1 = 0: one A tile) times two panels.
void configure_tiles(int r0, int r1) {
  TileConfig cfg;
  auto set = [&](int t, int rows) { cfg.rows[t] = static_cast<uint8_t>(rows); cfg.colsb[t] = 64; };
  set(0, r0); set(1, r0); set(4, r0);       // C00, C01, A0
  if (r1 > 0) { set(2, r1); set(3, r1); set(5, r1); }  // C10, C11, A1
  set(6, kAmxRows); set(7, kAmxRows);       // B0, B1: 16 pairs of rows
  _tile_loadconfig(&cfg);
}

// c[q][r * 16 + j] (q < 2 panels, r < rows <= 32, c[q] at c + q * 32 * 16) = x rows times the
// panels; `tail_a` and `tail_b` are scratch for the last K % 32 inputs, zero-padded.
// With `prefetch` (run_amx: up to kAmxBlockRows rows where stream_prefetch()) each step
// prefetches (prefetcht0) both panels' 16 lines kStreamBytes ahead of its B tiles; past p0's end
// that line is the next pair's (p0's goes to p1 + panel, p1's to the panel after it), which the
// walk reads next, as dot_tile's do. On the Intel VM with AMX (family 6, session 55) the 121
// products of a decode step (pairs, two threads, in one process with panel_prefetch on and off
// alternating, 10 rounds): 1 row 0.956x the time, 2 rows 0.955x, 4 rows 0.939x; prefetching
// into the panel itself past its end (the line p1 reads now) gained about half of that. Swept
// (alternating processes): 2 KB and 8 KB ahead 1.05-1.08x the time of 4 KB, 16 KB 1.1-1.3x,
// prefetcht1 1.06x. From 8 rows on it was a coin flip then (8 rows 0.97-0.99x, 16 rows 1.00x,
// 32 rows 0.94-0.97x, 64 rows 1.07x) and up to 4 rows prefetched. Session 57, the same VM, the
// products alone in one process (12 rounds, two threads): 8 rows 0.938x, 16 rows 0.945-0.963x
// (three runs), 32 rows 0.926-0.938x, 40 rows 0.999x, 64 rows 1.075x, 96 rows 1.09x; one thread
// 16 rows 0.950x. A standalone loop of these tiles from memory (bench/amx_tile_stream.cpp, one
// thread, 64 MB of B tiles) read 23.7 GB/s at 16 rows without the prefetch and 28.1 with it
// (27.1 and 28.6 at one row), and 27.7-28.9 against 29.4-29.5 in three alternating pairs an
// hour later: a 16-row tdpbf16ps (twice a 1-row one's time in L1) holds up the next tile loads
// unless they are on their way. So up to one block of rows (32: the whole product in one pass
// over the panels) prefetches; with more the panels are read again for each 32 rows, from the
// caches.
template <bool TwoA, bool TwoB>
void amx_block(const BF16* x, int64_t K, const BF16* p0, const BF16* p1, int rows, float* c,
               BF16* tail_a, BF16* tail_b, bool prefetch) {
  const int64_t ldx = K * static_cast<int64_t>(sizeof(BF16));
  _tile_zero(0); _tile_zero(1);
  if (TwoA) { _tile_zero(2); _tile_zero(3); }
  const int64_t full = K / kAmxK * kAmxK;
  const int64_t panel_bytes = (K + 1) / 2 * 2 * kNR * static_cast<int64_t>(sizeof(BF16));
  for (int64_t k = 0; k < full; k += kAmxK) {
    if (prefetch) {
      int64_t ahead = k * kNR * static_cast<int64_t>(sizeof(BF16)) + kStreamBytes;
      if (TwoB && ahead >= panel_bytes) ahead += panel_bytes;
      const char* a0 = reinterpret_cast<const char*>(p0) + ahead;
      const char* a1 = reinterpret_cast<const char*>(p1) + ahead;
#pragma GCC unroll 16
      for (int l = 0; l < 16; ++l) {
        prefetch_l1(a0 + 64 * l);
        if (TwoB) prefetch_l1(a1 + 64 * l);
      }
    }
    _tile_loadd(6, p0 + k * kNR, 64);  // pairs k / 2 .. k / 2 + 15: 32 values a pair row
    if (TwoB) _tile_loadd(7, p1 + k * kNR, 64);
    _tile_loadd(4, x + k, ldx);
    _tile_dpbf16ps(0, 4, 6);
    if (TwoB) _tile_dpbf16ps(1, 4, 7);
    if (TwoA) {
      _tile_loadd(5, x + kAmxRows * K + k, ldx);
      _tile_dpbf16ps(2, 5, 6);
      if (TwoB) _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (full < K) {  // the last K - full inputs, zero-padded to a whole tile
    const int64_t rest = K - full, rest_pairs = (rest + 1) / 2;
    std::memset(tail_a, 0, kAmxBlockRows * kAmxK * sizeof(BF16));
    for (int r = 0; r < rows; ++r)
      std::memcpy(tail_a + r * kAmxK, x + r * K + full, rest * sizeof(BF16));
    std::memset(tail_b, 0, 2 * kAmxRows * 2 * kNR * sizeof(BF16));
    std::memcpy(tail_b, p0 + full * kNR, rest_pairs * 2 * kNR * sizeof(BF16));
    if (TwoB)
      std::memcpy(tail_b + kAmxRows * 2 * kNR, p1 + full * kNR,
                  rest_pairs * 2 * kNR * sizeof(BF16));
    _tile_loadd(6, tail_b, 64);
    if (TwoB) _tile_loadd(7, tail_b + kAmxRows * 2 * kNR, 64);
    _tile_loadd(4, tail_a, kAmxK * sizeof(BF16));
    _tile_dpbf16ps(0, 4, 6);
    if (TwoB) _tile_dpbf16ps(1, 4, 7);
    if (TwoA) {
      _tile_loadd(5, tail_a + kAmxRows * kAmxK, kAmxK * sizeof(BF16));
      _tile_dpbf16ps(2, 5, 6);
      if (TwoB) _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kC = kNR * sizeof(float);
  _tile_stored(0, c, kC);
  if (TwoB) _tile_stored(1, c + kAmxBlockRows * kNR, kC);
  if (TwoA) {
    _tile_stored(2, c + kAmxRows * kNR, kC);
    if (TwoB) _tile_stored(3, c + kAmxBlockRows * kNR + kAmxRows * kNR, kC);
  }
}

// One parallel chunk's AMX state: the C tiles' and the K tail's scratch, and the rows the loaded
// tile configuration is for (-1: none yet); the tiles are released when the chunk ends.
struct AmxChunk {
  alignas(64) float c[2 * kAmxBlockRows * kNR];
  alignas(64) BF16 tail_a[kAmxBlockRows * kAmxK];
  alignas(64) BF16 tail_b[2 * kAmxRows * 2 * kNR];
  int configured = -1;
  ~AmxChunk() {
    if (configured >= 0) _tile_release();
  }
  void configure(int rows) {
    if (rows == configured) return;
    configure_tiles(std::min(rows, kAmxRows), std::max(rows - kAmxRows, 0));
    configured = rows;
  }
};

void run_amx(const Problem& pb, const BF16* x, const BF16* pairs, const BF16* bias,
             const BF16* residual, BF16* out) {
  const int64_t stride = (pb.K + 1) / 2 * 2 * kNR;  // values a panel
  const bool prefetch = pb.M <= kAmxBlockRows && stream_prefetch() &&
                        prefetch_setting().load(std::memory_order_relaxed);
  for_each_task<AmxChunk>(pb, sizeof(BF16), kAmxBlockRows, 2, [&](int64_t p, int np, int64_t m0,
                                                                  int64_t m1, AmxChunk& ch) {
    const BF16* p0 = pairs + p * stride;
    for (int64_t m = m0; m < m1; m += kAmxBlockRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kAmxBlockRows, m1 - m));
      ch.configure(rows);
      const BF16* xm = x + m * pb.K;
      const bool two_a = rows > kAmxRows;
      if (np == 2)
        (two_a ? amx_block<true, true> : amx_block<false, true>)(xm, pb.K, p0, p0 + stride, rows,
                                                                 ch.c, ch.tail_a, ch.tail_b,
                                                                 prefetch);
      else
        (two_a ? amx_block<true, false> : amx_block<false, false>)(xm, pb.K, p0, p0, rows, ch.c,
                                                                   ch.tail_a, ch.tail_b, prefetch);
      for (int q = 0; q < np; ++q)
        store_tile_rows16(ch.c + q * kAmxBlockRows * kNR, rows, m, (p + q) * kNR, pb, bias,
                          residual, out);
    }
  });
}
#endif  // AMX

template <typename F>
void dispatch_16_or_32(at::ScalarType type, const char* what, const char* allowed, F&& f) {
  switch (type) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(c10::BFloat16{});
    case at::kHalf: return f(c10::Half{});
    default: TORCH_CHECK(false, "panel_linear: ", what, " dtype ", type,
                         " is not supported (", allowed, ")");
  }
}

// Whether panel_linear leaves x's RMSNorm to run_dot's threads: where run_dot runs the product
// with per-thread pairs (packs_per_thread; not on AMX tiles) and the norm's weight is what
// rms_norm takes (else rms_norm_of runs first, and reports a bad weight).
bool fused_norm_suits(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& norm) {
#if defined(__AVX512BF16__)
  if (x.dim() < 1 || x.size(-1) == 0 || x.scalar_type() != at::kBFloat16 ||
      panels.scalar_type() != at::kBFloat16 || norm.dim() != 1 || norm.size(0) != x.size(-1) ||
      norm.scalar_type() != at::kBFloat16 || !norm.is_contiguous())
    return false;
  const int64_t M = x.numel() / x.size(-1);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const bool paired = panels.dim() == 3 && panels.size(2) == 2 * kNR;
  if (paired && M >= amx_min_rows() && amx_tiles_run()) return false;
#endif
  return M > 0 && packs_per_thread(M);
#else
  return false;
#endif
}

// x [..., K] -> [..., out_features] in x's dtype: x @ (W * scale)^T (+ bias) (+ residual), W
// given as panels [P, K, 16] (pack_panels) with P = ceil(out_features / 16); scale ([1] or
// [out_features], any floating dtype) is required for int8 panels, optional for the others.
// With `norm` (an RMSNorm's weight [K]) x's rows are first normalized as nxdi::rms_norm does
// (the same code, eps its epsilon): a norm and the product it feeds as one graph node. In a
// decode step 61 of its rms_norm nodes go, each ~2.2 us in the profile plus the interpreter's
// own cost (the Intel VM with AMX, session 56).
at::Tensor panel_linear(const at::Tensor& x_arg, const at::Tensor& panels_in, int64_t out_features,
                        const std::optional<at::Tensor>& bias_in,
                        const std::optional<at::Tensor>& residual_in,
                        const std::optional<at::Tensor>& scale_in,
                        const std::optional<at::Tensor>& norm_in, double eps) {
  const bool paired = panels_in.dim() == 3 && panels_in.size(2) == 2 * kNR;
  // The norm in run_dot's threads (x_for_this_thread) where it runs the product at all.
  const bool norm_in_threads = norm_in.has_value() && fused_norm_suits(x_arg, panels_in, *norm_in);
  const at::Tensor x_in = norm_in.has_value() && !norm_in_threads
                              ? nxdi_fused::rms_norm_of(x_arg, *norm_in, eps) : x_arg;
  TORCH_CHECK(panels_in.dim() == 3 && (panels_in.size(2) == kNR || paired),
              "panel_linear: panels must be [P, K, 16] or bfloat16 pairs [P, ceil(K / 2), 32], "
              "got ", panels_in.sizes());
  TORCH_CHECK(!paired || panels_in.scalar_type() == at::kBFloat16,
              "panel_linear: only bfloat16 panels come in pairs, got ", panels_in.scalar_type());
  const int64_t P = panels_in.size(0);
  const int64_t K = paired ? (x_in.dim() >= 1 ? x_in.size(-1) : -1) : panels_in.size(1);
  if (paired) {
    TORCH_CHECK(K >= 0 && (K + 1) / 2 == panels_in.size(1), "panel_linear: x must be [..., ",
                2 * panels_in.size(1) - 1, "] or [..., ", 2 * panels_in.size(1),
                "] for pairs of ", panels_in.size(1), " rows, got ", x_in.sizes());
  } else {
    TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) == K, "panel_linear: x must be [..., ", K,
                "], got ", x_in.sizes());
  }
  TORCH_CHECK(out_features > 0 && (out_features + kNR - 1) / kNR == P, "panel_linear: ", P,
              " panels cannot hold ", out_features, " outputs");
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = out_features;
  at::Tensor out = at::empty(out_shape, x_in.options());
  at::Tensor scale;
  if (scale_in.has_value()) {
    const int64_t n = scale_in->dim() == 1 ? scale_in->size(0) : -1;
    TORCH_CHECK((n == 1 || n == out_features) && scale_in->is_floating_point(),
                "panel_linear: scale must be a floating [1] or [", out_features, "], got ",
                scale_in->scalar_type(), " ", scale_in->sizes());
    scale = scale_in->to(at::kFloat).expand({out_features}).contiguous();
  }
  TORCH_CHECK(panels_in.scalar_type() != at::kChar || scale.defined(),
              "panel_linear: int8 panels need a scale");
  const Problem pb{K ? x_in.numel() / K : 0, K, out_features, P,
                   scale.defined() ? scale.const_data_ptr<float>() : nullptr};
  at::Tensor panels = panels_in.contiguous();
  at::Tensor bias, residual;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == out_features &&
                bias.scalar_type() == x_in.scalar_type(),
                "panel_linear: bias must be [", out_features, "] in x's dtype");
  }
  if (residual_in.has_value()) {
    residual = residual_in->contiguous();
    TORCH_CHECK(residual.sizes() == out.sizes() && residual.scalar_type() == x_in.scalar_type(),
                "panel_linear: residual must be ", out.sizes(), " in x's dtype");
  }
  if (pb.M == 0) return out;
#if defined(__AVX512BF16__)
  if (x_in.scalar_type() == at::kBFloat16 && panels.scalar_type() == at::kBFloat16) {
    const at::Tensor xb = x_in.contiguous();
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (paired && pb.M >= amx_min_rows() && amx_tiles_run()) {
      run_amx(pb, xb.const_data_ptr<BF16>(), panels.const_data_ptr<BF16>(),
              bias.defined() ? bias.const_data_ptr<BF16>() : nullptr,
              residual.defined() ? residual.const_data_ptr<BF16>() : nullptr,
              out.mutable_data_ptr<BF16>());
      return out;
    }
#endif
    run_dot(pb, xb.const_data_ptr<BF16>(),
            norm_in_threads ? norm_in->const_data_ptr<BF16>() : nullptr, static_cast<float>(eps),
            panels.const_data_ptr<BF16>(), paired,
            bias.defined() ? bias.const_data_ptr<BF16>() : nullptr,
            residual.defined() ? residual.const_data_ptr<BF16>() : nullptr,
            out.mutable_data_ptr<BF16>());
    return out;
  }
#endif
  if (paired)  // back to [P, K, 16] for the paths below
    panels = panels.view({P, panels.size(1), kNR, 2}).transpose(2, 3)
                 .reshape({P, 2 * panels.size(1), kNR}).narrow(1, 0, K).contiguous();
  const at::Tensor xf = x_in.to(at::kFloat).contiguous();
  dispatch_16_or_32(x_in.scalar_type(), "x", "float32, bfloat16, float16", [&](auto t) {
    using T = decltype(t);
    auto multiply = [&](auto w) {
      using W = decltype(w);
      run<T, W>(pb, xf.const_data_ptr<float>(), panels.const_data_ptr<W>(),
                bias.defined() ? bias.const_data_ptr<T>() : nullptr,
                residual.defined() ? residual.const_data_ptr<T>() : nullptr,
                out.mutable_data_ptr<T>());
    };
    if (panels.scalar_type() == at::kChar)
      multiply(int8_t{});
    else
      dispatch_16_or_32(panels.scalar_type(), "weight", "float32, bfloat16, float16, int8",
                        multiply);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nxdi, m) {
  // True where bfloat16 products run on the CPU's dot products, the layout pairs are made for.
  m.def("panel_pairs_native() -> bool", [] {
#if defined(__AVX512BF16__)
    return true;
#else
    return false;
#endif
  });
  // True where bfloat16 pairs are multiplied on AMX tiles (built for them, and granted the tile
  // state by Linux).
  m.def("panel_amx_tiles() -> bool", [] {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return amx_tiles_run();
#else
    return false;
#endif
  });
  // True where panels read in place prefetch their stream (stream_prefetch).
  m.def("panel_stream_prefetch() -> bool", [] { return stream_prefetch(); });
  // Rows from which bfloat16 products run on float32 FMAs (0: never; NXDI_PANEL_FMA_MIN_ROWS).
  m.def("panel_fma_min_rows() -> int", [] {
#if defined(__AVX512BF16__)
    return fma_min_rows();
#else
    return int64_t{0};
#endif
  });
  // Whether run's tiles prefetch (panel_rows: a widened panel's next one, and where
  // panel_stream_prefetch() a panel read in place); `on` 0 or 1 sets it first (A/B runs).
  m.def("panel_prefetch(int on=-1) -> bool", [](int64_t on) {
    if (on >= 0) prefetch_setting().store(on != 0);
    return prefetch_setting().load();
  });
  m.def("panel_x_per_thread(int on=-1) -> bool", [](int64_t on) {
    if (on >= 0) x_per_thread_setting().store(on != 0);
    return x_per_thread_setting().load();
  });
  m.def("panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias=None, "
        "Tensor? residual=None, Tensor? scale=None, Tensor? norm=None, float eps=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(nxdi, CPU, m) { m.impl("panel_linear", &panel_linear); }
