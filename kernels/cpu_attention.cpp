// CPU decode attention kernels (kernels/cpu_simd.h's vectors): the cascade's shared prefix (bf16 with bf16 dot
// products, or fp32), and attention over listed pages of the paged pool read in place.
// The torch references, the layouts and why: kernels/cpu_attention.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>  // _mm_prefetch

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_attend.h"

namespace {

constexpr int KB = sparrow_attend::KEYS;  // keys per block of the packed key layout

using simd::exp_le0;

// q [H, R, D] bf16; kp [H, S/16, D/2, 16, 2] and vp [H, S/2, D, 2] bf16, or q [H, R, D] fp32; kp [H, S/16, D,
// 16] and vp [H, S, D] fp32 -> out [H, R, D], lse [H, R] fp32
std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q, const at::Tensor& kp,
                                                    const at::Tensor& vp, double scale, int64_t chunks) {
  const bool f32 = q.scalar_type() == at::kFloat;
  const auto dtype = f32 ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == dtype && kp.scalar_type() == dtype && vp.scalar_type() == dtype,
              "prefix_attention: bf16 or fp32 tensors, one dtype");
  TORCH_CHECK(q.is_contiguous() && kp.is_contiguous() && vp.is_contiguous(), "contiguous tensors expected");
  const int H = q.size(0), R = q.size(1), D = q.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head dim 64 or 128 expected");
  TORCH_CHECK(f32 ? kp.dim() == 4 && kp.size(2) == D && kp.size(3) == KB
                  : kp.dim() == 5 && kp.size(2) == D / 2 && kp.size(3) == KB, "packed keys");
  TORCH_CHECK(kp.size(0) == H, "packed keys: one block list per head");
  const int blocks = kp.size(1), S = blocks * KB;
  TORCH_CHECK(f32 ? vp.dim() == 3 && vp.size(1) == S && vp.size(2) == D
                  : vp.dim() == 4 && vp.size(1) * 2 == S && vp.size(2) == D, "packed values");
  const int per = (blocks + std::max<int64_t>(chunks, 1) - 1) / std::max<int64_t>(chunks, 1);
  const int C = (blocks + per - 1) / per;  // every chunk has keys
  auto opts = q.options().dtype(at::kFloat);
  auto part = at::empty({H, C, R, D}, opts), pm = at::empty({H, C, R}, opts), pl = at::empty({H, C, R}, opts);
  float *po = part.data_ptr<float>(), *pmd = pm.data_ptr<float>(), *pld = pl.data_ptr<float>();
  at::parallel_for(0, H * C, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int h = t / C, c = t % C, s0 = c * per * KB, s1 = std::min(S, s0 + per * KB);
      const int64_t head = (int64_t)h * S * D, rows = (int64_t)h * R * D;  // elements of a head's K/V, Q
      if (f32) {
        const float *qh = q.data_ptr<float>() + rows, *kh = kp.data_ptr<float>() + head, *vh = vp.data_ptr<float>() + head;
        auto run = D == 64 ? sparrow_attend::attend<64, float> : sparrow_attend::attend<128, float>;
        run(qh, nullptr, R, kh, vh, s0, s1, (float)scale, po + t * R * D, pmd + t * R, pld + t * R);
      } else {
        const auto* qh = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()) + rows;
        const auto* kh = reinterpret_cast<const uint16_t*>(kp.data_ptr<at::BFloat16>()) + head;
        const auto* vh = reinterpret_cast<const uint16_t*>(vp.data_ptr<at::BFloat16>()) + head;
        auto run = D == 64 ? sparrow_attend::attend<64> : sparrow_attend::attend<128>;
        run(qh, nullptr, R, kh, vh, s0, s1, (float)scale, po + t * R * D, pmd + t * R, pld + t * R);
      }
    }
  });
  auto out = at::empty({H, R, D}, opts), lse = at::empty({H, R}, opts);
  float *od = out.data_ptr<float>(), *ld = lse.data_ptr<float>();
  for (int h = 0; h < H; ++h) {  // merge the chunks by their log-sum-exp
    for (int r = 0; r < R; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int c = 0; c < C; ++c) mx = std::max(mx, pmd[(h * C + c) * R + r]);
      float total = 0.f;
      for (int c = 0; c < C; ++c) total += pld[(h * C + c) * R + r] * std::exp(pmd[(h * C + c) * R + r] - mx);
      float* o = od + (h * R + r) * D;
      std::fill(o, o + D, 0.f);
      for (int c = 0; c < C; ++c) {
        const float w = std::exp(pmd[(h * C + c) * R + r] - mx) / total;
        const float* src = po + ((int64_t)(h * C + c) * R + r) * D;
        for (int d = 0; d < D; ++d) o[d] += w * src[d];
      }
      ld[h * R + r] = mx + std::log(total);
    }
  }
  return {out, lse};
}


