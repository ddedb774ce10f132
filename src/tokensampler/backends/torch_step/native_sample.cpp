// Steps 6-11 for whole rows in one C++ pass per row (backends/torch_step/fused.py calls this; native.py
// builds it with native_gather.cpp into one library).
//
// sample_rows(z, slots, temperature, min_p, top_k, top_p, seed, position, stream, cap, gumbel_min,
// gumbel_max, bitmask, stats_maxima, stats_log_sum, stats_lanes) -> (tokens int64 [B], general bool [B],
// the number of general rows). With stats_maxima given (float32 [B, ceil(V / 64)], no bitmask), each
// row it does not mark general also gets its raw logprobs' statistics (raw_stats_row): the chunk maxima,
// and with stats_lanes > 0 log S into stats_log_sum (float32 [B]).
//
// z: float32 [B, V] with contiguous rows, the rows after the plan's cell edits (-inf = removed);
// bitmask (optional): int32 [B, >= ceil(V / 32)] in xgrammar's layout, each id whose bit is 0 read as
// -inf (the token bitmask of steps 3, applied where each value is read). The parameter columns are
// the sampler state's, indexed by slots[b]. For each row:
//
// 1. one read: the row max m (NaN and +inf noted), and for a greedy row (T = 0) the first id equal to m;
// 2. zt_max = fl(m / T); `lower` = the value below which no id can win the Gumbel argmax (raised to
//    min-p's floor); a strided sample of the row estimates the ids above it;
// 3. one read: every id with z >= the undivided floor listed with fl(z / T) (one IEEE division, as
//    torch's), and, where top-p's total can include ids below the list, the ids in three bands below
//    it counted (a bound on the mass below the list: the float32 exp of each is never computed);
// 4. on the list: p = exp(v - zt_max) by ATen's own exp (the same kernel, the same bits as the
//    definition's torch.exp), min-p (p >= min_p), top-k (the k-th largest value), top-p (the list's
//    kept mass; the crossing found by a partial sort in descending order, grouping equal values); with
//    the total known only within [list mass, list mass + tail bound], the crossing is taken only where
//    both ends give the same one;
// 5. the Gumbel argmax on the kept ids: approximate float32 noise first, then the definition's noise
//    (float64 logs by ATen's own log, after the rows' loop: one call for the whole batch) for the ids
//    within the approximate scores' error margin of the best; lowest id on ties.
//
// Where the list would pass `cap` (a flat row), top-k bounds it by its k-th value (a small top-k does so
// first anyway); a top-p row lists its head, and a row whose kept set reaches below the head, or a
// temperature-only row, takes the deep reads (deep_row: a value histogram, then the race). A top-p row
// alone lists from kTopPDepth below its max first (listed again from the winnable floor where its
// crossing lies below).
//
// A row the pass cannot finish exactly is marked general (the caller runs it on the general routes):
// NaN or +inf in the row, no id left, z / T overflowing or underflowing, a list past `cap` that neither
// a top-k within `cap` nor top-p alone bounds (min-p on a flat row), a deep crossing more than 32 units
// down or in a bin of more than `cap` ids. Rows are shared between the calling thread and `helpers`
// helper threads that are never waited for (native_rows.h: a helper reads its row from a copy it
// makes as it reads the max), or with helpers = -1 over torch's intra-op threads (one parallel region).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "native_rows.h"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();
constexpr int kBands = 3;           // bands below the list counted for top-p's tail bound
constexpr double kBandWidth = 4.0;  // each band's width in units of z / T
constexpr float kNoiseError = 1e-4f;  // |approximate - exact| noise, as gumbel.NOISE_ERROR
constexpr int64_t kSmallTopK = 256;   // top-k up to this bounds the list first where
constexpr int64_t kListsPerTopK = 8;  // the strided estimate lists more than this many times k ids
constexpr float kTopPDepth = 16.0f;   // units of z / T below the max where a top-p row's list starts

// ------------------------------------------------------------------ the noise (core/rng.py)
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; return x ^ (x >> 16);
}

inline uint32_t hash32(uint32_t x) {
  x ^= x >> 17; x *= 0xED5AD4BBu; x ^= x >> 11; x *= 0xAC4C1B51u; x ^= x >> 15; x *= 0x31848BABu;
  return x ^ (x >> 14);
}

#if defined(__AVX2__)
// hash32 of 8 lanes at once (the same bits as hash32 on each).
inline __m256i hash8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 17));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0xED5AD4BBu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 11));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0xAC4C1B51u)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x31848BABu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 14));
}
#endif

inline uint32_t row_key(int64_t seed, int64_t position, int64_t stream) {
  const uint64_t s = static_cast<uint64_t>(seed);
  uint32_t key = mix32(static_cast<uint32_t>(s) ^ 0x9E3779B9u);
  key = mix32(key ^ static_cast<uint32_t>(s >> 32));
  key = mix32(key ^ static_cast<uint32_t>(static_cast<uint64_t>(position)));
  return mix32(key ^ static_cast<uint32_t>(static_cast<uint64_t>(stream)));
}

// g~ within kNoiseError of the exact noise of the same bits (gumbel.approx_gumbel's formula).
inline float approx_gumbel(uint32_t bits) {
  const uint32_t k = bits >> 8;
  const float kf = static_cast<float>(k);
  const float inner = k < (1u << 23) ? std::log((kf + 0.5f) * 0x1p-24f)
                                     : std::log1p(((16777216.0f - kf) - 0.5f) * -0x1p-24f);
  return -std::log(-inner);
}

// skip_below()[j]: every noise index k below it has exact noise g(k) < j (with a margin of 4 indices and
// a relative 2^-30 for the float64 logs), for j = 0 .. kSkipLevels - 1.
constexpr int kSkipLevels = 24;

const uint32_t* skip_below() {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> t(kSkipLevels);
    for (int j = 0; j < kSkipLevels; ++j) {
      const double u = std::exp(-std::exp(-static_cast<double>(j))) * (1.0 - 0x1p-30);
      const double k = std::floor(u * 0x1p24 - 0.5) - 4.0;
      t[j] = k > 0.0 ? static_cast<uint32_t>(k) : 0u;
    }
    return t;
  }();
  return table.data();
}

// u = ((bits >> 8) + 0.5) / 2^24, exact in float64 (rng.uniform_from_bits).
inline double uniform(uint32_t bits) { return (static_cast<double>(bits >> 8) + 0.5) * 0x1p-24; }

// ------------------------------------------------------------------ floors (select.py)
// L such that every id with z / T < L has fl(v + gumbel_max) < fl(zt_max + gumbel_min): it loses to
// the row's max (always kept) whatever the noise.
float win_floor(float zt_max, float gmin, float gmax) {
  const float target = zt_max + gmin;
  float floor = target - gmax;
  floor = floor - (std::fabs(floor) * 0x1p-20f + 0x1p-20f);
  for (int i = 0; i < 64; ++i) {
    if (!(floor + gmax >= target)) return floor;
    floor = floor - (std::fabs(floor) * 0x1p-16f + 0x1p-10f);
  }
  return kNegInf;
}

// A value below every v with fl(exp(fl(v - zt_max))) >= min_p.
float min_p_floor(float zt_max, float min_p) {
  const double bound = static_cast<double>(zt_max) + std::log(static_cast<double>(min_p)) - 1e-3
                       - std::fabs(static_cast<double>(zt_max)) * 0x1p-16;
  return static_cast<float>(bound);
}

// A bound B on z such that every z with fl(z / T) >= lower has z >= B (candidates.undivided_floor).
float undivided_floor(float lower, float temperature) {
  if (std::isinf(lower)) return lower;
  double wide = lower;
  wide = (wide - std::fabs(wide) * 0x1p-20) * static_cast<double>(temperature) - 0x1p-100;
  return std::nextafter(static_cast<float>(wide), kNegInf);
}

// An upper bound on fl(exp(fl(fl(z / T) - zt_max))) for every z < bound.
double mass_bound_below(float bound, float temperature, float zt_max) {
  double v = static_cast<double>(bound) / static_cast<double>(temperature);
  v += std::fabs(v) * 0x1p-20 + std::fabs(static_cast<double>(zt_max)) * 0x1p-20 + 0x1p-40;
  return std::exp(v - static_cast<double>(zt_max)) * (1.0 + 0x1p-20);
}

// ------------------------------------------------------------------ the two reads of a row
// A row's token bitmask (xgrammar's layout: bit j of word w allows id 32 w + j); words == nullptr: none.
struct Mask {
  const uint32_t* words = nullptr;
  bool allows(int64_t i) const { return words == nullptr || ((words[i >> 5] >> (i & 31)) & 1u); }
  uint32_t word(int64_t i) const { return words == nullptr ? 0xFFFFFFFFu : words[i >> 5]; }  // i % 32 == 0
};

// The value an id has after the mask: removed ids are -inf.
inline float masked(const float* row, int64_t i, const Mask& mask) { return mask.allows(i) ? row[i] : kNegInf; }

