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

#include "native_rows.h"

#include <algorithm>
#include <limits>
#include <vector>
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

// gather_in_range(z, low, high, width): for each row r of z (float32 [R, V], contiguous rows) the
// values with low[r] <= z < high[r] and z > -inf, in id order, in the first min(n, width) columns of
// values (float32 [R, max(width, 1)], -inf after); count[r] = n, every hit counted even past width.
// NaN compares false. The dense route's top-p bracket (`dense._extract`).
std::tuple<at::Tensor, at::Tensor> gather_in_range(const at::Tensor& z, const at::Tensor& low, const at::Tensor& high,
                                                   int64_t width) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && z.stride(1) == 1 && z.device().is_cpu(),
              "z: a CPU float32 [R, V] tensor with contiguous rows");
  const int64_t rows = z.size(0), vocab = z.size(1), stride = z.stride(0);
  for (const at::Tensor* bound : {&low, &high}) {
    TORCH_CHECK(bound->dim() == 1 && bound->size(0) == rows && bound->scalar_type() == at::kFloat
                && bound->is_contiguous(), "low, high: float32 [R]");
  }
  const int64_t w = std::max<int64_t>(width, 1);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::Tensor values = at::full({rows, w}, neg_inf, z.options());
  at::Tensor count = at::empty({rows}, z.options().dtype(at::kLong));
  const float* zp = z.data_ptr<float>();
  const float* lo = low.data_ptr<float>();
  const float* hi = high.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* cp = count.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = zp + r * stride;
      const float a = lo[r], b = hi[r];
      float* vout = vp + r * w;
      int64_t n = 0, i = 0;
#if defined(__AVX2__)
      const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b), ninf = _mm256_set1_ps(neg_inf);
      auto in_range = [&](const float* at) {
        const __m256 x = _mm256_loadu_ps(at);
        const __m256 ok = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(x, av, _CMP_GE_OQ), _mm256_cmp_ps(x, bv, _CMP_LT_OQ)),
                                        _mm256_cmp_ps(x, ninf, _CMP_GT_OQ));
        return (uint32_t)_mm256_movemask_ps(ok);
      };
      for (; i + 32 <= vocab; i += 32) {
        uint32_t m = in_range(row + i) | (in_range(row + i + 8) << 8) | (in_range(row + i + 16) << 16)
            | (in_range(row + i + 24) << 24);
        while (m) {
          const int k = __builtin_ctz(m);
          m &= m - 1;
          if (n < w) vout[n] = row[i + k];
          ++n;
        }
      }
#endif
      for (; i < vocab; ++i) {
        const float x = row[i];
        if (x >= a && x < b && x > neg_inf) {
          if (n < w) vout[n] = x;
          ++n;
        }
      }
      cp[r] = n;
    }
  });
  return {values, count};
}

// Append to `out` the ids i < n with prompt[i] != 0 or counts[i] != 0, ascending; with AVX2, 32 ids
// at a time (one byte compare, four int32 compares), looking only into blocks that hold one.
inline void append_seen(const uint8_t* prompt, const int32_t* counts, int64_t n, std::vector<int64_t>& out) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256i zero = _mm256_setzero_si256();
  for (; i + 32 <= n; i += 32) {
    const uint32_t empty_prompt = (uint32_t)_mm256_movemask_epi8(
        _mm256_cmpeq_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(prompt + i)), zero));
    uint32_t empty_counts = 0;
    for (int q = 0; q < 4; ++q) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(counts + i + 8 * q));
      empty_counts |= (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(c, zero))) << (8 * q);
    }
    uint32_t m = ~(empty_prompt & empty_counts);
    while (m) {
      out.push_back(i + __builtin_ctz(m));
      m &= m - 1;
    }
  }
#endif
  for (; i < n; ++i) {
    if (prompt[i] != 0 || counts[i] != 0) out.push_back(i);
  }
}