inline simd::vf load_f32(const float* x) { return simd::loadu(x); }
inline simd::vf load_f32(const at::BFloat16* x) { return simd::load_bf16(x); }

inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T1);
}

// The scores of G query rows q [G, D] (bf16 values in fp32) against one bf16 page of 16 keys kp [16, D] ->
// s [G][16] (times scale): each key's dot product in D/32 vdpbf16ps steps, the 16 keys' partial sums
// summed across lanes together (one horizontal sum per key cost about three times more).
template <int D>
inline void page_scores_bf16(const simd::vbh (*qb)[D / 32], int G, const at::BFloat16* kp, float scale, simd::vf* s) {
  const auto* k = reinterpret_cast<const uint16_t*>(kp);
  for (int g = 0; g < G; ++g) {
    simd::vf acc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      acc[j] = simd::dpbf16(simd::zero(), qb[g][0], simd::as_bh(simd::loadu_bits(k + j * D)));
#pragma GCC unroll 4
      for (int d = 1; d < D / 32; ++d)
        acc[j] = simd::dpbf16(acc[j], qb[g][d], simd::as_bh(simd::loadu_bits(k + j * D + d * 32)));
    }
    s[g] = simd::mul(simd::sum_lanes16(acc), simd::set1(scale));
  }
}

