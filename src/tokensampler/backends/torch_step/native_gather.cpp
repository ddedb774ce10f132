// The candidate list in one pass (backends/torch_step/native.py builds and loads this file).
//
// gather_at_or_above(z, lower, scale, width): for each row r of z (float32 [R, V], contiguous rows),
// every id with z[r, id] >= lower[r] in id order: its value (divided by scale[r] when scale is given,
// one IEEE float32 division, as torch's div_) and its id, in the first min(n, width) columns of
// values (float32 [R, max(width, 1)], -inf after) and ids (int64, 0 after); count[r] = n, every hit
// counted even past width (the caller checks it against its own count). NaN compares false, as in
// torch. Rows are shared over torch's intra-op threads (at::parallel_for: one parallel region); with
// AVX2, 32 ids are compared at a time and only the words that hold a hit are looked into.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <limits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_at_or_above(
    const at::Tensor& z, const at::Tensor& lower, const c10::optional<at::Tensor>& scale, int64_t width) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && z.stride(1) == 1 && z.device().is_cpu(),
              "z: a CPU float32 [R, V] tensor with contiguous rows");
  const int64_t rows = z.size(0), vocab = z.size(1), stride = z.stride(0);
  TORCH_CHECK(lower.dim() == 1 && lower.size(0) == rows && lower.scalar_type() == at::kFloat && lower.is_contiguous());
  const float* scale_ptr = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->dim() == 1 && scale->size(0) == rows && scale->scalar_type() == at::kFloat && scale->is_contiguous());
    scale_ptr = scale->data_ptr<float>();
  }
  const int64_t w = std::max<int64_t>(width, 1);
  at::Tensor values = at::full({rows, w}, -std::numeric_limits<float>::infinity(), z.options());
  at::Tensor ids = at::zeros({rows, w}, z.options().dtype(at::kLong));
  at::Tensor count = at::empty({rows}, z.options().dtype(at::kLong));
  const float* zp = z.data_ptr<float>();
  const float* lo = lower.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  int64_t* cp = count.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = zp + r * stride;
      const float t = lo[r];
      float* vout = vp + r * w;
      int64_t* iout = ip + r * w;
      int64_t n = 0, i = 0;
#if defined(__AVX2__)
      const __m256 tv = _mm256_set1_ps(t);
      for (; i + 32 <= vocab; i += 32) {
        uint32_t m = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), tv, _CMP_GE_OQ))
            | ((uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i + 8), tv, _CMP_GE_OQ)) << 8)
            | ((uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i + 16), tv, _CMP_GE_OQ)) << 16)
            | ((uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i + 24), tv, _CMP_GE_OQ)) << 24);
        while (m) {
          const int k = __builtin_ctz(m);
          m &= m - 1;
          if (n < w) { vout[n] = row[i + k]; iout[n] = i + k; }
          ++n;
        }
      }
#endif
      for (; i < vocab; ++i) {
        if (row[i] >= t) {
          if (n < w) { vout[n] = row[i]; iout[n] = i; }
          ++n;
        }
      }
      cp[r] = n;
      if (scale_ptr != nullptr) {
        const float s = scale_ptr[r];
        const int64_t kept = std::min(n, w);
        for (int64_t j = 0; j < kept; ++j) vout[j] = vout[j] / s;
      }
    }
  });
  return {values, ids, count};
}

}  // namespace

TORCH_LIBRARY(tokensampler_native, m) {
  m.def("gather_at_or_above(Tensor z, Tensor lower, Tensor? scale, int width) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokensampler_native, CPU, m) {
  m.impl("gather_at_or_above", &gather_at_or_above);
}