// seen_ids(prompt_mask, output_counts, slots): for each slots[j], the ids its prompt holds or its
// outputs counted (prompt_mask[slot, id] or output_counts[slot, id] != 0), in id order: (member
// int64 [H] = j, ids int64 [H]), row after row, as a nonzero over the stacked seen rows gives them.
std::tuple<at::Tensor, at::Tensor> seen_ids(const at::Tensor& prompt_mask, const at::Tensor& output_counts,
                                            const at::Tensor& slots) {
  TORCH_CHECK(prompt_mask.dim() == 2 && prompt_mask.scalar_type() == at::kBool && prompt_mask.stride(1) == 1
              && prompt_mask.device().is_cpu(), "prompt_mask: a CPU bool [S, V] tensor with contiguous rows");
  TORCH_CHECK(output_counts.dim() == 2 && output_counts.scalar_type() == at::kInt && output_counts.stride(1) == 1
              && output_counts.sizes() == prompt_mask.sizes(), "output_counts: int32 [S, V], contiguous rows");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous());
  const int64_t n = slots.size(0), vocab = prompt_mask.size(1), rows = prompt_mask.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) TORCH_CHECK(sp[j] >= 0 && sp[j] < rows, "slots: in [0, S)");
  std::vector<std::vector<int64_t>> found(n);
  const uint8_t* pm = reinterpret_cast<const uint8_t*>(prompt_mask.data_ptr<bool>());
  const int32_t* oc = output_counts.data_ptr<int32_t>();
  const int64_t pstride = prompt_mask.stride(0), cstride = output_counts.stride(0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) append_seen(pm + sp[j] * pstride, oc + sp[j] * cstride, vocab, found[j]);
  });
  int64_t total = 0;
  for (const auto& ids : found) total += static_cast<int64_t>(ids.size());
  at::Tensor member = at::empty({total}, slots.options());
  at::Tensor ids = at::empty({total}, slots.options());
  int64_t* mp = member.data_ptr<int64_t>();
  int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t j = 0, at_ = 0; j < n; ++j) {
    for (int64_t id : found[j]) { mp[at_] = j; ip[at_] = id; ++at_; }
  }
  return {member, ids};
}

// One call of penalty_cells (native_rows.h). A row's work reads the slot's prompt mask and counts and
// the row of z in place: every index it forms is an id below the vocabulary found by the scan, so a
// helper that finishes after the call returned (the counts updated meanwhile) reads valid memory;
// its result is dropped.
struct PenaltyTask : tokensampler_rows::RowTask {
  std::vector<at::Tensor> held;
  const float* zp = nullptr;
  const uint8_t* pm = nullptr;
  const int32_t* oc = nullptr;
  const float *rep = nullptr, *freq = nullptr, *pres = nullptr;
  const int64_t *rp = nullptr, *sp = nullptr;
  int64_t vocab = 0, z_stride = 0, pm_stride = 0, oc_stride = 0;
  std::vector<std::vector<int64_t>> found;
  std::vector<std::vector<float>> values;

  std::unique_ptr<tokensampler_rows::RowWorker> worker(bool helper) override;
};

class PenaltyWorker : public tokensampler_rows::RowWorker {
 public:
  explicit PenaltyWorker(PenaltyTask& task) : t_(task) {}

  bool compute(int64_t j) override {
    const int64_t s = t_.sp[j];
    const int32_t* counts = t_.oc + s * t_.oc_stride;
    ids_.clear();
    append_seen(t_.pm + s * t_.pm_stride, counts, t_.vocab, ids_);
    const float* row = t_.zp + t_.rp[j] * t_.z_stride;
    const float r = t_.rep[s], f = t_.freq[s], p = t_.pres[s];
    values_.resize(ids_.size());
    for (size_t k = 0; k < ids_.size(); ++k) {
      const int64_t id = ids_[k];
      const int32_t count = counts[id];
      volatile float v = row[id];  // volatile: each operation rounded on its own, as torch's
      v = v > 0.0f ? v / r : v * r;
      const volatile float by_count = f * static_cast<float>(count);
      v = v - by_count;
      const volatile float by_presence = p * (count > 0 ? 1.0f : 0.0f);
      v = v - by_presence;
      values_[k] = v;
    }
    return true;
  }