// One (sequence, KV head): the G query rows q [G, D] fp32 over the valid positions of the logical pages
// `pages` [K] (-1 = none) -> out [G, D] (normalised) and lse [G] fp32, scores times `scale`. Three passes:
// every score (in `scores`, G x K*P), one softmax per row, then the values: a decode row's few hundred
// keys fit in L1/L2, and one softmax costs less than an online rescale per 16 keys. Pages of 16 bf16 keys
// are scored with vdpbf16ps (q is rounded to bf16: exact for a bf16 model's queries).
template <typename T, int D>
void attend_pages(const float* q, int G, const T* k_pages, const T* v_pages, int64_t page_stride,
                  int64_t head_offset, int P, const int32_t* table, int n_table, int seq_len,
                  const int64_t* pages, int K, float scale, float* out, float* lse, std::vector<float>& scores,
                  std::vector<int>& valid) {
  constexpr int DV = D / 16;
  constexpr int GMAX = 16;
  const int width = K * P;  // score slots: page i's positions at i * P
  scores.resize((size_t)G * width + 16);
  valid.resize(K);  // positions per listed page (0: none)
  for (int i = 0; i < K; ++i) {
    const int64_t page = pages[i];
    valid[i] = page < 0 || page >= n_table || table[page] < 0 ? 0 : std::max<int64_t>(0, std::min<int64_t>(P, seq_len - page * P));
  }
  auto page_at = [&](const T* base, int i) { return base + table[pages[i]] * page_stride + head_offset; };
  // the pages are scattered in the pool and mostly not in cache: ask for all their keys and values at once
  // (into L2), so that their misses overlap instead of stalling page after page (5% of a budget-512 step);
  // not when they would not fit in a quarter of L2 (a dense row over a long cache)
  const int64_t page_bytes = (int64_t)P * D * sizeof(T);
  for (int i = 0; i < K && 2 * K * page_bytes <= (256 << 10); ++i)
    if (valid[i]) {
      prefetch_l2(page_at(k_pages, i), page_bytes);
      prefetch_l2(page_at(v_pages, i), page_bytes);
    }
  float m[GMAX];
  for (int g = 0; g < G; ++g) m[g] = -std::numeric_limits<float>::infinity();
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (P == 16) {
      simd::vbh qb[GMAX][D / 32];
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D / 32; ++d)
          qb[g][d] = simd::pack_bf16(simd::loadu(q + g * D + d * 32 + 16), simd::loadu(q + g * D + d * 32));
      simd::vf mx[GMAX], s[GMAX];
      for (int g = 0; g < G; ++g) mx[g] = simd::set1(-std::numeric_limits<float>::infinity());
      for (int i = 0; i < K; ++i) {
        if (!valid[i]) continue;
        const simd::vmask mask = simd::prefix(valid[i]);
        page_scores_bf16<D>(qb, G, page_at(k_pages, i), scale, s);
        for (int g = 0; g < G; ++g) {
          simd::mask_storeu(scores.data() + (size_t)g * width + i * P, mask, s[g]);
          mx[g] = simd::mask_max(mx[g], mask, mx[g], s[g]);
        }
      }
      for (int g = 0; g < G; ++g) m[g] = simd::reduce_max(mx[g]);
    }
  }
  if (!std::is_same_v<T, at::BFloat16> || P != 16) {
    simd::vf qv[GMAX][DV];
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < DV; ++d) qv[g][d] = simd::mul(simd::loadu(q + g * D + d * 16), simd::set1(scale));
    for (int i = 0; i < K; ++i) {  // scores, one key at a time
      if (!valid[i]) continue;
      const T* kp = page_at(k_pages, i);
      for (int j = 0; j < valid[i]; ++j) {
        simd::vf kv[DV];
        for (int d = 0; d < DV; ++d) kv[d] = load_f32(kp + j * D + d * 16);
        for (int g = 0; g < G; ++g) {
          simd::vf dot = simd::mul(qv[g][0], kv[0]);
          for (int d = 1; d < DV; ++d) dot = simd::fmadd(qv[g][d], kv[d], dot);
          const float sc = simd::reduce_add(dot);
          scores[(size_t)g * width + i * P + j] = sc;
          m[g] = std::max(m[g], sc);
        }
      }
    }
  }
  float l[GMAX];
  for (int g = 0; g < G; ++g) {  // probabilities in place, each page's valid positions
    simd::vf sum = simd::zero();
    const simd::vf mv = simd::set1(m[g]);
    for (int i = 0; i < K; ++i)
      for (int j0 = 0; j0 < valid[i]; j0 += 16) {
        const simd::vmask mask = simd::prefix(std::min(16, valid[i] - j0));
        float* sp = scores.data() + (size_t)g * width + i * P + j0;
        const simd::vf pv = simd::maskz_mov(mask, exp_le0(simd::sub(simd::maskz_loadu(mask, sp), mv)));
        simd::mask_storeu(sp, mask, pv);
        sum = simd::add(sum, pv);
      }
    l[g] = simd::reduce_add(sum);
  }
  constexpr int GB = D == 64 ? 4 : 2;  // heads per pass over the values: GB x DV accumulators in registers
  for (int g0 = 0; g0 < G; g0 += GB) {  // (indexed by constants only: GCC spills them to memory otherwise)
    const int gn = std::min(GB, G - g0);
    simd::vf acc[GB][DV];
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g)
#pragma GCC unroll 8
      for (int d = 0; d < DV; ++d) acc[g][d] = simd::zero();
    for (int i = 0; i < K; ++i) {  // values
      if (!valid[i]) continue;
      const T* vp = page_at(v_pages, i);
      const float* p = scores.data() + (size_t)g0 * width + i * P;
      for (int j = 0; j < valid[i]; ++j) {
        simd::vf vv[DV];
#pragma GCC unroll 8
        for (int d = 0; d < DV; ++d) vv[d] = load_f32(vp + j * D + d * 16);
#pragma GCC unroll 4
        for (int g = 0; g < GB; ++g) {
          if (g >= gn) break;
          const simd::vf pj = simd::set1(p[(size_t)g * width + j]);
#pragma GCC unroll 8
          for (int d = 0; d < DV; ++d) acc[g][d] = simd::fmadd(pj, vv[d], acc[g][d]);
        }
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) {
      if (g >= gn) break;
      const float inv = l[g0 + g] > 0.f ? 1.f / l[g0 + g] : 0.f;
#pragma GCC unroll 8
      for (int d = 0; d < DV; ++d)
        simd::storeu(out + (g0 + g) * D + d * 16, simd::mul(acc[g][d], simd::set1(inv)));
    }
  }
  for (int g = 0; g < G; ++g)
    lse[g] = l[g] > 0.f ? m[g] + std::log(l[g]) : -std::numeric_limits<float>::infinity();
}