#if defined(__AVX2__)
// The 8 lanes of byte q of a mask word, as float lanes: all ones where the id is allowed.
inline __m256 allowed_lanes(uint32_t word, int q) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i byte = _mm256_set1_epi32(static_cast<int32_t>((word >> (8 * q)) & 0xFFu));
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(byte, bits), bits));
}
#endif
struct RowMax {
  float max;
  bool nan;
};

// The row's max; with kCopy, the row is also stored into `copy` as it is read (a helper's snapshot:
// native_rows.h), and the max is the copy's.
template <bool kCopy>
RowMax row_max_impl(const float* row, int64_t vocab, const Mask& mask, float* copy) {
  int64_t i = 0;
  float m = kNegInf;
  bool nan = false;
#if defined(__AVX2__)
  __m256 m0 = _mm256_set1_ps(kNegInf), m1 = m0, unordered = _mm256_setzero_ps();
  const __m256 minus_inf = _mm256_set1_ps(kNegInf);
  for (; i + 32 <= vocab; i += 32) {
    const uint32_t word = mask.word(i);
    for (int q = 0; q < 4; q += 2) {
      __m256 a = _mm256_loadu_ps(row + i + 8 * q), b = _mm256_loadu_ps(row + i + 8 * q + 8);
      if constexpr (kCopy) {
        _mm256_storeu_ps(copy + i + 8 * q, a);
        _mm256_storeu_ps(copy + i + 8 * q + 8, b);
      }
      if (mask.words != nullptr) {  // removed ids: -inf (a removed NaN is not a NaN of the row)
        a = _mm256_blendv_ps(minus_inf, a, allowed_lanes(word, q));
        b = _mm256_blendv_ps(minus_inf, b, allowed_lanes(word, q + 1));
      }
      m0 = _mm256_max_ps(m0, a);
      m1 = _mm256_max_ps(m1, b);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(m0, m1));
  for (float x : lanes) m = std::max(m, x);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < vocab; ++i) {
    float x = row[i];
    if constexpr (kCopy) copy[i] = x;
    if (!mask.allows(i)) x = kNegInf;
    if (x != x) nan = true;
    else if (x > m) m = x;
  }
  return {m, nan};
}

RowMax row_max(const float* row, int64_t vocab, const Mask& mask) { return row_max_impl<false>(row, vocab, mask, nullptr); }

// The first allowed id whose value is `value` (32 ids at a time with AVX2); 0 if none.
int64_t first_equal(const float* row, int64_t vocab, float value, const Mask& mask) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(value);
  for (; i + 32 <= vocab; i += 32) {
    uint32_t hits = 0;
    for (int q = 0; q < 4; ++q) {
      hits |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i + 8 * q), target,
                                                                      _CMP_EQ_OQ))) << (8 * q);
    }
    hits &= mask.word(i);
    if (hits != 0) return i + __builtin_ctz(hits);
  }
#endif
  for (; i < vocab; ++i) {
    if (row[i] == value && mask.allows(i)) return i;
  }
  return 0;
}

// The strided estimate of the ids with z >= floor (one id in 64).
int64_t estimated_count(const float* row, int64_t vocab, float floor, const Mask& mask) {
  int64_t hits = 0, samples = 0;
  for (int64_t i = 0; i < vocab; i += 64, ++samples) hits += masked(row, i, mask) >= floor;
  return samples == 0 ? 0 : hits * vocab / samples;
}

// A value with about `want` ids of the row at or above it, from the strided sample (one id in 64):
// the head of a row too flat for a list. -inf where the sample is too small to place it.
// `tail_estimate`: the sample's estimate of the mass below that value (p = exp(z / T - zt_max), each
// sampled id standing for 64): only a guess, used to skip a head whose crossing lies below it.
float head_floor(const float* row, int64_t vocab, int64_t want, const Mask& mask, float temperature, float zt_max,
                 double& tail_estimate) {
  thread_local std::vector<float> sample;
  sample.clear();
  for (int64_t i = 0; i < vocab; i += 64) sample.push_back(masked(row, i, mask));
  const int64_t rank = want * static_cast<int64_t>(sample.size()) / std::max<int64_t>(vocab, 1);
  if (rank < 1 || rank >= static_cast<int64_t>(sample.size())) return kNegInf;
  std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<float>());
  tail_estimate = 0.0;
  for (auto it = sample.begin() + rank + 1; it != sample.end(); ++it) {
    tail_estimate += 64.0 * std::exp(static_cast<double>(*it) / temperature - zt_max);
  }
  return sample[rank];
}

// A thread's lists, grown to the longest list it has held (plus 32 entries of slack for the packed
// stores) and kept from call to call where they are at most half the fp32 logits of the thread's rows
// (a steady batch, or a single row within the cap, allocates nothing and touches no fresh page).
// `last_call_bytes`: the lists of the threads of the last call, summed at their largest.
std::atomic<int64_t> last_call_bytes{0};

struct Scratch {
  std::vector<float> values, p, approx;
  std::vector<int32_t> ids, order;  // `approx` doubles as the upper sets' and the heap's work array
  int64_t bytes() const { return 5 * 4 * static_cast<int64_t>(values.size()); }
  // room for at least `n` + 32 entries in each array (grown by half again, never past cap + 32)
  void reserve(int64_t n, int64_t cap) {
    if (static_cast<int64_t>(values.size()) >= std::min(n, cap) + 32) return;
    const int64_t want = std::min(std::max<int64_t>(n + n / 2, 1024), cap) + 32;
    for (auto* f : {&values, &p, &approx}) f->resize(want);
    for (auto* i : {&ids, &order}) i->resize(want);
  }
  void release() {
    for (auto* f : {&values, &p, &approx}) std::vector<float>().swap(*f);
    for (auto* i : {&ids, &order}) std::vector<int32_t>().swap(*i);
  }
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// exp's input for an id outside the tail or with p below float32's normal range: exp(-87) = 1.6e-38,
// a normal float32 (-inf and underflowing inputs take the vector exp's slow path, 3x the time). Each
// such id adds at most 1.7e-38 to a total of at least 1 (the max's p): V of them stay far below the
// total's float64 resolution (2.2e-16), so the float64 sum is the exact one up to its rounding.
constexpr float kLeastExp = -87.0f;

// The mass top-p's total takes from below the list: the float64 sum of p = exp(fl(fl(z / T) - zt_max))
// (ATen's exp, a block at a time) over the ids with z < list_floor and z / T >= kept_from (top-k's k-th
// value, or -inf).
double exact_tail(const float* row, int64_t vocab, float list_floor, float temperature, float zt_max,
                  float kept_from, const Mask& mask) {
  constexpr int64_t kBlock = 32768;  // ATen's exp is a dispatch per block: few, large blocks
  thread_local std::vector<float> block(kBlock);
  float* b = block.data();
  double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // partial sums: the float64 adds do not wait on each other
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t len = std::min(kBlock, vocab - start);
    int64_t i = 0;
#if defined(__AVX2__)
    if (mask.words == nullptr) {  // 8 ids at a time: IEEE division, compares, subtraction
      const __m256 t = _mm256_set1_ps(temperature), lf = _mm256_set1_ps(list_floor);
      const __m256 kf = _mm256_set1_ps(kept_from), top = _mm256_set1_ps(zt_max), least = _mm256_set1_ps(kLeastExp);
      for (; i + 8 <= len; i += 8) {
        const __m256 x = _mm256_loadu_ps(row + start + i);
        const __m256 v = _mm256_div_ps(x, t);
        const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(x, lf, _CMP_LT_OQ), _mm256_cmp_ps(v, kf, _CMP_GE_OQ));
        _mm256_storeu_ps(b + i, _mm256_blendv_ps(least, _mm256_max_ps(_mm256_sub_ps(v, top), least), keep));
      }
    }
#endif
    for (; i < len; ++i) {
      const float xi = masked(row, start + i, mask);
      const float v = xi / temperature;
      b[i] = xi < list_floor && v >= kept_from ? std::max(v - zt_max, kLeastExp) : kLeastExp;
    }
    at::from_blob(b, {len}, at::TensorOptions().dtype(at::kFloat)).exp_();
    i = 0;
#if defined(__AVX2__)
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    for (; i + 8 <= len; i += 8) {
      const __m256 e = _mm256_loadu_ps(b + i);
      acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
      acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    alignas(32) double lanes[8];
    _mm256_store_pd(lanes, acc0);
    _mm256_store_pd(lanes + 4, acc1);
    for (int q = 0; q < 8; ++q) part[q] += lanes[q];
#endif
    for (; i < len; ++i) part[0] += static_cast<double>(b[i]);
  }
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// The k-th largest value of a row without NaN (1 <= k <= vocab; -inf counts as a value): one read,
// a min-heap of the k largest so far (k is at most the list's cap); 32 ids at a time are compared with
// the heap's least, and only those above it are offered.
float kth_of_row(const float* row, int64_t vocab, int64_t k, const Mask& mask) {
  thread_local std::vector<float> work;  // its own array: the lists' pointers stay valid in the caller
  if (static_cast<int64_t>(work.size()) < k) work.resize(k);
  float* heap = work.data();
  for (int64_t i = 0; i < k; ++i) heap[i] = masked(row, i, mask);
  std::make_heap(heap, heap + k, std::greater<float>());
  auto offer = [&](int64_t i) {
    if (row[i] > heap[0] && mask.allows(i)) {
      std::pop_heap(heap, heap + k, std::greater<float>());
      heap[k - 1] = row[i];
      std::push_heap(heap, heap + k, std::greater<float>());
    }
  };
  int64_t i = k;
#if defined(__AVX2__)
  for (; i < vocab && i % 32 != 0; ++i) offer(i);
  for (; i + 32 <= vocab; i += 32) {
    const __m256 least = _mm256_set1_ps(heap[0]);
    int above = 0;
    for (int q = 0; q < 4; ++q) {
      above |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i + 8 * q), least, _CMP_GT_OQ)) << (8 * q);
    }
    above &= static_cast<int>(mask.word(i));
    while (above != 0) {  // ids above the least when the block began: offered in order
      const int l = __builtin_ctz(static_cast<unsigned>(above));
      above &= above - 1;
      offer(i + l);
    }
  }