  void publish(int64_t j) override {
    std::swap(t_.found[j], ids_);
    std::swap(t_.values[j], values_);
  }

 private:
  PenaltyTask& t_;
  std::vector<int64_t> ids_;
  std::vector<float> values_;
};

std::unique_ptr<tokensampler_rows::RowWorker> PenaltyTask::worker(bool) { return std::make_unique<PenaltyWorker>(*this); }

// penalty_cells(z, rows, slots, prompt_mask, output_counts, repetition, frequency, presence): step 5 at
// every id slots[j] has seen (as seen_ids finds them), for row rows[j] of z, without writing z: (row_index
// int64 [H], ids int64 [H], values float32 [H]), row after row, ids ascending. Each value in the
// reference's float32 order (penalties.penalty_edits): v = v > 0 ? v / r : v * r; v = v - f * count;
// v = v - p * [count > 0] (one rounding per operation, no contraction). Rows are shared with `helpers`
// helper threads never waited for (native_rows.h), or with helpers = -1 over torch's threads.
std::tuple<at::Tensor, at::Tensor, at::Tensor> penalty_cells(
    const at::Tensor& z, const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& prompt_mask,
    const at::Tensor& output_counts, const at::Tensor& repetition, const at::Tensor& frequency,
    const at::Tensor& presence, int64_t helpers) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && z.stride(1) == 1 && z.device().is_cpu(),
              "z: a CPU float32 [B, V] tensor with contiguous rows");
  TORCH_CHECK(prompt_mask.dim() == 2 && prompt_mask.scalar_type() == at::kBool && prompt_mask.stride(1) == 1
              && prompt_mask.device().is_cpu() && prompt_mask.size(1) >= z.size(1),
              "prompt_mask: a CPU bool [S, >= V] tensor with contiguous rows");
  TORCH_CHECK(output_counts.dim() == 2 && output_counts.scalar_type() == at::kInt && output_counts.stride(1) == 1
              && output_counts.sizes() == prompt_mask.sizes(), "output_counts: int32 [S, >= V], contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous());
  TORCH_CHECK(slots.sizes() == rows.sizes() && slots.scalar_type() == at::kLong && slots.is_contiguous());
  for (const at::Tensor* t : {&repetition, &frequency, &presence}) {
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                t->size(0) == prompt_mask.size(0), "penalty columns: contiguous float32 [S]");
  }
  const int64_t n = rows.size(0), vocab = z.size(1), num_slots = prompt_mask.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(sp[j] >= 0 && sp[j] < num_slots && rp[j] >= 0 && rp[j] < z.size(0), "rows, slots: in range");
  }
  auto task = std::make_shared<PenaltyTask>();
  PenaltyTask& k = *task;
  k.held = {z, rows, slots, prompt_mask, output_counts, repetition, frequency, presence};
  k.zp = z.data_ptr<float>();
  k.pm = reinterpret_cast<const uint8_t*>(prompt_mask.data_ptr<bool>());
  k.oc = output_counts.data_ptr<int32_t>();
  k.rep = repetition.data_ptr<float>();
  k.freq = frequency.data_ptr<float>();
  k.pres = presence.data_ptr<float>();
  k.rp = rp;
  k.sp = sp;
  k.vocab = vocab;
  k.z_stride = z.stride(0);
  k.pm_stride = prompt_mask.stride(0);
  k.oc_stride = output_counts.stride(0);
  k.found.resize(n);
  k.values.resize(n);
  tokensampler_rows::run(task, n, helpers);
  const auto& found = k.found;
  const auto& values = k.values;
  int64_t total = 0;
  for (const auto& ids : found) total += static_cast<int64_t>(ids.size());
  at::Tensor row_index = at::empty({total}, rows.options());
  at::Tensor ids = at::empty({total}, rows.options());
  at::Tensor out = at::empty({total}, z.options());
  int64_t* ri = row_index.data_ptr<int64_t>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* vp = out.data_ptr<float>();
  for (int64_t j = 0, at_ = 0; j < n; ++j) {
    for (size_t k = 0; k < found[j].size(); ++k, ++at_) {
      ri[at_] = rp[j];
      ip[at_] = found[j][k];
      vp[at_] = values[j][k];
    }
  }
  return {row_index, ids, out};
}

