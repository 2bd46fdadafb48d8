// The per-layer ops of a CPU decode step besides attention: RMSNorm and rotary embedding of q and k (each
// one op instead of a handful of eager ones), decode-sized products (bf16 and fp32), and a decode layer as
// two ops around the attention. Math in fp32, rounded to the activations' dtype where the eager modules round;
// the bf16 elementwise work is vectorised (scalar c10::BFloat16 conversions cost more than the products).
// The torch references: stages/model/llama.py (RMSNorm, apply_rope), F.linear; where they are used and
// why: stages/engine/cpu/layers.py, stages/engine/cpu/packed_linears.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

// libtorch_cpu's exp of 16 (AVX512) or 8 (AVX2) floats: the one torch's own vectorised silu uses on this CPU,
// so that ours rounds as F.silu does
#if SPARROW_SIMD_AVX512
extern "C" __m512 Sleef_expf16_u10(__m512);
inline simd::vf exp16(simd::vf x) { return Sleef_expf16_u10(x); }
#else
extern "C" __m256 Sleef_expf8_u10(__m256);
inline simd::vf exp16(simd::vf x) { return {Sleef_expf8_u10(x.lo), Sleef_expf8_u10(x.hi)}; }
#endif

namespace {

inline simd::vf load_bf16(const at::BFloat16* p, simd::vmask m) { return simd::maskz_load_bf16(m, p); }

inline void store_bf16(at::BFloat16* p, simd::vf x, simd::vmask m) {  // rounded to nearest even, as c10::BFloat16
  simd::mask_store_bf16(p, m, x);
}

inline simd::vf round_bf16(simd::vf x) {  // fp32 -> bf16 -> fp32
  return simd::widen_bf16(simd::to_bf16(x));
}

inline simd::vmask tail(int64_t n) { return n >= 16 ? simd::all() : simd::prefix(n); }

// out = a + b over n bf16 values, each sum rounded once (as a bf16 tensor add)
void add_rows(const at::BFloat16* a, const at::BFloat16* b, at::BFloat16* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const simd::vmask m = tail(n - i);
    store_bf16(out + i, simd::add(load_bf16(a + i, m), load_bf16(b + i, m)), m);
  }
}

// act = bf16(bf16(silu(gate)) * up) over n values: F.silu(gate) * up of bf16 tensors
void silu_mul(const at::BFloat16* gate, const at::BFloat16* up, at::BFloat16* act, int64_t n) {
  const simd::vf one = simd::set1(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const simd::vmask m = tail(n - i);
    const simd::vf g = load_bf16(gate + i, m);
    const simd::vf silu = round_bf16(simd::div(g, simd::add(one, exp16(simd::sub(simd::zero(), g)))));
    store_bf16(act + i, simd::mul(silu, load_bf16(up + i, m)), m);
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * H;
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      simd::vf ss = simd::zero();
      for (int64_t i = 0; i < H; i += 16) {
        const simd::vf xv = load_bf16(xr + i, tail(H - i));
        ss = simd::fmadd(xv, xv, ss);
      }
      const simd::vf inv = simd::set1(1.f / std::sqrt(simd::reduce_add(ss) / H + eps));
      for (int64_t i = 0; i < H; i += 16) {  // as the reference: x * inv is rounded before the weight multiplies it
        const simd::vmask m = tail(H - i);
        store_bf16(out + r * H + i, simd::mul(load_bf16(w + i, m), round_bf16(simd::mul(load_bf16(xr + i, m), inv))), m);
      }
    } else {
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(ss / H + eps);
      // as the reference: the normalised row is rounded to the dtype before the weight multiplies it
      for (int64_t i = 0; i < H; ++i)
        out[r * H + i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(xr[i] * inv)));
    }
  }
}

// x [..., H], weight [H] (x's dtype, fp32 or bf16) -> weight * (x * rsqrt(mean(x^2) + eps))
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight: one dtype");
  const auto xc = x.contiguous(), wc = weight.contiguous();
  const int64_t H = x.size(-1), rows = x.numel() / H;
  auto out = at::empty_like(xc);
  if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows(xc.data_ptr<at::BFloat16>(), wc.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, H, eps);
  else if (x.scalar_type() == at::kFloat)
    rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), rows, H, eps);
  else
    TORCH_CHECK(false, "rms_norm: fp32 or bf16");
  return out;
}