// q [B, Hq, D] fp32; k/v pages [N, Hkv, P, D] (fp32 or bf16); block_table [B, W] int32; seq_lens [B]
// int32; pages [B, Hkv, K] int64 logical (-1 = none) -> out [B, Hq, D], lse [B, Hq] fp32
std::tuple<at::Tensor, at::Tensor> paged_attention(const at::Tensor& q, const at::Tensor& k_pages,
                                                   const at::Tensor& v_pages, const at::Tensor& block_table,
                                                   const at::Tensor& seq_lens, const at::Tensor& pages,
                                                   double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous fp32 expected");
  TORCH_CHECK(k_pages.scalar_type() == v_pages.scalar_type() && k_pages.is_contiguous() && v_pages.is_contiguous(),
              "k/v pages: contiguous, one dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              pages.scalar_type() == at::kLong && block_table.is_contiguous() && pages.is_contiguous(),
              "block_table/seq_lens int32, pages int64, contiguous");
  const int B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_pages.size(1), P = k_pages.size(2);
  const int G = Hq / Hkv, K = pages.size(2), W = block_table.size(1);
  TORCH_CHECK(D == 64 || D == 128, "head dim 64 or 128 expected");
  TORCH_CHECK(G <= 16 && Hq % Hkv == 0, "at most 16 query heads per KV head");
  auto out = at::empty({B, Hq, D}, q.options()), lse = at::empty({B, Hq}, q.options());
  const float* qd = q.data_ptr<float>();
  float *od = out.data_ptr<float>(), *ld = lse.data_ptr<float>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* pd = pages.data_ptr<int64_t>();
  const int64_t page_stride = (int64_t)Hkv * P * D, head_stride = (int64_t)P * D;
  const bool bf16 = k_pages.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || k_pages.scalar_type() == at::kFloat, "k/v pages: fp32 or bf16");
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    std::vector<int> valid;
    for (int64_t t = t0; t < t1; ++t) {
      const int b = t / Hkv, h = t % Hkv;
      const float* qh = qd + ((int64_t)b * Hq + h * G) * D;
      float* oh = od + ((int64_t)b * Hq + h * G) * D;
      float* lh = ld + (int64_t)b * Hq + h * G;
      const int64_t* ph = pd + ((int64_t)b * Hkv + h) * K;
      const int32_t* tb = table + (int64_t)b * W;
      if (bf16) {
        auto* kd = k_pages.data_ptr<at::BFloat16>();
        auto* vd = v_pages.data_ptr<at::BFloat16>();
        if (D == 64) attend_pages<at::BFloat16, 64>(qh, G, kd, vd, page_stride, h * head_stride, P, tb, W, lens[b], ph, K, (float)scale, oh, lh, scores, valid);
        else attend_pages<at::BFloat16, 128>(qh, G, kd, vd, page_stride, h * head_stride, P, tb, W, lens[b], ph, K, (float)scale, oh, lh, scores, valid);
      } else {
        auto* kd = k_pages.data_ptr<float>();
        auto* vd = v_pages.data_ptr<float>();
        if (D == 64) attend_pages<float, 64>(qh, G, kd, vd, page_stride, h * head_stride, P, tb, W, lens[b], ph, K, (float)scale, oh, lh, scores, valid);
        else attend_pages<float, 128>(qh, G, kd, vd, page_stride, h * head_stride, P, tb, W, lens[b], ph, K, (float)scale, oh, lh, scores, valid);
      }
    }
  });
  return {out, lse};
}

// Softmax attention over two disjoint key sets from each one's output out_a/out_b [N, D] and log-sum-exp
// lse_a/lse_b [N] fp32 -> out [N, D] fp32, row by row in scalar arithmetic (so a row's result does not
// depend on how many rows the call holds, as torch's vectorised loops with scalar tails would).
at::Tensor merge_attention(const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& out_b,
                           const at::Tensor& lse_b) {
  for (const auto* t : {&out_a, &lse_a, &out_b, &lse_b})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "merge_attention: contiguous fp32");
  const int64_t N = lse_a.numel(), D = out_a.numel() / std::max<int64_t>(N, 1);
  TORCH_CHECK(out_b.numel() == N * D && lse_b.numel() == N, "merge_attention: matching shapes");
  auto out = at::empty_like(out_a);
  const float *oa = out_a.data_ptr<float>(), *la = lse_a.data_ptr<float>();
  const float *ob = out_b.data_ptr<float>(), *lb = lse_b.data_ptr<float>();
  float* od = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float hi = std::max(la[n], lb[n]);
    float wa = 0.f, wb = 0.f;
    if (hi > -std::numeric_limits<float>::infinity()) {
      const float lse = hi + std::log(std::exp(la[n] - hi) + std::exp(lb[n] - hi));
      wa = std::exp(la[n] - lse), wb = std::exp(lb[n] - lse);
    }
    for (int64_t d = 0; d < D; ++d) od[n * D + d] = oa[n * D + d] * wa + ob[n * D + d] * wb;
  }
  return out;
}