#endif
  for (; i < vocab; ++i) offer(i);
  return heap[0];
}

#if defined(__AVX2__)
// left_pack()[m]: the lane indices of the set bits of m (8 bits), in order, for _mm256_permutevar8x32.
const __m256i* left_pack() {
  alignas(32) static int32_t table[256][8];
  static const bool filled = [] {
    for (int m = 0; m < 256; ++m) {
      int w = 0;
      for (int b = 0; b < 8; ++b) if (m & (1 << b)) table[m][w++] = b;
      for (; w < 8; ++w) table[m][w] = 0;
    }
    return true;
  }();
  (void)filled;
  return reinterpret_cast<const __m256i*>(table);
}
#endif

#if defined(__AVX2__)
// Stores the lanes of `x` whose bit is set in `hits` (8 bits), in order, at values[0..] and their ids
// (first + lane) at ids[0..]: 8 lanes written, the hits first. Returns how many hits.
inline int pack_store(__m256 x, int hits, int64_t first, float* values, int32_t* ids) {
  const __m256i perm = _mm256_load_si256(left_pack() + hits);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_storeu_ps(values, _mm256_permutevar8x32_ps(x, perm));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(ids), _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(first)),
                                                                       _mm256_permutevar8x32_epi32(lane, perm)));
  return __builtin_popcount(static_cast<unsigned>(hits));
}
#endif

// Lists every id with z >= floor (value fl(z / T)) into the scratch, counting in ge[j] the ids with
// z >= bands[j] where bands are given. Returns the number listed, or -1 past `cap`.
int64_t list_row(const float* row, int64_t vocab, float floor, float temperature, const float* bands,
                 int64_t* ge, int64_t cap, Scratch& s, const Mask& mask) {
  int64_t n = 0, i = 0;
  float* values = s.values.data();
  int32_t* ids = s.ids.data();
#if defined(__AVX2__)
  const __m256 fv = _mm256_set1_ps(floor);
  __m256 bv[kBands];
  __m256i counted[kBands];  // per lane: minus the ids at or above each band (a true compare is -1)
  for (int j = 0; j < kBands; ++j) {
    bv[j] = _mm256_set1_ps(bands != nullptr ? bands[j] : kPosInf);
    counted[j] = _mm256_setzero_si256();
  }
  for (; i + 32 <= vocab; i += 32) {  // blocks of 32 ids: a block with a hit packs each 8 left and stores it
    __m256 x[4];
    int m[4];
    const uint32_t word = mask.word(i);
    for (int q = 0; q < 4; ++q) {
      x[q] = _mm256_loadu_ps(row + i + 8 * q);
      m[q] = _mm256_movemask_ps(_mm256_cmp_ps(x[q], fv, _CMP_GE_OQ)) & static_cast<int>((word >> (8 * q)) & 0xFFu);
      if (bands != nullptr) {
        for (int j = 0; j < kBands; ++j) {
          counted[j] = _mm256_add_epi32(counted[j], _mm256_castps_si256(_mm256_cmp_ps(x[q], bv[j], _CMP_GE_OQ)));
        }
      }
    }
    if ((m[0] | m[1] | m[2] | m[3]) == 0) continue;
    if (n + 32 > static_cast<int64_t>(s.values.size())) {
      s.reserve(n, cap);
      values = s.values.data();
      ids = s.ids.data();
    }
    for (int q = 0; q < 4; ++q) n += pack_store(x[q], m[q], i + 8 * q, values + n, ids + n);  // room for 32 more
    if (n > cap) return -1;
  }
  if (bands != nullptr) {  // lanes hold at most vocab / 8 < 2^31 each
    alignas(32) int32_t lanes[8];
    for (int j = 0; j < kBands; ++j) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), counted[j]);
      for (int32_t c : lanes) ge[j] -= c;
    }
  }
#endif
  for (; i < vocab; ++i) {
    const float x = masked(row, i, mask);
    if (bands != nullptr) {
      for (int j = 0; j < kBands; ++j) ge[j] += x >= bands[j];
    }
    if (x >= floor) {
      if (n >= cap) return -1;
      if (n + 1 > static_cast<int64_t>(s.values.size())) {
        s.reserve(n, cap);
        values = s.values.data();
        ids = s.ids.data();
      }
      values[n] = x, ids[n] = static_cast<int32_t>(i);
      ++n;
    }
  }
  if (n > cap) return -1;
  for (int64_t j = 0; j < n; ++j) values[j] = values[j] / temperature;  // IEEE division, vectorised
  return n;
}

// p[j] = exp(values[j] - zt_max) by ATen's exp (bit for bit torch.exp's float32 result).
void relative_probabilities(Scratch& s, int64_t n, float zt_max) {
  for (int64_t j = 0; j < n; ++j) s.p[j] = s.values[j] - zt_max;
  at::from_blob(s.p.data(), {n}, at::TensorOptions().dtype(at::kFloat)).exp_();
}

// The positions among order[0, count) whose value is at least zt_max - depth, for depths 4, 8, 16, then
// every one: an upper set of the values (every id above a member is a member), small on peaked rows.
constexpr float kDepths[] = {4.0f, 8.0f, 16.0f, kPosInf};

int64_t upper_set(const Scratch& s, const int32_t* order, int64_t count, float floor, int32_t* out) {
  int64_t w = 0;
  for (int64_t j = 0; j < count; ++j) {
    const int32_t at = order != nullptr ? order[j] : static_cast<int32_t>(j);
    if (s.values[at] >= floor) out[w++] = at;
  }
  return w;
}

// The k-th largest listed value (1 <= k <= n), searched in the smallest upper set holding k ids.
float kth_largest(Scratch& s, int64_t n, int64_t k, float zt_max) {
  int32_t* set = reinterpret_cast<int32_t*>(s.approx.data());  // free until the draw
  for (float depth : kDepths) {
    const int64_t m = upper_set(s, nullptr, n, zt_max - depth, set);
    if (m >= k) {
      const float* v = s.values.data();
      std::nth_element(set, set + (k - 1), set + m,
                       [v](int32_t a, int32_t b) { return v[a] > v[b]; });
      return v[set[k - 1]];
    }
  }
  return kNegInf;  // unreachable: the last set is the whole list
}

// Top-p's crossing for two bounds at once (low <= high): the first value, descending, whose group of
// equal values has at least the bound of kept mass strictly above it; found_* false where no group of
// the kept ids reaches it. Searched in growing upper sets of the kept ids, each sorted.
struct Crossing {
  bool found_low = false, found_high = false;
  float low = kNegInf, high = kNegInf;
};

Crossing top_p_crossing(Scratch& s, const int32_t* kept_order, int64_t kept, float zt_max, double bound_low,
                        double bound_high) {
  const float* v = s.values.data();
  const float* p = s.p.data();
  int32_t* set = reinterpret_cast<int32_t*>(s.approx.data());  // free until the draw
  for (float depth : kDepths) {
    const int64_t m = upper_set(s, kept_order, kept, zt_max - depth, set);
    std::sort(set, set + m, [v](int32_t a, int32_t b) { return v[a] > v[b]; });
    Crossing c;
    double running = 0.0;  // the mass of the values strictly above the current group
    for (int64_t i = 0; i < m;) {
      const float value = v[set[i]];
      if (!c.found_low && running >= bound_low) { c.found_low = true; c.low = value; }
      if (running >= bound_high) { c.found_high = true; c.high = value; return c; }
      double group = 0.0;
      int64_t j = i;
      for (; j < m && v[set[j]] == value; ++j) group += static_cast<double>(p[set[j]]);
      running += group;
      i = j;
    }
    if (m == kept) return c;
  }
  return Crossing{};  // unreachable: the last set is every kept id
}