template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t B, int64_t H, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const T* xr = x + (b * H + h) * D;
      const T* c = cos + b * D;
      const T* s = sin + b * D;
      T* o = out + (b * H + h) * D;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        for (int64_t i = 0; i < half; i += 16) {  // x c + rotate_half(x) s, both halves of 16 lanes at a time
          const simd::vmask m = tail(half - i);
          const simd::vf lo = load_bf16(xr + i, m), hi = load_bf16(xr + half + i, m);
          store_bf16(o + i, simd::fmadd(simd::sub(simd::zero(), hi), load_bf16(s + i, m),
                                            simd::mul(lo, load_bf16(c + i, m))), m);
          store_bf16(o + half + i, simd::fmadd(lo, load_bf16(s + half + i, m),
                                                   simd::mul(hi, load_bf16(c + half + i, m))), m);
        }
      } else {
        for (int64_t i = 0; i < D; ++i) {
          const float rotated = i < half ? -static_cast<float>(xr[i + half]) : static_cast<float>(xr[i - half]);
          o[i] = static_cast<T>(static_cast<float>(xr[i]) * static_cast<float>(c[i]) + rotated * static_cast<float>(s[i]));
        }
      }
    }
}

// One decode token per row: q [B, Hq, 1, D], k [B, Hkv, 1, D] (any strides), cos/sin [B, 1, 1, D]
// (Hugging Face's half-rotation convention) -> rotated q, k, contiguous, same shapes.
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                           const at::Tensor& sin) {
  TORCH_CHECK(q.size(2) == 1 && k.size(2) == 1, "one token per row");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == cos.scalar_type(), "one dtype");
  const int64_t B = q.size(0), D = q.size(3);
  const auto cc = cos.contiguous(), sc = sin.contiguous();
  std::vector<at::Tensor> outs;
  for (const auto& x : {q, k}) {
    const auto xc = x.contiguous();
    auto out = at::empty_like(xc);
    if (x.scalar_type() == at::kBFloat16)
      rope_rows(xc.data_ptr<at::BFloat16>(), cc.data_ptr<at::BFloat16>(), sc.data_ptr<at::BFloat16>(),
                out.data_ptr<at::BFloat16>(), B, x.size(1), D);
    else if (x.scalar_type() == at::kFloat)
      rope_rows(xc.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), out.data_ptr<float>(), B,
                x.size(1), D);
    else
      TORCH_CHECK(false, "rope_qk: fp32 or bf16");
    outs.push_back(out);
  }
  return {outs[0], outs[1]};
}

// Rows a register block of the products holds, each row's sums over 16 outputs in one vector: AVX512's 32
// registers hold 16 rows; AVX2's 16 registers of 8 lanes hold 6 rows in fp32 (two registers a row, two
// for the weights, one for the input) and 5 in bf16 (the weights' odd and even values widened: four).
constexpr int F32_ROWS = SPARROW_SIMD_AVX512 ? 16 : 6;
constexpr int BF16_ROWS = SPARROW_SIMD_AVX512 ? 16 : 5;