// remove_by_bitmask(z, bitmask, start): in place, every column c of z (float32 [R, W], contiguous
// rows, id start + c, no NaN) whose bit in bitmask (int32 [R, words], xgrammar's layout: bit j of
// word w allows id 32 w + j; ids past the words are removed) is 0 becomes -inf (+inf included);
// every other value is left as it is. A word of ones is skipped, a word of zeros is 32 stores, any
// other is 4 blends of 8 lanes (AVX2).
void remove_by_bitmask(at::Tensor z, const at::Tensor& bitmask, int64_t start) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && z.stride(1) == 1 && z.device().is_cpu(),
              "z: a CPU float32 [R, W] tensor with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.stride(1) == 1
              && bitmask.size(0) == z.size(0) && bitmask.device().is_cpu(), "bitmask: int32 [R, words]");
  TORCH_CHECK(start >= 0, "start >= 0");
  const int64_t rows = z.size(0), width = z.size(1), words = bitmask.size(1);
  const int64_t zstride = z.stride(0), mstride = bitmask.stride(0);
  float* zp = z.data_ptr<float>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float removed = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = zp + r * zstride;
      const uint32_t* bits = mp + r * mstride;
      auto word_of = [&](int64_t id) -> uint32_t { return (id >> 5) < words ? bits[id >> 5] : 0u; };
      int64_t c = 0;
      for (; c < width && ((start + c) & 31) != 0; ++c) {  // up to the first whole word
        if (!((word_of(start + c) >> ((start + c) & 31)) & 1u)) row[c] = removed;
      }
#if defined(__AVX2__)
      const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
      const __m256 minus_inf = _mm256_set1_ps(removed);
      for (; c + 32 <= width; c += 32) {
        const uint32_t word = word_of(start + c);
        if (word == 0xFFFFFFFFu) continue;
        for (int q = 0; q < 4; ++q) {
          const __m256i byte = _mm256_set1_epi32((int)((word >> (8 * q)) & 0xFFu));
          const __m256 drop = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bits),
                                                                     _mm256_setzero_si256()));
          float* at = row + c + 8 * q;
          _mm256_storeu_ps(at, _mm256_blendv_ps(_mm256_loadu_ps(at), minus_inf, drop));
        }
      }
#endif
      for (; c < width; ++c) {
        if (!((word_of(start + c) >> ((start + c) & 31)) & 1u)) row[c] = removed;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(tokensampler_native, m) {
  m.def("gather_at_or_above(Tensor z, Tensor lower, Tensor? scale, int width) -> (Tensor, Tensor, Tensor)");
  m.def("gather_in_range(Tensor z, Tensor low, Tensor high, int width) -> (Tensor, Tensor)");
  m.def("seen_ids(Tensor prompt_mask, Tensor output_counts, Tensor slots) -> (Tensor, Tensor)");
  m.def("penalty_cells(Tensor z, Tensor rows, Tensor slots, Tensor prompt_mask, Tensor output_counts, "
        "Tensor repetition, Tensor frequency, Tensor presence, int helpers) -> (Tensor, Tensor, Tensor)");
  m.def("remove_by_bitmask(Tensor(a!) z, Tensor bitmask, int start) -> ()");
}

TORCH_LIBRARY_IMPL(tokensampler_native, CPU, m) {
  m.impl("gather_at_or_above", &gather_at_or_above);
  m.impl("gather_in_range", &gather_in_range);
  m.impl("seen_ids", &seen_ids);
  m.impl("penalty_cells", &penalty_cells);
  m.impl("remove_by_bitmask", &remove_by_bitmask);
}