struct Exact {
  std::vector<int32_t> ids;
  std::vector<float> values;
  std::vector<uint32_t> bits;
};

enum class Row { kDone, kGeneral, kNoise };

// ------------------------------------------------------------------ rows whose kept set reaches deep
// A row too flat for a list whose kept set is most of it: top-p's crossing below a head of cap / 2
// ids (top-p alone), or nothing to cut (temperature alone). Two more reads of the row, both of a row
// the max's read left in the core's cache:
//
// 1. (top-p) the histogram read: v = fl(z / T) and p = exp(v - zt_max) (ATen's exp, a block at a
//    time) for every id, p's float64 mass summed per value bin: kBins bins of 1 / kBinScale below
//    zt_max, then one bin for every id further down (-inf included). Bins are ranges of values in
//    order, so the bin where the mass from the top reaches top_p * total holds the crossing (or the
//    crossing is the first value after it);
// 2. the race read: the ids of the bins above that one are kept and race (the Gumbel argmax against
//    the best approximate score so far, the noise skip table at steps of 1 / kFineSteps); the ids of
//    that bin are listed, sorted and scanned exactly as top_p_crossing does, and those kept race too.
constexpr int kBins = 4096;
constexpr float kBinScale = 128.0f;  // bins per unit of z / T: the first kBins span 32 units
constexpr int kFineSteps = 8;        // the race's skip levels per unit of noise
constexpr int kFineLevels = kFineSteps * kSkipLevels;
constexpr int64_t kDeepBlock = 16384;  // ids per ATen exp call of the histogram read

// skip_fine()[j]: every noise index k below it has exact noise g(k) < j / kFineSteps (skip_below's
// margins).
const uint32_t* skip_fine() {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> t(kFineLevels);
    for (int j = 0; j < kFineLevels; ++j) {
      const double g = static_cast<double>(j) / kFineSteps;
      const double u = std::exp(-std::exp(-g)) * (1.0 - 0x1p-30);
      const double k = std::floor(u * 0x1p24 - 0.5) - 4.0;
      t[j] = k > 0.0 ? static_cast<uint32_t>(k) : 0u;
    }
    return t;
  }();
  return table.data();
}

// The bin of a value v <= zt_max: monotone (a larger v never has a larger bin).
inline int32_t bin_of(float v, float zt_max) {
  return static_cast<int32_t>(std::min((zt_max - v) * kBinScale, static_cast<float>(kBins)));
}

// A lower bound on the exact score of an id whose approximate score is a.
inline float score_floor(float a) { return a - (2 * kNoiseError + std::fabs(a) * 0x1p-20f + 0x1p-16f); }

struct Deep {
  std::vector<float> w, p;  // the histogram read's block: w = v - zt_max (clamped), then p = exp(w)
  std::vector<double> hist;
  std::vector<float> racer_v, racer_a;
  std::vector<int32_t> racer_id;
};

Deep& thread_deep() {
  thread_local Deep deep;
  return deep;
}

// v = fl(z / T) for 8 ids (T = 1: z itself, the division's exact result, without its cost).
#if defined(__AVX2__)
inline __m256 divided(__m256 x, __m256 t, bool unit) { return unit ? x : _mm256_div_ps(x, t); }
#endif

// The histogram read: hist[0 .. kBins] (float64 masses per bin); returns the total. Per block: w =
// max(v - zt_max, kLeastExp) written once, p = exp(w) by ATen's exp beside it, then each id's bin
// (from -w: fl(zt_max - v) = -fl(v - zt_max)) and its mass added.
double deep_histogram(const float* row, int64_t vocab, float temperature, float zt_max, const Mask& mask,
                      Deep& d) {
  d.w.resize(kDeepBlock);
  d.p.resize(kDeepBlock);
  d.hist.assign(2 * (kBins + 1), 0.0);  // two interleaved histograms: fewer adds waiting on each other
  double* h0 = d.hist.data();
  double* h1 = h0 + (kBins + 1);
  const bool unit = temperature == 1.0f;
  float* wb = d.w.data();
  float* pb = d.p.data();
  for (int64_t start = 0; start < vocab; start += kDeepBlock) {
    const int64_t len = std::min(kDeepBlock, vocab - start);
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 t = _mm256_set1_ps(temperature), top = _mm256_set1_ps(zt_max), least = _mm256_set1_ps(kLeastExp);
    const __m256 minus_inf = _mm256_set1_ps(kNegInf);
    for (; i + 32 <= len; i += 32) {  // start is a multiple of 32: whole mask words
      const uint32_t word = mask.word(start + i);
      for (int q = 0; q < 4; ++q) {
        __m256 x = _mm256_loadu_ps(row + start + i + 8 * q);
        if (mask.words != nullptr) x = _mm256_blendv_ps(minus_inf, x, allowed_lanes(word, q));
        _mm256_storeu_ps(wb + i + 8 * q, _mm256_max_ps(_mm256_sub_ps(divided(x, t, unit), top), least));
      }
    }
#endif
    for (; i < len; ++i) wb[i] = std::max(masked(row, start + i, mask) / temperature - zt_max, kLeastExp);
    const auto floats = at::TensorOptions().dtype(at::kFloat);
    at::Tensor p_block = at::from_blob(pb, {len}, floats);
    at::exp_out(p_block, at::from_blob(wb, {len}, floats));
    i = 0;
#if defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(-kBinScale), last = _mm256_set1_ps(static_cast<float>(kBins));
    alignas(32) int32_t bins[8];
    for (; i + 8 <= len; i += 8) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(bins),
                         _mm256_cvttps_epi32(_mm256_min_ps(_mm256_mul_ps(_mm256_loadu_ps(wb + i), scale), last)));
      for (int q = 0; q < 8; q += 2) {
        h0[bins[q]] += static_cast<double>(pb[i + q]);
        h1[bins[q + 1]] += static_cast<double>(pb[i + q + 1]);
      }
    }
#endif
    for (; i < len; ++i) {  // the bin from w: -w = fl(zt_max - v) where w is not clamped, else the last
      h0[static_cast<int32_t>(std::min(-wb[i] * kBinScale, static_cast<float>(kBins)))] += static_cast<double>(pb[i]);
    }
  }
  double total = 0.0;
  for (int b = 0; b <= kBins; ++b) {
    h0[b] += h1[b];
    total += h0[b];
  }
  return total;
}

// Races an id known to be kept: skipped where its noise index says it cannot reach `best_floor` (a
// lower bound on the best kept score), else its approximate score is recorded.
inline void race(float v, int32_t id, uint32_t key, const uint32_t* fine, float& best_floor, Deep& d) {
  const uint32_t bits = hash32(key ^ static_cast<uint32_t>(id));
  const float t = (best_floor - v - 1e-3f) * kFineSteps;
  if (t >= 0.0f && (bits >> 8) < fine[static_cast<int>(std::min(t, static_cast<float>(kFineLevels - 1)))]) return;
  const float a = v + approx_gumbel(bits);
  d.racer_v.push_back(v);
  d.racer_a.push_back(a);
  d.racer_id.push_back(id);
  best_floor = std::max(best_floor, score_floor(a));
}