// The next block of 16 outputs' weights are fetched while a block of at least PREFETCH_ROWS rows computes:
// the rows' FMAs and the weights' stream from memory overlap instead of taking turns. Into L2: the block
// itself stays in L1. Fewer rows compute too little to hide a block behind, and the hardware prefetcher
// streams the weights faster alone.
constexpr int PREFETCH_ROWS = 4;
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// Decode-sized products in bf16: x [M, K] (M <= BF16_ROWS) times a weight packed as [N/16, K/2, 16, 2] (per
// block of 16 outputs, per pair of inputs, the 16 outputs' two weights: one vdpbf16ps operand) -> [M, N]
// bf16 (or fp32, OutT = float: the lm_head's logits, never rounded), fp32 accumulation, plus an optional
// bias [N]. Each weight is read once for all rows; over a whole model's weights the product is bound by
// memory bandwidth, not by vdpbf16ps. On AVX2 each pair of weights is widened once for the block's rows,
// which take their inputs widened beforehand (xf [M, K] fp32), and sums as vdpbf16ps: odd, then even.
template <int M, typename OutT>
void linear_block(const uint32_t* x, const float* xf, const uint16_t* w, int K2, const at::BFloat16* bias,
                  OutT* out, int N, int n0) {
  simd::vf acc[M];
  for (int m = 0; m < M; ++m) acc[m] = simd::zero();
  for (int p = 0; p < K2; ++p) {
    if constexpr (M >= PREFETCH_ROWS) prefetch_l2(w + ((int64_t)K2 + p) * 32);
    const simd::vi wv = simd::loadu_bits(w + (int64_t)p * 32);
#if SPARROW_SIMD_AVX512
    (void)xf;
    for (int m = 0; m < M; ++m)
      acc[m] = simd::dpbf16(acc[m], simd::as_bh(simd::set1_bits((int)x[m * K2 + p])), simd::as_bh(wv));
#else
    (void)x;
    const simd::vf odd = simd::odd_bf16(wv), even = simd::even_bf16(wv);
    for (int m = 0; m < M; ++m) {
      const float* xp = xf + ((int64_t)m * K2 + p) * 2;
      acc[m] = simd::fmadd(simd::set1(xp[1]), odd, acc[m]);
      acc[m] = simd::fmadd(simd::set1(xp[0]), even, acc[m]);
    }
#endif
  }
  const simd::vf b = bias ? simd::load_bf16(bias + n0) : simd::zero();
  for (int m = 0; m < M; ++m) {
    if constexpr (std::is_same_v<OutT, float>)
      simd::storeu(out + (int64_t)m * N + n0, simd::add(acc[m], b));
    else
      _mm256_storeu_si256((__m256i*)(out + (int64_t)m * N + n0), simd::to_bf16(simd::add(acc[m], b)));
  }
}

template <int M, typename OutT>
void block_dispatch(int rows, const uint32_t* x, const float* xf, const uint16_t* w, int K2,
                    const at::BFloat16* bias, OutT* out, int N, int n0) {
  if constexpr (M > 1) {
    if (rows < M) return block_dispatch<M - 1>(rows, x, xf, w, K2, bias, out, N, n0);
  }
  linear_block<M>(x, xf, w, K2, bias, out, N, n0);
}

// `rows` split into register blocks of at most `most` rows, as even as they come (8 rows in 6s: 4 and 4)
inline int block_rows(int rows, int most) {
  const int blocks = (rows + most - 1) / most;
  return (rows + blocks - 1) / blocks;
}

// Any number of rows: per block of 16 outputs, the rows in register blocks while the block's weights stay
// in cache, so the weight is read from memory once (a verification's K + 1 rows per sample); each row's
// sums are those of the row alone.
template <typename OutT>
void linear_rows(int rows, const uint32_t* x, const uint16_t* w, int K2, int NB, const at::BFloat16* bias,
                 OutT* out) {
  std::vector<float> xf;
  if constexpr (!SPARROW_SIMD_AVX512) {  // the inputs widened once for every block of outputs
    xf.resize((size_t)rows * K2 * 2);
    for (size_t i = 0; i < xf.size(); ++i) {
      const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(x)[i]) << 16;
      std::memcpy(&xf[i], &bits, sizeof(float));
    }
  }
  const int step = block_rows(rows, BF16_ROWS);
  at::parallel_for(0, NB, 4, [&](int64_t a, int64_t b) {
    for (int64_t nb = a; nb < b; ++nb)
      for (int r0 = 0; r0 < rows; r0 += step)
        block_dispatch<BF16_ROWS>(std::min(step, rows - r0), x + (int64_t)r0 * K2,
                                  xf.data() + (int64_t)r0 * K2 * 2, w + nb * K2 * 32, K2, bias,
                                  out + (int64_t)r0 * NB * 16, NB * 16, nb * 16);
  });
}

// The same in fp32: x [M, K] fp32 times a weight packed as [N/16, K, 16] (per block of 16 outputs, per
// input, the 16 outputs' weights) -> [M, N] fp32, plus an optional bias [N]; one FMA per weight and row.
template <int M>
void linear_block_f32(const float* x, const float* w, int K, const float* bias, float* out, int N, int n0) {
  simd::vf acc[M];
  for (int m = 0; m < M; ++m) acc[m] = simd::zero();
  for (int k = 0; k < K; ++k) {
    if constexpr (M >= PREFETCH_ROWS) prefetch_l2(w + ((int64_t)K + k) * 16);
    const simd::vf wv = simd::loadu(w + (int64_t)k * 16);
    for (int m = 0; m < M; ++m) acc[m] = simd::fmadd(simd::set1(x[m * K + k]), wv, acc[m]);
  }
  const simd::vf b = bias ? simd::loadu(bias + n0) : simd::zero();
  for (int m = 0; m < M; ++m) simd::storeu(out + (int64_t)m * N + n0, simd::add(acc[m], b));
}

