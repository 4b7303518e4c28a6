// `prompt_row_scores(logits, targets)`: what prompt logprobs keep of each row of float32 logits
// (kiln/engine/running/prompt_logprobs.py), in two passes over the row instead of a log-softmax and its reductions:
// the row's logsumexp, its target's logit, the target's rank (1 + the logits greater than it) and the row's largest
// logit with its first index.
//
// Pass one reads the row from memory: the largest logit and its first index, and the count of logits above the
// target's; pass two sums exp(logit - largest) from cache (a 49,152-token row is 192 KB). Both keep LANES partial
// results, one per vector lane, so the compiler vectorizes them at whatever width the tier's flags allow without
// reordering a sum it was not asked to (no -ffast-math); exp is a Cody-Waite reduction and a degree-6 polynomial
// (about 2 ulp; torch's logsumexp sums in another order, the two agree to ~1e-6 relative). Rows are split across
// torch's threads. Torch ops take 5-10 passes for the same numbers, and the comparison (a bool per logit) and the
// max with its index run unvectorized: on one loaded core of the AMX Xeon, ~1,100 us a 49,152-logit row against
// 34 us here (best of 20; the head's product for the row, bf16 brgemm at 64 rows, took ~250 us).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

#include "row_math.h"

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace {

constexpr int64_t LANES = 16;

struct RowScore {
  float lse, chosen, top;
  int64_t rank, top_index;
};

RowScore score_row(const float* row, int64_t n, int64_t target) {
  const float chosen = row[target];
  // 32-bit indices and counts (the caller checks the vocabulary fits): lanes as wide as the floats' vectorize
  float best[LANES];
  int32_t where[LANES], above[LANES] = {};
  for (int64_t l = 0; l < LANES; ++l) best[l] = -std::numeric_limits<float>::infinity(), where[l] = n;
  const int64_t whole = n - n % LANES;
  for (int64_t j = 0; j < whole; j += LANES) {
    for (int32_t l = 0; l < LANES; ++l) {
      const float v = row[j + l];
      const bool larger = v > best[l];
      best[l] = larger ? v : best[l];
      where[l] = larger ? static_cast<int32_t>(j) + l : where[l];
      above[l] += v > chosen ? 1 : 0;
    }
  }
  float top = -std::numeric_limits<float>::infinity();
  int64_t top_index = n, rank = 1;
  for (int64_t l = 0; l < LANES; ++l) {
    rank += above[l];
    if (best[l] > top || (best[l] == top && where[l] < top_index)) top = best[l], top_index = where[l];
  }
  for (int64_t j = whole; j < n; ++j) {
    rank += row[j] > chosen;
    if (row[j] > top) top = row[j], top_index = j;
  }
  if (top_index == n) top_index = 0;  // no logit above -inf: every index ties
  float sums[LANES] = {};
  for (int64_t j = 0; j < whole; j += LANES) {
    for (int64_t l = 0; l < LANES; ++l) sums[l] += exp_nonpositive(row[j + l] - top);
  }
  float sum = 0.0f;
  for (int64_t l = 0; l < LANES; ++l) sum += sums[l];
  for (int64_t j = whole; j < n; ++j) sum += exp_nonpositive(row[j] - top);
  return {top + std::log(sum), chosen, top, rank, top_index};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> prompt_row_scores(const at::Tensor& logits,
                                                                                         const at::Tensor& targets) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "prompt_row_scores: logits must be a float32 [rows, vocab] matrix, got ", logits.scalar_type(), " of ",
              logits.sizes());
  TORCH_CHECK(targets.dim() == 1 && targets.scalar_type() == at::kLong && targets.size(0) == logits.size(0),
              "prompt_row_scores: targets must be int64 [", logits.size(0), "], got ", targets.scalar_type(), " of ",
              targets.sizes());
  const at::Tensor rows = logits.contiguous();
  const at::Tensor ids = targets.contiguous();
  const int64_t num_rows = rows.size(0), vocab = rows.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_rows; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < vocab, "prompt_row_scores: target ", id[i], " of row ", i,
                " is outside the vocabulary of ", vocab);
  }
  at::Tensor lse = at::empty({num_rows}, rows.options());
  at::Tensor chosen = at::empty({num_rows}, rows.options());
  at::Tensor top = at::empty({num_rows}, rows.options());
  at::Tensor rank = at::empty({num_rows}, ids.options());
  at::Tensor top_index = at::empty({num_rows}, ids.options());
  const float* data = rows.data_ptr<float>();
  float *lse_p = lse.data_ptr<float>(), *chosen_p = chosen.data_ptr<float>(), *top_p = top.data_ptr<float>();
  int64_t *rank_p = rank.data_ptr<int64_t>(), *index_p = top_index.data_ptr<int64_t>();
  at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const RowScore s = score_row(data + i * vocab, vocab, id[i]);
      lse_p[i] = s.lse, chosen_p[i] = s.chosen, top_p[i] = s.top, rank_p[i] = s.rank, index_p[i] = s.top_index;
    }
  });
  return {lse, chosen, rank, top, top_index};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("prompt_row_scores(Tensor logits, Tensor targets) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.impl("prompt_row_scores", c10::DispatchKey::CPU, TORCH_FN(prompt_row_scores));
}
