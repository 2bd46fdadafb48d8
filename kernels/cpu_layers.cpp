// The small per-layer ops of a CPU decode step, each one op instead of a handful of eager ones: RMSNorm
// and rotary embedding of q and k. Math in fp32, one rounding to the activations' dtype at the end.
// The torch references: stages/model/llama.py (RMSNorm, apply_rope); why: kernels/cpu_layers.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float inv = 1.f / std::sqrt(ss / H + eps);
    // as the reference: the normalised row is rounded to the dtype before the weight multiplies it
    for (int64_t i = 0; i < H; ++i)
      out[r * H + i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(xr[i] * inv)));
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
      for (int64_t i = 0; i < D; ++i) {
        const float rotated = i < half ? -static_cast<float>(xr[i + half]) : static_cast<float>(xr[i - half]);
        o[i] = static_cast<T>(static_cast<float>(xr[i]) * static_cast<float>(c[i]) + rotated * static_cast<float>(s[i]));
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(sparrow_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("rope_qk(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.impl("rope_qk", c10::DispatchKey::CPU, TORCH_FN(rope_qk));
}