template <int M>
void block_dispatch_f32(int rows, const float* x, const float* w, int K, const float* bias, float* out, int N,
                        int n0) {
  if constexpr (M > 1) {
    if (rows < M) return block_dispatch_f32<M - 1>(rows, x, w, K, bias, out, N, n0);
  }
  linear_block_f32<M>(x, w, K, bias, out, N, n0);
}

void linear_rows_f32(int rows, const float* x, const float* w, int K, int NB, const float* bias, float* out) {
  const int step = block_rows(rows, F32_ROWS);
  at::parallel_for(0, NB, 4, [&](int64_t a, int64_t b) {
    for (int64_t nb = a; nb < b; ++nb)
      for (int r0 = 0; r0 < rows; r0 += step)
        block_dispatch_f32<F32_ROWS>(std::min(step, rows - r0), x + (int64_t)r0 * K, w + nb * K * 16, K, bias,
                                     out + (int64_t)r0 * NB * 16, NB * 16, nb * 16);
  });
}

template <typename OutT>
void linear_into(const at::BFloat16* x, int rows, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                 OutT* out) {
  const int NB = packed.size(0), K2 = packed.size(1);
  linear_rows(rows, reinterpret_cast<const uint32_t*>(x),
              reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), K2, NB,
              bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr, out);
}

void linear_into(const float* x, int rows, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                 float* out) {
  linear_rows_f32(rows, x, packed.data_ptr<float>(), packed.size(1), packed.size(0),
                  bias.has_value() ? bias->data_ptr<float>() : nullptr, out);
}

void check_packed(const at::Tensor& packed, int64_t K, const char* name, at::ScalarType dtype) {
  if (dtype == at::kBFloat16) {
    TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == 16 &&
                    packed.size(3) == 2 && packed.is_contiguous() && packed.size(1) * 2 == K,
                name, ": packed bf16 weight [N/16, K/2, 16, 2] with K = ", K, " expected");
  } else {
    TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == 16 &&
                    packed.is_contiguous() && packed.size(1) == K,
                name, ": packed fp32 weight [N/16, K, 16] with K = ", K, " expected");
  }
}

// x [..., K] (any number of rows) times a weight packed for our product of x's dtype (bf16 [N/16, K/2, 16, 2],
// fp32 [N/16, K, 16]) plus an optional bias [N] -> [..., N] in x's dtype, or in fp32 when fp32_out
template <typename T, typename OutT = T>
at::Tensor packed_linear_impl(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), M = x.numel() / std::max<int64_t>(K, 1);
  check_packed(packed, K, "packed_linear", x.scalar_type());
  TORCH_CHECK(M >= 1, "packed_linear: x [..., K] with at least one row expected");
  const auto xc = x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = packed.size(0) * 16;
  auto out = at::empty(sizes, x.options().dtype(c10::CppTypeToScalarType<OutT>::value));
  c10::optional<at::Tensor> b;
  if (bias.has_value()) b = bias->contiguous();
  linear_into(xc.data_ptr<T>(), M, packed, b, out.template data_ptr<OutT>());
  return out;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         bool fp32_out) {
  if (x.scalar_type() == at::kBFloat16 && fp32_out) return packed_linear_impl<at::BFloat16, float>(x, packed, bias);
  if (x.scalar_type() == at::kBFloat16) return packed_linear_impl<at::BFloat16>(x, packed, bias);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "packed_linear: bf16 or fp32 x expected");
  return packed_linear_impl<float>(x, packed, bias);
}

// ---- a decode layer as two ops around the attention (stages/rollout/cpu_decode.py) ----
// Each rounds where the eager chain of the model's modules rounds (norm, product, rotary, residual sum,
// silu, gate product), so that it equals the ops above called one by one.

void add_rows(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const simd::vmask m = tail(n - i);
    simd::mask_storeu(out + i, m, simd::add(simd::maskz_loadu(m, a + i), simd::maskz_loadu(m, b + i)));
  }
}

