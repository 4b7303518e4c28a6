// `head_row_scores(x, packed, n, targets)`: what `prompt_row_scores` keeps of each row of the logits x @ W^T (the
// row's logsumexp, its target's logit and rank, its largest logit with its first index), computed from the bf16
// head's tiles as oneDNN's brgemm makes them, without writing the logits (kiln/engine/running/prompt_logprobs.py).
//
// Scoring a 1,024-token prompt's rows through the head and then `prompt_row_scores` wrote and read back 200 MB of
// float32 logits over a 49,152-token vocabulary, in 64-row slices that each streamed the whole 56 MB bf16 head
// again. Here the threads share out the head's blocks of BLOCK_N outputs (the VNNI copy dense_brgemm.cpp reads,
// `packed` [blocks, in / 2, BLOCK_N, 2]), walk them in groups that fit half of L2 and, for every BLOCK_M rows of x,
// make the logits of TILE_BLOCKS blocks in an L1 tile and fold it into the rows' running results, sixteen lanes a
// row (AVX-512; the other tiers' scalar fold is never looked up: TIER_OPS): the count of logits above the target's,
// the largest logit and its first index, and the sum of exp(logit - largest so far), rescaled in the lanes whose
// largest grew (the online softmax). The head is read once per call, whatever its rows; the lanes and the threads'
// partial results are merged at the end. Per row of the default model's head (2 threads): 27-30 us against 40-45 us
// for the 64-row product then `prompt_row_scores` (the brgemm alone 16.5-19, the fold alone 8.7); folding each block
// as it was made took 39 us, with scalar reductions per row 77-88 us (the matrix unit and the vector units taking
// turns that often cost more than either's work).
//
// The target's logit must be the one the tiles hold, bit for bit, or its rank is off by the logits that tie with
// it: each row block's target tiles are made first by the same brgemm call (rows, block, leading dimensions) the walk
// makes, so the comparison is against the same float.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "bf16_form.h"
#include "row_math.h"

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace {

constexpr int64_t BLOCK_N = FORM_BLOCK_N;
constexpr int64_t BLOCK_M = 32;      // rows of x per brgemm call
constexpr int64_t TILE_BLOCKS = 4;  // blocks whose logits are made (a 16 KB tile) before the fold
constexpr int64_t TILE_COLS = TILE_BLOCKS * BLOCK_N;

constexpr int64_t LANES = 16;  // running results per row: one per vector lane, merged at the end

// One thread's running results, LANES per row of the call (lane l sees the tiles' columns l and l + 16): the largest
// logit so far and the sum of exp(logit - it), the count above the target's logit, the largest with its first index.
struct Partial {
  std::vector<float> sum, top;  // the top is also the largest the lane's sum is relative to
  std::vector<int32_t> above, top_index;

  explicit Partial(int64_t rows)
      : sum(rows * LANES, 0.0f),
        top(rows * LANES, -std::numeric_limits<float>::infinity()),
        above(rows * LANES, 0),
        top_index(rows * LANES, -1) {}
};

#if defined(__AVX512F__)
// exp(x) for x <= 0: exp_nonpositive's reduction and polynomial (row_math.h) on sixteen lanes, 2^n by scalef
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 q = _mm512_set1_ps(1.0f / 720.0f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 120.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 24.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f / 6.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.5f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(q, n);
}

// Fold one tile of logits (rows [m0, m0 + m) of the call, outputs [col0, col0 + cols)) into `p`, lane by lane: no
// reduction across lanes until the end, and the running sum rescaled only in lanes whose largest grew.
void fold_tile(const float* tile, int64_t m0, int64_t m, int64_t col0, int64_t cols, const float* chosen, Partial& p) {
  constexpr int64_t VECTORS = TILE_COLS / LANES;
  const int64_t full = cols / LANES;  // whole vectors; then one masked one where cols is not a multiple
  const __mmask16 tail = static_cast<__mmask16>((1u << (cols % LANES)) - 1);
  const int64_t vectors = full + (cols % LANES != 0);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i base = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(col0)));
  const __m512i one = _mm512_set1_epi32(1);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t at = (m0 + r) * LANES;
    __m512 v[VECTORS];
    for (int64_t k = 0; k < vectors; ++k) {
      const __mmask16 mask = k < full ? __mmask16(0xFFFF) : tail;
      v[k] = _mm512_mask_loadu_ps(minus_inf, mask, tile + r * TILE_COLS + k * LANES);
    }
    const __m512 target = _mm512_set1_ps(chosen[m0 + r]);
    __m512i above = _mm512_loadu_si512(p.above.data() + at);
    __m512 top = _mm512_loadu_ps(p.top.data() + at);  // the lane's largest so far: what its sum is relative to
    __m512i index = _mm512_loadu_si512(p.top_index.data() + at);
    const __m512 before = top;
    for (int64_t k = 0; k < vectors; ++k) {
      above = _mm512_mask_add_epi32(above, _mm512_cmp_ps_mask(v[k], target, _CMP_GT_OQ), above, one);
      // strictly larger replaces: columns in order within a lane, blocks in order, so the first index stays
      const __mmask16 larger = _mm512_cmp_ps_mask(v[k], top, _CMP_GT_OQ);
      top = _mm512_mask_mov_ps(top, larger, v[k]);
      index = _mm512_mask_mov_epi32(index, larger, _mm512_add_epi32(base, _mm512_set1_epi32(k * LANES)));
    }
    __m512 sum = _mm512_loadu_ps(p.sum.data() + at);
    const __mmask16 grew = _mm512_cmp_ps_mask(top, before, _CMP_GT_OQ);
    if (grew) sum = _mm512_mask_mul_ps(sum, grew, sum, exp16(_mm512_sub_ps(before, top)));
    for (int64_t k = 0; k < vectors; ++k) sum = _mm512_add_ps(sum, exp16(_mm512_sub_ps(v[k], top)));
    _mm512_storeu_si512(p.above.data() + at, above);
    _mm512_storeu_ps(p.top.data() + at, top);
    _mm512_storeu_si512(p.top_index.data() + at, index);
    _mm512_storeu_ps(p.sum.data() + at, sum);
  }
}
#else
void fold_tile(const float* tile, int64_t m0, int64_t m, int64_t col0, int64_t cols, const float* chosen, Partial& p) {
  for (int64_t r = 0; r < m; ++r) {
    const int64_t at = (m0 + r) * LANES;
    for (int64_t j = 0; j < cols; ++j) {
      const float v = tile[r * TILE_COLS + j];
      const int64_t l = at + j % LANES;
      p.above[l] += v > chosen[m0 + r] ? 1 : 0;
      if (v > p.top[l]) {
        p.sum[l] *= exp_nonpositive(p.top[l] - v);
        p.top[l] = v, p.top_index[l] = static_cast<int32_t>(col0 + j);
      }
      p.sum[l] += exp_nonpositive(v - p.top[l]);
    }
  }
}
#endif

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> head_row_scores(const at::Tensor& x,
                                                                                       const at::Tensor& packed,
                                                                                       int64_t n,
                                                                                       const at::Tensor& targets) {
  check_form_operands("head_row_scores", "head", x, packed, n);
  const int64_t rows = x.size(0), in = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(n < std::numeric_limits<int32_t>::max(), "head_row_scores: a vocabulary of ", n, " is too large");
  TORCH_CHECK(targets.dim() == 1 && targets.scalar_type() == at::kLong && targets.size(0) == rows,
              "head_row_scores: targets must be int64 [", rows, "], got ", targets.scalar_type(), " of ",
              targets.sizes());
  const at::Tensor ids = targets.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "head_row_scores: target ", id[i], " of row ", i,
                " is outside the vocabulary of ", n);
  }
  const auto floats = x.options();
  at::Tensor lse = at::empty({rows}, floats), chosen = at::empty({rows}, floats), top = at::empty({rows}, floats);
  at::Tensor rank = at::empty({rows}, ids.options()), top_index = at::empty({rows}, ids.options());
  if (rows == 0) return {lse, chosen, rank, top, top_index};
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  const at::Tensor xb = x.contiguous().to(at::kBFloat16);
  const at::BFloat16* a = xb.data_ptr<at::BFloat16>();
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  float* chosen_p = chosen.data_ptr<float>();
  // the targets' logits, each from its row block's tile of its target's block: the call the walk makes
  {
    float tile[BLOCK_M * TILE_COLS];
    for (int64_t m0 = 0; m0 < rows; m0 += BLOCK_M) {
      const int64_t m = std::min(BLOCK_M, rows - m0);
      std::vector<int64_t> done;
      for (int64_t r = 0; r < m; ++r) {
        const int64_t b = id[m0 + r] / BLOCK_N;
        if (std::find(done.begin(), done.end(), b) != done.end()) continue;
        done.push_back(b);
        const int64_t cols = std::min(BLOCK_N, n - b * BLOCK_N);
        at::native::cpublas::brgemm(m, cols, in, /*ld_a=*/in, /*ld_b=*/BLOCK_N, /*ld_c=*/TILE_COLS, /*add_C=*/false,
                                    a + m0 * in, w + b * in * BLOCK_N, tile, /*is_vnni=*/true);
        for (int64_t q = 0; q < m; ++q) {
          if (id[m0 + q] / BLOCK_N == b) chosen_p[m0 + q] = tile[q * TILE_COLS + id[m0 + q] % BLOCK_N];
        }
      }
    }
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  }
  const int64_t threads = at::get_num_threads();
  std::vector<Partial> partials;
  partials.reserve(threads);
  for (int64_t t = 0; t < threads; ++t) partials.emplace_back(rows);
  const int64_t group = std::max<int64_t>(1, FORM_GROUP_BYTES / (in * BLOCK_N * 2));
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Partial& p = partials[at::get_thread_num()];
    float tile[BLOCK_M * TILE_COLS];
    for (int64_t g0 = begin; g0 < end; g0 += group) {
      const int64_t g1 = std::min(end, g0 + group);
      for (int64_t m0 = 0; m0 < rows; m0 += BLOCK_M) {
        const int64_t m = std::min(BLOCK_M, rows - m0);
        for (int64_t t0 = g0; t0 < g1; t0 += TILE_BLOCKS) {
          const int64_t t1 = std::min(g1, t0 + TILE_BLOCKS);
          for (int64_t b = t0; b < t1; ++b) {
            const int64_t cols = std::min(BLOCK_N, n - b * BLOCK_N);
            at::native::cpublas::brgemm(m, cols, in, /*ld_a=*/in, /*ld_b=*/BLOCK_N, /*ld_c=*/TILE_COLS,
                                        /*add_C=*/false, a + m0 * in, w + b * in * BLOCK_N,
                                        tile + (b - t0) * BLOCK_N, /*is_vnni=*/true);
          }
          const int64_t cols = std::min(t1 * BLOCK_N, n) - t0 * BLOCK_N;
          fold_tile(tile, m0, m, t0 * BLOCK_N, cols, chosen_p, p);
        }
      }
    }
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  });
  float *lse_p = lse.data_ptr<float>(), *top_p = top.data_ptr<float>();
  int64_t *rank_p = rank.data_ptr<int64_t>(), *index_p = top_index.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    float largest = -std::numeric_limits<float>::infinity(), best = largest;
    int64_t best_index = -1, above = 0;
    for (const Partial& p : partials) {
      for (int64_t l = i * LANES; l < (i + 1) * LANES; ++l) {
        largest = std::max(largest, p.top[l]);
        above += p.above[l];
        const int64_t index = p.top_index[l];
        const bool earlier = index >= 0 && (best_index < 0 || index < best_index);
        if (p.top[l] > best || (p.top[l] == best && earlier)) best = p.top[l], best_index = index;
      }
    }
    float sum = 0.0f;
    for (const Partial& p : partials) {
      for (int64_t l = i * LANES; l < (i + 1) * LANES; ++l) {
        if (p.top_index[l] >= 0) sum += p.sum[l] * exp_nonpositive(p.top[l] - largest);
      }
    }
    lse_p[i] = largest + std::log(sum);
    rank_p[i] = 1 + above;
    top_p[i] = best;
    index_p[i] = best_index < 0 ? 0 : best_index;  // no logit above -inf: every index ties
  }
  return {lse, chosen, rank, top, top_index};
#else
  TORCH_CHECK(false, "head_row_scores: this torch has no bf16 cpublas::brgemm");
  return {lse, chosen, rank, top, top_index};
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("head_row_scores(Tensor x, Tensor packed, int n, Tensor targets) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.impl("head_row_scores", c10::DispatchKey::CPU, TORCH_FN(head_row_scores));
}