// Steps 10-11 of a row whose kept set reaches deep (see above): top_p >= 1 keeps every id. The
// crossing bin's ids are listed in the scratch's lists (at most `cap`, else kGeneral).
Row deep_row(const float* row, const Mask& mask, int64_t vocab, float temperature, float zt_max, double top_p,
             uint32_t key, int64_t cap, Scratch& s, int64_t& token, Exact& exact) {
  Deep& d = thread_deep();
  int32_t cross_bin = kBins + 1;  // ids in bins before it are kept; those in it are decided by the scan
  double above = 0.0, bound = 0.0;  // the mass of the bins before cross_bin; top_p * total
  if (top_p < 1.0) {
    bound = top_p * deep_histogram(row, vocab, temperature, zt_max, mask, d);
    int32_t b = 0;
    for (; b <= kBins; ++b) {
      if (above + d.hist[b] >= bound) break;
      above += d.hist[b];
    }
    if (b >= kBins) return Row::kGeneral;  // the crossing more than 32 units below the max
    cross_bin = b;
  }
  d.racer_v.clear();
  d.racer_a.clear();
  d.racer_id.clear();
  const uint32_t* fine = skip_fine();
  float best_floor = kNegInf;
  int64_t n = 0;  // the crossing bin's ids, listed
  const bool unit = temperature == 1.0f;
  s.reserve(std::min<int64_t>(1024, cap), cap);
  int64_t i = 0;
#if defined(__AVX2__)
  {
    const __m256 t = _mm256_set1_ps(temperature), top = _mm256_set1_ps(zt_max), scale = _mm256_set1_ps(kBinScale);
    const __m256 last = _mm256_set1_ps(static_cast<float>(kBins)), minus_inf = _mm256_set1_ps(kNegInf);
    const __m256 slack = _mm256_set1_ps(1e-3f), steps = _mm256_set1_ps(static_cast<float>(kFineSteps));
    const __m256 zero = _mm256_setzero_ps(), top_level = _mm256_set1_ps(static_cast<float>(kFineLevels - 1));
    const __m256i cross = _mm256_set1_epi32(cross_bin), key8 = _mm256_set1_epi32(static_cast<int32_t>(key));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int* table = reinterpret_cast<const int*>(fine);
    for (; i + 32 <= vocab; i += 32) {
      const uint32_t word = mask.word(i);
      for (int q = 0; q < 4; ++q) {
        __m256 x = _mm256_loadu_ps(row + i + 8 * q);
        if (mask.words != nullptr) x = _mm256_blendv_ps(minus_inf, x, allowed_lanes(word, q));
        const __m256 v = divided(x, t, unit);
        const __m256i bin = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(top, v), scale), last));
        const __m256i base = _mm256_set1_epi32(static_cast<int32_t>(i + 8 * q));
        const int in_bin = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(bin, cross)));
        if (in_bin != 0) {
          if (n + 8 > cap) return Row::kGeneral;
          if (n + 8 > static_cast<int64_t>(s.values.size())) s.reserve(n + 8, cap);
          n += pack_store(v, in_bin, i + 8 * q, s.values.data() + n, s.ids.data() + n);
        }
        const __m256i kept = _mm256_cmpgt_epi32(cross, bin);
        if (_mm256_testz_si256(kept, kept)) continue;
        const __m256i xh = hash8(_mm256_xor_si256(key8, _mm256_add_epi32(base, lane)));
        const __m256 level = _mm256_mul_ps(_mm256_sub_ps(_mm256_sub_ps(_mm256_set1_ps(best_floor), v), slack), steps);
        const __m256i at = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(level, zero), top_level));
        const __m256i below = _mm256_cmpgt_epi32(_mm256_i32gather_epi32(table, at, 4), _mm256_srli_epi32(xh, 8));
        const __m256 skipped = _mm256_and_ps(_mm256_cmp_ps(level, zero, _CMP_GE_OQ), _mm256_castsi256_ps(below));
        uint32_t live = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_andnot_ps(skipped, _mm256_castsi256_ps(kept))));
        if (live == 0) continue;
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, v);
        while (live) {  // the scalar test again, against the floor as it rises
          const int l = __builtin_ctz(live);
          live &= live - 1;
          race(lanes[l], static_cast<int32_t>(i + 8 * q + l), key, fine, best_floor, d);
        }
      }
    }
  }
#endif
  for (; i < vocab; ++i) {
    const float v = masked(row, i, mask) / temperature;
    const int32_t bin = bin_of(v, zt_max);
    if (bin < cross_bin) {
      race(v, static_cast<int32_t>(i), key, fine, best_floor, d);
    } else if (bin == cross_bin) {
      if (n + 1 > cap) return Row::kGeneral;
      if (n + 1 > static_cast<int64_t>(s.values.size())) s.reserve(n + 1, cap);
      s.values[n] = v;
      s.ids[n] = static_cast<int32_t>(i);
      ++n;
    }
  }
  float cut = kNegInf;  // the crossing bin's ids are kept where v > cut
  if (n > 0) {  // the crossing bin: its exact scan (the mass still needed within it), then its kept ids race
    relative_probabilities(s, n, zt_max);
    int32_t* order = s.order.data();
    std::iota(order, order + n, 0);
    const double need = bound - above;  // > 0: the bins above it hold less than the bound
    const Crossing c = top_p_crossing(s, order, n, zt_max, need, need);
    if (c.found_high) cut = c.high;  // else the whole bin is kept (the crossing is the next value down)
    for (int64_t j = 0; j < n; ++j) {
      if (s.values[j] > cut) race(s.values[j], s.ids[j], key, fine, best_floor, d);
    }
  }
  float best = kNegInf;
  for (float a : d.racer_a) best = std::max(best, a);
  const float margin = 2 * kNoiseError + std::fabs(best) * 0x1p-20f + 0x1p-16f;
  exact.ids.clear();
  exact.values.clear();
  exact.bits.clear();
  for (size_t j = 0; j < d.racer_a.size(); ++j) {
    if (d.racer_a[j] >= best - margin) {
      exact.ids.push_back(d.racer_id[j]);
      exact.values.push_back(d.racer_v[j]);
      exact.bits.push_back(hash32(key ^ static_cast<uint32_t>(d.racer_id[j])));
    }
  }
  if (exact.ids.empty()) return Row::kGeneral;  // unreachable: the max is kept and finite
  if (exact.ids.size() == 1) {
    token = exact.ids[0];
    return Row::kDone;
  }
  return Row::kNoise;
}