void silu_mul(const float* gate, const float* up, float* act, int64_t n) {  // F.silu(gate) * up in fp32
  const simd::vf one = simd::set1(1.f);
  for (int64_t i = 0; i < n; i += 16) {
    const simd::vmask m = tail(n - i);
    const simd::vf g = simd::maskz_loadu(m, gate + i);
    const simd::vf silu = simd::div(g, simd::add(one, exp16(simd::sub(simd::zero(), g))));
    simd::mask_storeu(act + i, m, simd::mul(silu, simd::maskz_loadu(m, up + i)));
  }
}

// x [B, H] (the residual stream) -> q [B, Hq, D], k, v [B, Hkv, D]: input RMSNorm, the stacked q/k/v
// product (+ bias), the optional per-head q/k RMSNorms (Qwen3), rotary embedding of q and k with
// cos/sin [B, D].
template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_qkv_impl(
    const at::Tensor& x, const at::Tensor& norm_w, const at::Tensor& qkv_packed, const c10::optional<at::Tensor>& qkv_bias,
    const c10::optional<at::Tensor>& q_norm_w, const c10::optional<at::Tensor>& k_norm_w, const at::Tensor& cos,
    const at::Tensor& sin, int64_t Hq, int64_t Hkv, double eps) {
  const int64_t B = x.size(0), H = x.size(1), D = cos.size(-1), N = (Hq + 2 * Hkv) * D;
  TORCH_CHECK(B >= 1 && B <= 16, "decode_qkv: 1 to 16 rows");
  check_packed(qkv_packed, H, "decode_qkv", x.scalar_type());
  TORCH_CHECK(qkv_packed.size(0) * 16 == N, "decode_qkv: the packed weight has ", qkv_packed.size(0) * 16,
              " outputs, (Hq + 2 Hkv) D = ", N, " expected");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == B * D && sin.numel() == B * D &&
                  cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos/sin [B, D] in x's dtype expected");
  const auto opts = x.options();
  auto normed = at::empty({B, H}, opts);
  rms_norm_rows(x.data_ptr<T>(), norm_w.data_ptr<T>(), normed.data_ptr<T>(), B, H,
                static_cast<float>(eps));
  auto qkv = at::empty({B, N}, opts);
  linear_into(normed.data_ptr<T>(), B, qkv_packed, qkv_bias, qkv.data_ptr<T>());
  auto q = at::empty({B, Hq, D}, opts), k = at::empty({B, Hkv, D}, opts), v = at::empty({B, Hkv, D}, opts);
  const T* src = qkv.data_ptr<T>();
  std::vector<T> head(D);
  for (int64_t b = 0; b < B; ++b) {
    const T* row = src + b * N;
    const T* c = cos.data_ptr<T>() + b * D;
    const T* s = sin.data_ptr<T>() + b * D;
    for (int64_t h = 0; h < Hq + Hkv; ++h) {
      const bool is_q = h < Hq;
      const c10::optional<at::Tensor>& hn = is_q ? q_norm_w : k_norm_w;
      const T* in = row + h * D;
      if (hn.has_value()) {
        rms_norm_rows(in, hn->data_ptr<T>(), head.data(), 1, D, static_cast<float>(eps));
        in = head.data();
      }
      T* out = is_q ? q.data_ptr<T>() + (b * Hq + h) * D
                               : k.data_ptr<T>() + (b * Hkv + h - Hq) * D;
      rope_rows(in, c, s, out, 1, 1, D);
    }
    std::copy(row + (Hq + Hkv) * D, row + N, v.data_ptr<T>() + b * Hkv * D);
  }
  return {q, k, v};
}