// Block top-k selection from page scores [B, Hkv, W] fp32 (-inf = not a candidate): per row keep pages
// 0, last-1, last (those that exist) and the n_select best candidates (ties: the lower page first;
// n_select = budget / P - reserved, or every page when budget is 0) -> [B, Hkv, K] int32 logical
// pages sorted ascending, padded with -1, K = max kept over the rows (at least `min_width`).
at::Tensor select_pages(const at::Tensor& scores, const at::Tensor& seq_lens, const at::Tensor& budgets,
                        int64_t page_size, int64_t reserved, int64_t min_width) {
  TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.is_contiguous(), "scores: contiguous fp32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && budgets.scalar_type() == at::kInt, "int32 lengths, budgets");
  const int B = scores.size(0), H = scores.size(1), W = scores.size(2);
  const float* sd = scores.data_ptr<float>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bud = budgets.data_ptr<int32_t>();
  std::vector<std::vector<int32_t>> kept(B * H);
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<std::pair<float, int32_t>> cand;
    std::vector<char> keep(W);
    for (int64_t t = t0; t < t1; ++t) {
      const int b = t / H;
      const int64_t last = (lens[b] - 1) / page_size, n_pages = (lens[b] + page_size - 1) / page_size;
      const int64_t n_select = bud[b] > 0 ? std::max<int64_t>(bud[b] / page_size - reserved, 0) : W;
      const float* row = sd + t * W;
      std::fill(keep.begin(), keep.end(), 0);
      cand.clear();
      for (int j = 0; j < W; ++j) {
        const bool is_reserved = (j == 0 || j == last - 1 || j == last) && j < n_pages;
        if (is_reserved) keep[j] = 1;
        else if (j >= 1 && j <= last - 2 && row[j] > -std::numeric_limits<float>::infinity())
          cand.emplace_back(row[j], j);
      }
      auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      };
      if ((int64_t)cand.size() > n_select) {
        std::nth_element(cand.begin(), cand.begin() + n_select, cand.end(), better);
        cand.resize(n_select);
      }
      for (const auto& c : cand) keep[c.second] = 1;
      auto& out = kept[t];
      out.clear();
      for (int j = 0; j < W; ++j)
        if (keep[j]) out.push_back(j);
    }
  });
  int64_t width = min_width;
  for (const auto& k : kept) width = std::max<int64_t>(width, k.size());
  auto selected = at::full({B, H, width}, -1, scores.options().dtype(at::kInt));
  int32_t* od = selected.data_ptr<int32_t>();
  for (int64_t t = 0; t < B * H; ++t) std::copy(kept[t].begin(), kept[t].end(), od + t * width);
  return selected;
}

template <typename T>
void update_centroid(float* c, const T* key, int64_t D, int64_t off) {
  const float count = static_cast<float>(off + 1);
  for (int64_t d = 0; d < D; ++d) {
    const float x = static_cast<float>(key[d]);
    c[d] = off == 0 ? x : c[d] + (x - c[d]) / count;
  }
}

