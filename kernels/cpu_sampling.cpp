// Sampling a decode step's tokens on the CPU: the exponential race in one pass over each row.
// The torch reference and why: stages/rollout/sampler.py (race_sample_reference).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace {

constexpr uint64_t GOLDEN = 0x9e3779b97f4a7c15ull;  // splitmix64's increment

// splitmix64's output function: 64 well-mixed bits from a counter
inline __m512i mix64(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(0xbf58476d1ce4e5b9ll));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(0x94d049bb133111ebll));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// ln x for normal x > 0: x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s), s = (m - 1) / (m + 1),
// |s| <= 0.172, by its series to s^11 (relative error below 1e-7)
inline __m512 log_ps(__m512 x) {
  __m512 e = _mm512_getexp_ps(x);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.f));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 s = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one)), s2 = _mm512_mul_ps(s, s);
  __m512 p = _mm512_set1_ps(2.f / 11);
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.f / 9));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.f / 7));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.f / 5));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.f / 3));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(2.f));
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.69314718055994531f), _mm512_mul_ps(p, s));
}

// logp [B, V] fp32 (log-probabilities; -inf never drawn), seeds [B] int64 -> tokens [B] int64: per row
// argmax_v logp_v - ln E_v, i.e. argmax p_v / E_v with E_v = -ln U_v ~ Exp(1), which draws v with
// probability p_v (E_v floored at 2^-25, below). U_v = (bits + 0.5) / 2^24 from 24 bits of one 32-bit half of
// splitmix64(seed + (v / 2 + 1) * golden): element v takes the low half when v is even, the high half when odd.
at::Tensor race_sample(const at::Tensor& logp, const at::Tensor& seeds) {
  TORCH_CHECK(logp.scalar_type() == at::kFloat && logp.dim() == 2 && logp.is_contiguous(), "logp [B, V] fp32");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.numel() == logp.size(0), "seeds [B] int64");
  const int64_t B = logp.size(0), V = logp.size(1);
  auto tokens = at::empty({B}, seeds.options());
  const float* lp = logp.data_ptr<float>();
  const auto sc = seeds.contiguous();
  const int64_t* sd = sc.data_ptr<int64_t>();
  int64_t* td = tokens.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = lp + b * V;
      const uint64_t seed = static_cast<uint64_t>(sd[b]);
      __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512i best_at = _mm512_set1_epi32(-1);
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i pair = _mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8);  // counters of elements 0-15
      for (int64_t v = 0; v < V; v += 16) {
        const __mmask16 in = V - v >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - v)) - 1);
        const __m512i ctr = _mm512_add_epi64(pair, _mm512_set1_epi64(static_cast<int64_t>(v / 2)));
        const __m512i bits = mix64(_mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(seed)),
                                                    _mm512_mullo_epi64(ctr, _mm512_set1_epi64(GOLDEN))));
        // 32-bit lanes are (low, high) halves in element order; 24 bits each, centred in their cell
        const __m512 u = _mm512_mul_ps(
            _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 8)), _mm512_set1_ps(0.5f)),
            _mm512_set1_ps(1.f / 16777216));
        // E >= 2^-25: fp32 rounds the top cell's U up to 1, where -ln U = 0 would make the token win
        // whatever its probability; 2^-25 is -ln U of that cell's exact U
        const __m512 e = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), log_ps(u)), _mm512_set1_ps(0x1p-25f));
        const __m512 x = _mm512_maskz_loadu_ps(in, row + v);
        const __m512 score = _mm512_sub_ps(x, log_ps(e));
        const __mmask16 better = _mm512_mask_cmp_ps_mask(in, score, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, better, score);
        best_at = _mm512_mask_mov_epi32(best_at, better, _mm512_add_epi32(lane, _mm512_set1_epi32((int)v)));
      }
      alignas(64) float bv[16];
      alignas(64) int32_t bi[16];
      _mm512_store_ps(bv, best);
      _mm512_store_si512(bi, best_at);
      int64_t token = 0;
      float top = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < 16; ++i)
        if (bi[i] >= 0 && (bv[i] > top || (bv[i] == top && bi[i] < token))) top = bv[i], token = bi[i];
      td[b] = token;
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparrow_cpu, m) {
  m.def("race_sample(Tensor logp, Tensor seeds) -> Tensor");
  m.impl("race_sample", c10::DispatchKey::CPU, TORCH_FN(race_sample));
}