// The rest of a layer: x [B, H] (the residual stream), attn [B, Hq * D] (the attention's output) ->
// h + down(silu(gate) * up) of post_norm(h), with h = x + o_proj(attn).
template <typename T>
at::Tensor decode_mlp_impl(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& o_packed,
                      const c10::optional<at::Tensor>& o_bias, const at::Tensor& norm_w, const at::Tensor& gate_up_packed,
                      const at::Tensor& down_packed, double eps) {
  TORCH_CHECK(attn.scalar_type() == x.scalar_type() && attn.dim() == 2 && attn.is_contiguous() &&
                  attn.size(0) == x.size(0), "attn [B, Hq D] in x's dtype expected");
  const int64_t B = x.size(0), H = x.size(1), I = gate_up_packed.size(0) * 8;  // 2 I outputs
  TORCH_CHECK(B >= 1 && B <= 16, "decode_mlp: 1 to 16 rows");
  check_packed(o_packed, attn.size(1), "decode_mlp (o_proj)", x.scalar_type());
  check_packed(gate_up_packed, H, "decode_mlp (gate/up)", x.scalar_type());
  check_packed(down_packed, I, "decode_mlp (down)", x.scalar_type());
  TORCH_CHECK(o_packed.size(0) * 16 == H && down_packed.size(0) * 16 == H, "decode_mlp: outputs of H expected");
  const auto opts = x.options();
  auto h = at::empty({B, H}, opts), normed = at::empty({B, H}, opts), gu = at::empty({B, 2 * I}, opts),
       act = at::empty({B, I}, opts), out = at::empty({B, H}, opts);
  T *hp = h.data_ptr<T>(), *op = out.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  linear_into(attn.data_ptr<T>(), B, o_packed, o_bias, hp);
  add_rows(xp, hp, hp, B * H);
  rms_norm_rows(hp, norm_w.data_ptr<T>(), normed.data_ptr<T>(), B, H, static_cast<float>(eps));
  linear_into(normed.data_ptr<T>(), B, gate_up_packed, c10::nullopt, gu.data_ptr<T>());
  const T* g = gu.data_ptr<T>();
  T* a = act.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b) silu_mul(g + b * 2 * I, g + b * 2 * I + I, a + b * I, I);
  linear_into(a, B, down_packed, c10::nullopt, op);
  add_rows(hp, op, op, B * H);
  return out;
}


// x [B, H] (bf16 or fp32, the residual stream) and the layer's weights packed for our product of x's dtype
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_qkv(
    const at::Tensor& x, const at::Tensor& norm_w, const at::Tensor& qkv_packed, const c10::optional<at::Tensor>& qkv_bias,
    const c10::optional<at::Tensor>& q_norm_w, const c10::optional<at::Tensor>& k_norm_w, const at::Tensor& cos,
    const at::Tensor& sin, int64_t Hq, int64_t Hkv, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [B, H] contiguous expected");
  if (x.scalar_type() == at::kBFloat16)
    return decode_qkv_impl<at::BFloat16>(x, norm_w, qkv_packed, qkv_bias, q_norm_w, k_norm_w, cos, sin, Hq, Hkv, eps);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "decode_qkv: bf16 or fp32");
  return decode_qkv_impl<float>(x, norm_w, qkv_packed, qkv_bias, q_norm_w, k_norm_w, cos, sin, Hq, Hkv, eps);
}

at::Tensor decode_mlp(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& o_packed,
                      const c10::optional<at::Tensor>& o_bias, const at::Tensor& norm_w, const at::Tensor& gate_up_packed,
                      const at::Tensor& down_packed, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [B, H] contiguous expected");
  if (x.scalar_type() == at::kBFloat16)
    return decode_mlp_impl<at::BFloat16>(x, attn, o_packed, o_bias, norm_w, gate_up_packed, down_packed, eps);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "decode_mlp: bf16 or fp32");
  return decode_mlp_impl<float>(x, attn, o_packed, o_bias, norm_w, gate_up_packed, down_packed, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparrow_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("rope_qk(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.impl("rope_qk", c10::DispatchKey::CPU, TORCH_FN(rope_qk));
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, bool fp32_out=False) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, TORCH_FN(packed_linear));
  m.def("decode_qkv(Tensor x, Tensor norm_w, Tensor qkv_packed, Tensor? qkv_bias, Tensor? q_norm_w, "
        "Tensor? k_norm_w, Tensor cos, Tensor sin, int Hq, int Hkv, float eps) -> (Tensor, Tensor, Tensor)");
  m.impl("decode_qkv", c10::DispatchKey::CPU, TORCH_FN(decode_qkv));
  m.def("decode_mlp(Tensor x, Tensor attn, Tensor o_packed, Tensor? o_bias, Tensor norm_w, Tensor gate_up_packed, "
        "Tensor down_packed, float eps) -> Tensor");
  m.impl("decode_mlp", c10::DispatchKey::CPU, TORCH_FN(decode_mlp));
}