// One new token per row: k/v [N, Hkv, D] (the pages' dtype) to physical slots [N] int64 (page * P + offset,
// negative = skip) of pages [num_pages, Hkv, P, D], and the page's running mean key in centroids
// [num_pages, Hkv, D] fp32: offset 0 sets it to the key, else c += (k - c) / (offset + 1), the same fp32
// operations as append_kv_reference (so a recomputed sequence gets the same centroids bit for bit).
void append_kv(at::Tensor& k_pages, at::Tensor& v_pages, at::Tensor& centroids, const at::Tensor& k,
               const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous() && centroids.is_contiguous(),
              "pages and centroids: contiguous");
  TORCH_CHECK(centroids.scalar_type() == at::kFloat && slots.scalar_type() == at::kLong, "fp32 centroids, int64 slots");
  TORCH_CHECK(k.scalar_type() == k_pages.scalar_type() && v.scalar_type() == v_pages.scalar_type() &&
              k_pages.scalar_type() == v_pages.scalar_type(), "k/v in the pages' dtype");
  const auto kc = k.contiguous(), vc = v.contiguous(), sc = slots.contiguous();
  const int64_t N = kc.size(0), H = k_pages.size(1), P = k_pages.size(2), D = k_pages.size(3);
  const int64_t row = H * D, page_stride = H * P * D;
  const int64_t* sd = sc.data_ptr<int64_t>();
  float* cd = centroids.data_ptr<float>();
  const size_t bytes = D * k_pages.element_size();
  auto* kd = static_cast<char*>(k_pages.data_ptr());
  auto* vd = static_cast<char*>(v_pages.data_ptr());
  const auto* ks = static_cast<const char*>(kc.data_ptr());
  const auto* vs = static_cast<const char*>(vc.data_ptr());
  const bool bf16 = k_pages.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || k_pages.scalar_type() == at::kFloat, "k/v pages: fp32 or bf16");
  for (int64_t n = 0; n < N; ++n) {
    if (sd[n] < 0) continue;
    const int64_t page = sd[n] / P, off = sd[n] % P;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t src = (n * row + h * D), dst = page * page_stride + (h * P + off) * D;
      std::memcpy(kd + dst * k_pages.element_size(), ks + src * k_pages.element_size(), bytes);
      std::memcpy(vd + dst * v_pages.element_size(), vs + src * v_pages.element_size(), bytes);
      float* c = cd + (page * H + h) * D;
      if (bf16) update_centroid(c, kc.data_ptr<at::BFloat16>() + src, D, off);
      else update_centroid(c, kc.data_ptr<float>() + src, D, off);
    }
  }
}

inline float dot(const float* a, const float* b, int64_t D) {  // D a multiple of 16
  simd::vf acc = simd::zero();
  for (int64_t d = 0; d < D; d += 16) acc = simd::fmadd(simd::loadu(a + d), simd::loadu(b + d), acc);
  return simd::reduce_add(acc);
}

// Page scores for block top-k: the mean query of each KV head's G query heads (q [B, Hq, D], fp32 or bf16)
// dotted with the centroid of each logical page < n_pages of its row -> [B, Hkv, W] fp32, -inf beyond.
// A row with group g >= 0 takes its first prefixes[g].size(0) pages from that group's centroids
// [m, Hkv, D] (the shared prefix, read from cache by the group's rows one after another), the rest from
// the pool's centroids [N, Hkv, D] through block_table [B, W] int32. Candidate rules are the selection's.
at::Tensor score_pages(const at::Tensor& q, const at::Tensor& centroids, const at::Tensor& block_table,
                       const at::Tensor& seq_lens, int64_t page_size, at::TensorList prefixes,
                       const at::Tensor& group) {
  TORCH_CHECK(centroids.scalar_type() == at::kFloat && centroids.is_contiguous(), "centroids: contiguous fp32");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              group.scalar_type() == at::kLong && block_table.is_contiguous(), "int32 table/lengths, int64 groups");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), H = centroids.size(1), W = block_table.size(1);
  TORCH_CHECK(D % 16 == 0 && Hq % H == 0, "head dim a multiple of 16, whole GQA groups");
  for (const auto& p : prefixes)
    TORCH_CHECK(p.scalar_type() == at::kFloat && p.is_contiguous() && p.size(1) == H && p.size(2) == D,
                "prefix centroids: contiguous fp32 [m, Hkv, D]");
  const int64_t G = Hq / H;
  const auto qf = q.to(at::kFloat).contiguous();
  const float* qd = qf.data_ptr<float>();
  std::vector<float> q_mean(B * H * D);  // [B, H, D]: the mean query of each KV head's group, summed in order
  for (int64_t t = 0; t < B * H; ++t)
    for (int64_t d = 0; d < D; ++d) {
      float sum = 0.f;
      for (int64_t g = 0; g < G; ++g) sum += qd[(t * G + g) * D + d];
      q_mean[t * D + d] = sum / G;
    }
  auto scores = at::empty({B, H, W}, qf.options());
  const float* qm = q_mean.data();
  const float* cd = centroids.data_ptr<float>();
  float* out = scores.data_ptr<float>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* gd = group.data_ptr<int64_t>();
  std::vector<const float*> prefix(prefixes.size());
  std::vector<int64_t> prefix_pages(prefixes.size());
  for (size_t g = 0; g < prefixes.size(); ++g) prefix[g] = prefixes[g].data_ptr<float>(), prefix_pages[g] = prefixes[g].size(0);
  // each (row, KV head) scores its pages: the shared prefix's from its group's centroids (read by the
  // group's rows one after another, so from cache), the rest through the block table
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H;
      const int64_t n = std::min<int64_t>((lens[b] + page_size - 1) / page_size, W);
      const int64_t m = gd[b] >= 0 ? std::min<int64_t>(prefix_pages[gd[b]], n) : 0;
      const float* qv = qm + t * D;
      float* row = out + t * W;
      for (int64_t w = 0; w < m; ++w) row[w] = dot(qv, prefix[gd[b]] + (w * H + h) * D, D);
      for (int64_t w = m; w < n; ++w) {
        const int32_t phys = table[b * W + w];
        row[w] = phys >= 0 ? dot(qv, cd + ((int64_t)phys * H + h) * D, D) : -std::numeric_limits<float>::infinity();
      }
      std::fill(row + n, row + W, -std::numeric_limits<float>::infinity());
    }
  });
  return scores;
}