// Steps 7-11 for one sampled row whose max m is finite. Either the token (kDone), the general routes
// (kGeneral), or the ids whose exact noise decides (kNoise: `exact` filled).
Row sample_row(const float* row, const Mask& mask, int64_t vocab, float m, float temperature, float min_p, int64_t top_k,
               double top_p, uint32_t key, int64_t cap, float gmin, float gmax, Scratch& s, int64_t& token,
               Exact& exact, bool shallow_first = true) {
  const float zt_max = m / temperature;
  if (std::isinf(zt_max)) return Row::kGeneral;  // overflow (+inf rule) or every id underflowing
  float lower = win_floor(zt_max, gmin, gmax);
  if (min_p > 0.0f) lower = std::max(lower, min_p_floor(zt_max, min_p));
  // top-p alone keeps every id above its crossing, usually far above the winnable floor: the list
  // starts kTopPDepth below the max (the bands below it bound the rest's mass), and only a row whose
  // crossing lies below that list is listed again from the winnable floor
  const bool shallow = shallow_first && top_p < 1.0 && min_p <= 0.0f && top_k <= 0 && zt_max - kTopPDepth > lower;
  if (shallow) lower = zt_max - kTopPDepth;
  float list_floor = undivided_floor(lower, temperature);
  bool bounded = false;  // the list's floor raised to top-k's k-th value
  auto bound_by_top_k = [&]() {  // a row too flat for a list whose top-k bounds it
    if (bounded || top_k <= 0 || top_k > cap || top_k >= vocab) return false;
    // the k-th value of z / T is fl(k-th z / T), division being monotone
    lower = std::max(lower, kth_of_row(row, vocab, top_k, mask) / temperature);
    list_floor = undivided_floor(lower, temperature);
    bounded = true;
    return true;
  };
  // a small top-k on a row with many more ids above its floor: the list bounded by the k-th value at
  // once (one read without writes, instead of a long list of which top-k keeps k)
  const int64_t estimate = estimated_count(row, vocab, list_floor, mask);
  if (top_k > 0 && top_k <= kSmallTopK && estimate > kListsPerTopK * top_k) bound_by_top_k();
  // a row too flat for a list of every id that can win: top-k bounds the list by its k-th value; a
  // top-p row alone lists its head (the ids above a floor the strided sample puts about cap / 2 ids
  // above), takes its total exactly, and is finished where the crossing lies in the head
  bool head = false;
  double tail_guess = 0.0;
  if (!bounded && estimate > cap && !bound_by_top_k()) {
    if (!(min_p <= 0.0f && top_k <= 0)) return Row::kGeneral;
    if (top_p >= 1.0) return deep_row(row, mask, vocab, temperature, zt_max, top_p, key, cap, s, token, exact);
    const float floor = head_floor(row, vocab, cap / 2, mask, temperature, zt_max, tail_guess);
    if (!(floor > list_floor)) return deep_row(row, mask, vocab, temperature, zt_max, top_p, key, cap, s, token, exact);
    list_floor = floor;
    head = true;
  }
  // top-p's total may reach below the list (no min-p; top-k's k-th value may lie below it): the mass
  // there is bounded by counting the ids below the list in bands (the head: taken exactly)
  const bool open_tail = top_p < 1.0 && min_p <= 0.0f && !head;
  float bands[kBands];
  int64_t ge[kBands] = {0, 0, 0};
  double tail_bound[kBands + 1];
  auto list = [&]() {  // the list above list_floor, and the bands below it where the tail is open
    if (open_tail) {
      float above = list_floor;
      for (int j = 0; j < kBands; ++j) {
        bands[j] = static_cast<float>((static_cast<double>(lower) - kBandWidth * (j + 1)) * temperature);
        bands[j] = std::min(bands[j], std::nextafter(above, kNegInf));
        tail_bound[j] = mass_bound_below(above, temperature, zt_max);
        above = bands[j];
        ge[j] = 0;
      }
      tail_bound[kBands] = mass_bound_below(above, temperature, zt_max);
    }
    return list_row(row, vocab, list_floor, temperature, open_tail ? bands : nullptr, ge, cap, s, mask);
  };
  int64_t n = list();
  if (n < 0 && bound_by_top_k()) n = list();  // past the cap, the estimate notwithstanding
  if (n < 0 && head) return deep_row(row, mask, vocab, temperature, zt_max, top_p, key, cap, s, token, exact);
  if (n < 0 && shallow) {  // the strided estimate missed: past the cap even 16 units down, the row is flat
    return sample_row(row, mask, vocab, m, temperature, min_p, top_k, top_p, key, cap, gmin, gmax, s, token,
                      exact, false);
  }
  if (n <= 0) return Row::kGeneral;  // past the cap (n = 0 cannot happen: the max is listed)
  float* v = s.values.data();
  int32_t* order = s.order.data();
  // the kept ids, as positions in the list
  int64_t kept = n;
  std::iota(order, order + n, 0);
  const bool needs_p = min_p > 0.0f || top_p < 1.0;
  if (needs_p) relative_probabilities(s, n, zt_max);
  if (min_p > 0.0f) {
    int64_t w = 0;
    for (int64_t j = 0; j < kept; ++j) {
      if (s.p[order[j]] >= min_p) order[w++] = order[j];
    }
    kept = w;
  }
  if (top_k > 0) {
    if (top_k <= n) {  // the k-th largest of the row is listed
      const float kth = kth_largest(s, n, top_k, zt_max);
      int64_t w = 0;
      for (int64_t j = 0; j < kept; ++j) {
        if (v[order[j]] >= kth) order[w++] = order[j];
      }
      kept = w;
    }  // else top-k keeps every listed id, and perhaps ids below: within the tail bound
  }
  float cut = kNegInf;  // kept: v > cut (top-p), over the ids kept so far
  bool top_p_cut = false;
  if (top_p < 1.0) {
    double part[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t j = 0;
    for (; j + 4 <= kept; j += 4) {
      for (int q = 0; q < 4; ++q) part[q] += static_cast<double>(s.p[order[j + q]]);
    }
    for (; j < kept; ++j) part[0] += static_cast<double>(s.p[order[j]]);
    const double listed = (part[0] + part[1]) + (part[2] + part[3]);
    double tail = 0.0;
    if (open_tail && !(top_k > 0 && top_k <= n)) {  // else top-k's k-th value is listed: nothing below is kept
      const int64_t counts[kBands + 1] = {ge[0] - n, ge[1] - ge[0], ge[2] - ge[1], vocab - ge[2]};
      for (int j = 0; j <= kBands; ++j) tail += static_cast<double>(counts[j]) * tail_bound[j];
    }
    // a head whose crossing the sample puts well below it (flat top-p rows): the general routes at once
    if (head && listed < top_p * (listed + 0.5 * tail_guess)) {
      return deep_row(row, mask, vocab, temperature, zt_max, top_p, key, cap, s, token, exact);
    }
    if (head) tail = exact_tail(row, vocab, list_floor, temperature, zt_max, kNegInf, mask);
    Crossing c = top_p_crossing(s, order, kept, zt_max, top_p * listed, top_p * (listed + tail));
    if (head && !c.found_high) {  // the crossing lies below the head
      return deep_row(row, mask, vocab, temperature, zt_max, top_p, key, cap, s, token, exact);
    }
    if (c.found_low != c.found_high || c.low != c.high) {  // the tail decides: its exact mass
      // undecided only with a tail, so top-k is off or its k-th value lies below the list
      const float below_k = top_k > 0 ? kth_of_row(row, vocab, std::min(top_k, vocab), mask) / temperature : kNegInf;
      const double total = listed + exact_tail(row, vocab, list_floor, temperature, zt_max, below_k, mask);
      c = top_p_crossing(s, order, kept, zt_max, top_p * total, top_p * total);
    }
    if (shallow && !c.found_high) {  // top-p keeps ids below the shallow list: from the winnable floor
      return sample_row(row, mask, vocab, m, temperature, min_p, top_k, top_p, key, cap, gmin, gmax, s, token,
                        exact, false);
    }
    top_p_cut = c.found_high;
    cut = c.high;
  }
  // step 11: approximate scores, then the exact noise within the margin of the best. The row's max
  // (always kept) gives a bound b0 below its exact score; an id whose value is d >= 1 below b0 needs
  // noise above floor(d) to beat it, and its noise index k says at once whether it has any
  // (`skip_below`): most ids of a long list are passed over without a logarithm.
  int64_t top = 0;
  while (top < kept && !(v[order[top]] == zt_max)) ++top;
  const float a_max = zt_max + approx_gumbel(hash32(key ^ static_cast<uint32_t>(s.ids[order[top]])));
  const float b0 = a_max - (2 * kNoiseError + std::fabs(a_max) * 0x1p-20f + 0x1p-16f);
  const uint32_t* skip = skip_below();
  float best = kNegInf;
  int64_t w = 0;
  int64_t j = 0;
#if defined(__AVX2__)
  if (kept == n && !top_p_cut) {  // every listed id kept, in list order: 8 ids at a time
    const __m256i key8 = _mm256_set1_epi32(static_cast<int32_t>(key));
    const __m256 b08 = _mm256_set1_ps(b0), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 slack = _mm256_set1_ps(1e-3f), top_level = _mm256_set1_ps(static_cast<float>(kSkipLevels - 1));
    const int* table = reinterpret_cast<const int*>(skip);
    for (; j + 8 <= n; j += 8) {
      const __m256i x = hash8(
          _mm256_xor_si256(key8, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.ids.data() + j))));
      const __m256 d = _mm256_sub_ps(b08, _mm256_loadu_ps(v + j));
      const __m256i level = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(d, slack), zero), top_level));
      const __m256i below = _mm256_cmpgt_epi32(_mm256_i32gather_epi32(table, level, 4), _mm256_srli_epi32(x, 8));
      const __m256 skipped = _mm256_and_ps(_mm256_cmp_ps(d, one, _CMP_GE_OQ), _mm256_castsi256_ps(below));
      uint32_t live = ~static_cast<uint32_t>(_mm256_movemask_ps(skipped)) & 0xFFu;
      while (live) {
        const int at = static_cast<int>(j) + __builtin_ctz(live);
        live &= live - 1;
        const float a = v[at] + approx_gumbel(hash32(key ^ static_cast<uint32_t>(s.ids[at])));
        s.approx[w] = a;
        order[w++] = at;
        best = std::max(best, a);
      }
    }
  }
#endif
  for (; j < kept; ++j) {
    const int32_t at = order[j];
    if (top_p_cut && !(v[at] > cut)) continue;
    const uint32_t bits = hash32(key ^ static_cast<uint32_t>(s.ids[at]));
    const float d = b0 - v[at];
    // the level clamped as a float first: d may be +inf (a listed -inf, where the floor overflowed)
    if (d >= 1.0f && (bits >> 8) < skip[static_cast<int>(std::min(d - 1e-3f, static_cast<float>(kSkipLevels - 1)))]) {
      continue;
    }
    const float a = v[at] + approx_gumbel(bits);
    s.approx[w] = a;
    order[w++] = at;
    best = std::max(best, a);
  }
  const float margin = 2 * kNoiseError + std::fabs(best) * 0x1p-20f + 0x1p-16f;
  exact.ids.clear();
  exact.values.clear();
  exact.bits.clear();
  for (int64_t j = 0; j < w; ++j) {
    if (s.approx[j] >= best - margin) {
      const int32_t at = order[j];
      exact.ids.push_back(s.ids[at]);
      exact.values.push_back(v[at]);
      exact.bits.push_back(hash32(key ^ static_cast<uint32_t>(s.ids[at])));
    }
  }
  if (exact.ids.size() == 1) {
    token = exact.ids[0];
    return Row::kDone;
  }
  return Row::kNoise;
}

// ------------------------------------------------------------------ raw logprobs' statistics
// logprobs.RowStats of a row (float32 scores without NaN or +inf, the max m finite), read while the
// row is in the core's cache: the max of each run of 64 ids, and with lanes > 0 log S, S = sum exp(x -
// m) summed as ATen's CPU log_softmax does (logprobs.normaliser): one float32 accumulator per lane,
// sequential over the row, the tail added to the first lanes, the lanes folded in halves.
constexpr int64_t kStatsChunk = 64;  // logprobs.CHUNK

void raw_stats_row(const float* row, int64_t vocab, float m, int64_t lanes, float* maxima, float* log_sum) {
  int64_t c = 0, start = 0;
#if defined(__AVX2__)
  for (; start + kStatsChunk <= vocab; ++c, start += kStatsChunk) {  // no NaN: the vector max is exact
    __m256 m0 = _mm256_max_ps(_mm256_loadu_ps(row + start), _mm256_loadu_ps(row + start + 8));
    __m256 m1 = _mm256_max_ps(_mm256_loadu_ps(row + start + 16), _mm256_loadu_ps(row + start + 24));
    __m256 m2 = _mm256_max_ps(_mm256_loadu_ps(row + start + 32), _mm256_loadu_ps(row + start + 40));
    __m256 m3 = _mm256_max_ps(_mm256_loadu_ps(row + start + 48), _mm256_loadu_ps(row + start + 56));
    m0 = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
    const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m0), _mm256_extractf128_ps(m0, 1));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    maxima[c] = _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
  }
