// Design spike (bench/spike_transposed_k.py; not used by the services): decode attention's K
// pass alone, the scores of B rows x 9 query heads (3 KV heads, 3 queries each, head_dim 64,
// bf16) over L positions of 16-token blocks, in two cache layouts:
// rows: the cache as it is, [block][16 positions][Hkv][64]: the K tile copied, then per query
// 16 dot products of 16 lanes summed across lanes (kernels/paged_attention.cpp's way);
// transposed: [block][Hkv][32 dim pairs][16 positions] of bf16 pairs: each query's pair
// broadcast against a row of 16 positions, the scores straight out of vdpbf16ps.
#include <torch/extension.h>
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <vector>
using BF16 = c10::BFloat16;
static inline __m512 sum_lanes16(const __m512 (&a)[16]) {
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88), _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}
constexpr int H = 9, HKV = 3, D = 64, BS = 16, G = 3;
// cache: [nb][16][3][64] bf16 (rows) or [nb][3][32][16][2] (transposed); table [B][W]; q [B][9][64]
torch::Tensor kpass(torch::Tensor q, torch::Tensor cache, torch::Tensor table, int64_t L, bool transposed) {
  const int64_t B = q.size(0), W = table.size(1);
  auto out = torch::empty({B, H, L}, torch::kFloat);
  const BF16* qp = q.data_ptr<BF16>(); const BF16* kp = cache.data_ptr<BF16>();
  const int64_t* tp = table.data_ptr<int64_t>(); float* op = out.data_ptr<float>();
  const float scale = 0.125f;
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) BF16 tile[16 * D];
    for (int64_t b = b0; b < b1; ++b) {
      __m512i qv[H][2];
      for (int h = 0; h < H; ++h) for (int z = 0; z < 2; ++z) qv[h][z] = _mm512_loadu_si512(qp + (b * H + h) * D + 32 * z);
      const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qp + b * H * D);
      for (int64_t blk = 0; blk * BS < L; ++blk) {
        const BF16* base = kp + tp[b * W + blk] * BS * HKV * D;
        const BF16* next = blk + 1 < W ? kp + tp[b * W + blk + 1] * BS * HKV * D : base;
        for (int hk = 0; hk < HKV; ++hk) {
          if (!transposed) {
            for (int o = 0; o < 16; ++o) {
              const BF16* r = base + (o * HKV + hk) * D;
              const char* pf = reinterpret_cast<const char*>(next + (o * HKV + hk) * D);
              __builtin_prefetch(pf, 0, 2); __builtin_prefetch(pf + 64, 0, 2);
              _mm512_store_si512(tile + o * D, _mm512_loadu_si512(r));
              _mm512_store_si512(tile + o * D + 32, _mm512_loadu_si512(r + 32));
            }
            for (int g = 0; g < G; ++g) {
              const int h = hk * G + g;
              __m512 a[16];
              for (int o = 0; o < 16; ++o) {
                __m512 x = _mm512_setzero_ps();
                x = _mm512_dpbf16_ps(x, (__m512bh)qv[h][0], (__m512bh)_mm512_load_si512(tile + o * D));
                x = _mm512_dpbf16_ps(x, (__m512bh)qv[h][1], (__m512bh)_mm512_load_si512(tile + o * D + 32));
                a[o] = x;
              }
              _mm512_storeu_ps(op + (b * H + h) * L + blk * BS, _mm512_mul_ps(sum_lanes16(a), _mm512_set1_ps(scale)));
            }
          } else {
            const BF16* kt = base + hk * 32 * 32;  // [32 pairs][16 pos][2]
            const char* pf = reinterpret_cast<const char*>(next + hk * 32 * 32);
            for (int l = 0; l < 32; ++l) __builtin_prefetch(pf + 64 * l, 0, 2);
            __m512 acc[G][2];
            for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
            for (int p = 0; p < 32; p += 2) {
              const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + p * 32);
              const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + (p + 1) * 32);
              for (int g = 0; g < G; ++g) {
                const uint32_t* qh = q32 + (hk * G + g) * 32;
                acc[g][0] = _mm512_dpbf16_ps(acc[g][0], (__m512bh)_mm512_set1_epi32(qh[p]), k0);
                acc[g][1] = _mm512_dpbf16_ps(acc[g][1], (__m512bh)_mm512_set1_epi32(qh[p + 1]), k1);
              }
            }
            for (int g = 0; g < G; ++g)
              _mm512_storeu_ps(op + (b * H + hk * G + g) * L + blk * BS, _mm512_mul_ps(_mm512_add_ps(acc[g][0], acc[g][1]), _mm512_set1_ps(scale)));
          }
        }
      }
    }
  });
  return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("kpass", &kpass); }