// A sparse decode layer's attention in one op (the chain DecodeAttention runs op by op): append the new
// token's k/v [B, Hkv, D] at slots [B], score the pages (score_pages, the shared prefixes' centroids for
// their rows), select by block top-k (select_pages), attend over the selected pages (paged_attention)
// -> [B, Hq * D] in q's dtype.
at::Tensor sparse_decode_layer(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_pages,
                               at::Tensor& v_pages, at::Tensor& centroids, const at::Tensor& slots,
                               const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& budgets,
                               int64_t page_size, int64_t reserved, at::TensorList prefixes, const at::Tensor& group,
                               double scale) {
  append_kv(k_pages, v_pages, centroids, k, v, slots);
  const auto qf = q.to(at::kFloat).contiguous();
  const auto scores = score_pages(qf, centroids, block_table, seq_lens, page_size, prefixes, group);
  const auto selected = select_pages(scores, seq_lens, budgets, page_size, reserved, 0);
  const auto out = std::get<0>(paged_attention(qf, k_pages, v_pages, block_table, seq_lens, selected.to(at::kLong),
                                               scale));
  return out.to(q.scalar_type()).view({q.size(0), q.size(1) * q.size(2)});
}

}  // namespace

TORCH_LIBRARY(sparrow_cpu, m) {
  m.def("prefix_attention(Tensor q, Tensor kp, Tensor vp, float scale, int chunks) -> (Tensor, Tensor)");
  m.impl("prefix_attention", c10::DispatchKey::CPU, TORCH_FN(prefix_attention));
  m.def("paged_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor block_table, Tensor seq_lens, "
        "Tensor pages, float scale) -> (Tensor, Tensor)");
  m.impl("paged_attention", c10::DispatchKey::CPU, TORCH_FN(paged_attention));
  m.def("merge_attention(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> Tensor");
  m.impl("merge_attention", c10::DispatchKey::CPU, TORCH_FN(merge_attention));
  m.def("select_pages(Tensor scores, Tensor seq_lens, Tensor budgets, int page_size, int reserved, "
        "int min_width) -> Tensor");
  m.impl("select_pages", c10::DispatchKey::CPU, TORCH_FN(select_pages));
  m.def("score_pages(Tensor q, Tensor centroids, Tensor block_table, Tensor seq_lens, int page_size, "
        "Tensor[] prefixes, Tensor group) -> Tensor");
  m.impl("score_pages", c10::DispatchKey::CPU, TORCH_FN(score_pages));
  m.def("append_kv(Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor(c!) centroids, Tensor k, Tensor v, "
        "Tensor slots) -> ()");
  m.impl("append_kv", c10::DispatchKey::CPU, TORCH_FN(append_kv));
  m.def("sparse_decode_layer(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pages, Tensor(b!) v_pages, "
        "Tensor(c!) centroids, Tensor slots, Tensor block_table, Tensor seq_lens, Tensor budgets, int page_size, "
        "int reserved, Tensor[] prefixes, Tensor group, float scale) -> Tensor");
  m.impl("sparse_decode_layer", c10::DispatchKey::CPU, TORCH_FN(sparse_decode_layer));
}