#endif
  for (; start < vocab; ++c, start += kStatsChunk) {
    const int64_t stop = std::min(start + kStatsChunk, vocab);
    float best = kNegInf;
    for (int64_t i = start; i < stop; ++i) best = std::max(best, row[i]);
    maxima[c] = best;
  }
  if (lanes <= 0) return;
  constexpr int64_t kBlock = 32768;  // a multiple of every lane count
  thread_local std::vector<float> block(kBlock);
  float* b = block.data();
  float acc[16] = {0.0f};
  const int64_t main = vocab - vocab % lanes;
  const auto floats = at::TensorOptions().dtype(at::kFloat);
  for (int64_t start = 0; start < vocab; start += kBlock) {
    const int64_t len = std::min(kBlock, vocab - start);
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 top = _mm256_set1_ps(m);
    for (; i + 8 <= len; i += 8) _mm256_storeu_ps(b + i, _mm256_sub_ps(_mm256_loadu_ps(row + start + i), top));
#endif
    for (; i < len; ++i) b[i] = row[start + i] - m;
    at::from_blob(b, {len}, floats).exp_();
    const int64_t body = std::max<int64_t>(0, std::min(len, main - start));
    i = 0;
#if defined(__AVX2__)
    // each lane's float32 sum in order, 8 lanes to a register (lanes is 8 or 16)
    __m256 a0 = _mm256_loadu_ps(acc), a1 = _mm256_loadu_ps(acc + 8);
    if (lanes == 16) {
      for (; i + 16 <= body; i += 16) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(b + i));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(b + i + 8));
      }
    } else {
      for (; i + 8 <= body; i += 8) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(b + i));
    }
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
#endif
    for (; i < body; i += lanes) {
      for (int64_t l = 0; l < lanes; ++l) acc[l] += b[i + l];
    }
    for (int64_t i = body; i < len; ++i) acc[i - body] += b[i];  // the tail, into the first lanes
  }
  for (int64_t half = lanes / 2; half >= 1; half /= 2) {
    for (int64_t l = 0; l < half; ++l) acc[l] = acc[l] + acc[l + half];
  }
  *log_sum = std::log(acc[0]);
}

// One call of sample_rows: what its rows read (the tensors held, so a helper that finishes late reads
// valid memory) and where they publish. The noise and exact lists are filled row by row by the
// thread that wins the row (native_rows.h).
struct SampleTask : tokensampler_rows::RowTask {
  std::vector<at::Tensor> held;
  at::Tensor tokens, general;
  const float* zp = nullptr;
  int64_t stride = 0, vocab = 0, num_slots = 0, words_per_row = 0, chunks = 0, stats_lanes = 0, list_cap = 1;
  const int64_t* slot = nullptr;
  const uint32_t* words = nullptr;
  float* maxima_out = nullptr;
  float* log_sum_out = nullptr;
  const float *tp = nullptr, *mp = nullptr;
  const int64_t *kp = nullptr, *sp = nullptr, *op = nullptr, *st = nullptr;
  const double* pp = nullptr;
  int64_t* out = nullptr;
  bool* gen = nullptr;
  float gmin = 0.0f, gmax = 0.0f;
  std::vector<Exact> exact;
  std::vector<char> noise;

  std::unique_ptr<tokensampler_rows::RowWorker> worker(bool helper) override;
};

// A thread's rows of a SampleTask. A helper reads the row and its mask words from copies it makes
// first (the caller may have returned and the inputs changed: a torn copy is still one fixed row, and
// the pass is safe on any fixed row), and the row's slot once.
class SampleWorker : public tokensampler_rows::RowWorker {
 public:
  SampleWorker(SampleTask& task, bool helper) : t_(task), helper_(helper), scratch_(thread_scratch()) {}
  ~SampleWorker() override {
    if (rows_ == 0) return;
    last_call_bytes += scratch_.bytes() + (helper_ ? 4 * t_.vocab : 0);  // the lists at their largest
    if (scratch_.bytes() > 2 * rows_ * t_.vocab) scratch_.release();  // more than half its rows' fp32 logits
  }

  bool compute(int64_t b) override {
    ++rows_;
    const float* row = t_.zp + b * t_.stride;
    const int64_t s = t_.slot[b];
    if (s < 0 || s >= t_.num_slots) return false;
    Mask mask{t_.words == nullptr ? nullptr : t_.words + b * t_.words_per_row};
    RowMax mx;
    if (helper_) {  // copies first: the mask words, then the row as its max is read
      thread_local std::vector<float> row_copy;
      thread_local std::vector<uint32_t> words_copy;
      if (mask.words != nullptr) {
        words_copy.resize((t_.vocab + 31) / 32);
        std::copy(mask.words, mask.words + words_copy.size(), words_copy.begin());
        mask.words = words_copy.data();
      }
      row_copy.resize(t_.vocab);
      mx = row_max_impl<true>(row, t_.vocab, mask, row_copy.data());
      row = row_copy.data();
    } else {
      mx = row_max(row, t_.vocab, mask);
    }
    if (mx.nan || std::isinf(mx.max)) {  // NaN, +inf, or no id left: the general routes
      kind_ = Row::kGeneral;
      return true;
    }
    if (t_.maxima_out != nullptr) {  // the raw scores' statistics while the row is in cache
      maxima_.resize(t_.chunks);
      raw_stats_row(row, t_.vocab, mx.max, t_.stats_lanes, maxima_.data(), &log_sum_);
    }
    const float temperature = t_.tp[s];
    if (temperature == 0.0f) {  // step 6: greedy
      kind_ = Row::kDone;
      token_ = first_equal(row, t_.vocab, mx.max, mask);
      return true;
    }
    kind_ = sample_row(row, mask, t_.vocab, mx.max, temperature, t_.mp[s], t_.kp[s], t_.pp[s],
                       row_key(t_.sp[s], t_.op[s], t_.st[s]), t_.list_cap, t_.gmin, t_.gmax, scratch_, token_,
                       exact_);
    return true;
  }

  void publish(int64_t b) override {
    if (t_.maxima_out != nullptr && kind_ != Row::kGeneral) {
      std::copy(maxima_.begin(), maxima_.end(), t_.maxima_out + b * t_.chunks);
      if (t_.log_sum_out != nullptr) t_.log_sum_out[b] = log_sum_;
    }
    if (kind_ == Row::kGeneral) {
      t_.gen[b] = true;
    } else if (kind_ == Row::kDone) {
      t_.out[b] = token_;
    } else {
      std::swap(t_.exact[b], exact_);
      t_.noise[b] = 1;
    }
  }

 private:
  SampleTask& t_;
  const bool helper_;
  Scratch& scratch_;
  int64_t rows_ = 0;
  Row kind_ = Row::kDone;
  int64_t token_ = 0;
  Exact exact_;
  std::vector<float> maxima_;
  float log_sum_ = 0.0f;
};

std::unique_ptr<tokensampler_rows::RowWorker> SampleTask::worker(bool helper) {
  return std::make_unique<SampleWorker>(*this, helper);
}

std::tuple<at::Tensor, at::Tensor, int64_t> sample_rows(
    const at::Tensor& z, const at::Tensor& slots, const at::Tensor& temperature, const at::Tensor& min_p,
    const at::Tensor& top_k, const at::Tensor& top_p, const at::Tensor& seed, const at::Tensor& position,
    const at::Tensor& stream, int64_t cap, double gumbel_min, double gumbel_max,
    const c10::optional<at::Tensor>& bitmask, const c10::optional<at::Tensor>& stats_maxima,
    const c10::optional<at::Tensor>& stats_log_sum, int64_t stats_lanes, int64_t helpers) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && z.stride(1) == 1 && z.device().is_cpu(),
              "z: a CPU float32 [B, V] tensor with contiguous rows");
  const int64_t rows = z.size(0), vocab = z.size(1), stride = z.stride(0);
  TORCH_CHECK(vocab < (int64_t{1} << 31), "ids must fit int32");
  auto column = [rows](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu(), name,
                ": a contiguous CPU column of the expected dtype");
  };
  column(slots, at::kLong, "slots");
  TORCH_CHECK(slots.size(0) == rows, "slots: one per row");
  column(temperature, at::kFloat, "temperature");
  column(min_p, at::kFloat, "min_p");
  column(top_k, at::kLong, "top_k");
  column(top_p, at::kDouble, "top_p");
  column(seed, at::kLong, "seed");
  column(position, at::kLong, "position");
  column(stream, at::kLong, "stream");
  const uint32_t* words = nullptr;
  int64_t words_per_row = 0;
  if (bitmask.has_value()) {
    TORCH_CHECK(bitmask->dim() == 2 && bitmask->size(0) == rows && bitmask->scalar_type() == at::kInt &&
                bitmask->stride(1) == 1 && bitmask->device().is_cpu() && bitmask->size(1) * 32 >= vocab,
                "bitmask: a CPU int32 [B, >= ceil(V / 32)] tensor with contiguous rows");
    words = reinterpret_cast<const uint32_t*>(bitmask->data_ptr<int32_t>());
    words_per_row = bitmask->stride(0);
  }
  float* maxima_out = nullptr;
  float* log_sum_out = nullptr;
  const int64_t chunks = (vocab + kStatsChunk - 1) / kStatsChunk;
  if (stats_maxima.has_value()) {
    TORCH_CHECK(!bitmask.has_value(), "raw statistics are of the unmasked rows: no bitmask with them");
    TORCH_CHECK(stats_maxima->dim() == 2 && stats_maxima->size(0) == rows && stats_maxima->size(1) == chunks &&
                stats_maxima->scalar_type() == at::kFloat && stats_maxima->is_contiguous(),
                "stats_maxima: a contiguous float32 [B, ceil(V / 64)] tensor");
    TORCH_CHECK(stats_lanes == 0 || stats_lanes == 8 || stats_lanes == 16, "stats_lanes: 0, 8 or 16");
    maxima_out = stats_maxima->data_ptr<float>();
    if (stats_lanes > 0) {
      TORCH_CHECK(stats_log_sum.has_value() && stats_log_sum->dim() == 1 && stats_log_sum->size(0) == rows &&
                  stats_log_sum->scalar_type() == at::kFloat && stats_log_sum->is_contiguous(),
                  "stats_log_sum: a contiguous float32 [B] tensor");
      log_sum_out = stats_log_sum->data_ptr<float>();
    }
  }
  const int64_t num_slots = temperature.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) TORCH_CHECK(slot[b] >= 0 && slot[b] < num_slots, "slots: out of range");
  auto task = std::make_shared<SampleTask>();
  SampleTask& k = *task;
  k.held = {z, slots, temperature, min_p, top_k, top_p, seed, position, stream};
  if (bitmask.has_value()) k.held.push_back(*bitmask);
  if (stats_maxima.has_value()) k.held.push_back(*stats_maxima);
  if (stats_log_sum.has_value()) k.held.push_back(*stats_log_sum);
  k.tokens = at::zeros({rows}, z.options().dtype(at::kLong));
  k.general = at::zeros({rows}, z.options().dtype(at::kBool));
  k.zp = z.data_ptr<float>();
  k.stride = stride;
  k.vocab = vocab;
  k.slot = slot;
  k.num_slots = num_slots;
  k.words = words;
  k.words_per_row = words_per_row;
  k.maxima_out = maxima_out;
  k.log_sum_out = log_sum_out;
  k.chunks = chunks;
  k.stats_lanes = stats_lanes;
  k.tp = temperature.data_ptr<float>();
  k.mp = min_p.data_ptr<float>();
  k.kp = top_k.data_ptr<int64_t>();
  k.pp = top_p.data_ptr<double>();
  k.sp = seed.data_ptr<int64_t>();
  k.op = position.data_ptr<int64_t>();
  k.st = stream.data_ptr<int64_t>();
  k.out = k.tokens.data_ptr<int64_t>();
  k.gen = k.general.data_ptr<bool>();
  k.gmin = static_cast<float>(gumbel_min);
  k.gmax = static_cast<float>(gumbel_max);
  k.list_cap = std::min<int64_t>(std::max<int64_t>(cap, 1), vocab);
  k.exact.resize(rows);
  k.noise.assign(rows, 0);
  last_call_bytes = 0;
  tokensampler_rows::run(task, rows, helpers);
  at::Tensor tokens = k.tokens, general = k.general;
  int64_t* out = k.out;
  const bool* gen = k.gen;
  const std::vector<Exact>& exact = k.exact;
  const std::vector<char>& noise = k.noise;
  // the exact noise of the ids left in a race: g = float32(-log(-log(u))) by ATen's float64 log
  int64_t total = 0;
  for (int64_t b = 0; b < rows; ++b) total += noise[b] ? static_cast<int64_t>(exact[b].ids.size()) : 0;
  if (total > 0) {
    at::Tensor u = at::empty({total}, at::TensorOptions().dtype(at::kDouble));
    double* up = u.data_ptr<double>();
    int64_t at_ = 0;
    for (int64_t b = 0; b < rows; ++b) {
      if (!noise[b]) continue;
      for (uint32_t bits : exact[b].bits) up[at_++] = uniform(bits);
    }
    at::Tensor g = u.log_().neg_().log_().neg_().to(at::kFloat);
    const float* gp = g.data_ptr<float>();
    at_ = 0;
    for (int64_t b = 0; b < rows; ++b) {
      if (!noise[b]) continue;
      const Exact& e = exact[b];
      float best = kNegInf;
      int64_t winner = std::numeric_limits<int64_t>::max();
      for (size_t j = 0; j < e.ids.size(); ++j, ++at_) {
        const float score = e.values[j] + gp[at_];
        if (score > best || (score == best && e.ids[j] < winner)) {
          best = score;
          winner = e.ids[j];
        }
      }
      out[b] = winner;
    }
  }
  int64_t general_rows = 0;
  for (int64_t b = 0; b < rows; ++b) general_rows += gen[b];
  return {tokens, general, general_rows};
}

int64_t scratch_bytes() { return last_call_bytes.load(); }

// warm_helpers(helpers): wake up to that many helpers to watch for the next call's rows (native_rows.h).
int64_t warm_helpers(int64_t helpers) {
  if (helpers > 0) tokensampler_rows::Pool::get().warm(static_cast<int>(helpers));
  return helpers;
}

// Test hook of the wait-free rows (native_rows.h): set the helpers' delay (microseconds; 0: none);
// returns [rows callers took over from helpers, rows helpers published], counted since the start.
std::vector<int64_t> wait_free_hook(int64_t helper_delay_us) {
  tokensampler_rows::helper_delay_us = helper_delay_us;
  return {tokensampler_rows::rows_taken_over.load(), tokensampler_rows::helper_rows.load()};
}

// Test hooks: the approximate and exact noise of given bits (tests/torch_step/test_native_sample.py).
at::Tensor approx_noise(const at::Tensor& bits) {
  TORCH_CHECK(bits.dim() == 1 && bits.scalar_type() == at::kLong && bits.is_contiguous());
  at::Tensor out = at::empty({bits.size(0)}, bits.options().dtype(at::kFloat));
  const int64_t* in = bits.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, bits.size(0), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = approx_gumbel(static_cast<uint32_t>(in[i]));
  });
  return out;
}

at::Tensor noise_bits(const at::Tensor& seed, const at::Tensor& position, const at::Tensor& stream,
                      const at::Tensor& token) {
  TORCH_CHECK(seed.dim() == 1 && seed.scalar_type() == at::kLong && seed.is_contiguous());
  TORCH_CHECK(position.sizes() == seed.sizes() && stream.sizes() == seed.sizes() && token.sizes() == seed.sizes());
  TORCH_CHECK(position.scalar_type() == at::kLong && stream.scalar_type() == at::kLong && token.scalar_type() == at::kLong);
  at::Tensor out = at::empty_like(seed);
  const int64_t *s = seed.data_ptr<int64_t>(), *p = position.data_ptr<int64_t>(),
                *q = stream.data_ptr<int64_t>(), *t = token.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < seed.size(0); ++i) {
    o[i] = hash32(row_key(s[i], p[i], q[i]) ^ static_cast<uint32_t>(static_cast<uint64_t>(t[i])));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokensampler_native, m) {
  m.def("sample_rows(Tensor z, Tensor slots, Tensor temperature, Tensor min_p, Tensor top_k, Tensor top_p, "
        "Tensor seed, Tensor position, Tensor stream, int cap, float gumbel_min, float gumbel_max, Tensor? bitmask, "
        "Tensor? stats_maxima, Tensor? stats_log_sum, int stats_lanes, int helpers) -> (Tensor, Tensor, int)");
  m.def("approx_noise(Tensor bits) -> Tensor");
  m.def("scratch_bytes() -> int", &scratch_bytes);  // no tensor argument: a catch-all kernel
  m.def("wait_free_hook(int helper_delay_us) -> int[]", &wait_free_hook);
  m.def("warm_helpers(int helpers) -> int", &warm_helpers);
  m.def("noise_bits(Tensor seed, Tensor position, Tensor stream, Tensor token) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokensampler_native, CPU, m) {
  m.impl("sample_rows", &sample_rows);
  m.impl("approx_noise", &approx_noise);
  m.impl("noise_bits", &noise_bits);
}
