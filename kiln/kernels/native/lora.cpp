// `lora_delta(x, a, b, slots, part_rows, max_loras, rank)`: each token's adapter product B[slot] @ (A[slot] @ x) over
// kiln's static LoRA buffers (kiln/lora/layer.py): Punica's bgmv (shrink, then expand) as one op, over every part of
// a fused layer (qkv, gate_up) in one call, at any row count.
//
//   x          [n, in] float32
//   a          [parts * max_loras * rank, in] float32 or bf16, rows (part, slot, rank)
//   b          [max_loras * rank, out] float32 or bf16, rows (slot, rank): each slot's B transposed, its scale in
//   slots      [>= n] int64: token i's slot (-1: the base alone, its row of the result is zero)
//   part_rows  each part's output columns, in order (they tile `out`)
//   returns    [n, out] float32
//
// `lora_accumulate` (lora.h) adds the same products into a product's output in place: dispatch.cpp's
// `kiln::packed_linear_lora`, a packed layer's product and its adapters' in one call from the graph.
//
// A token without a slot costs nothing: a step where no token has one reads neither A nor B (the inductor forms read
// slot 0 and multiply by zero). The tokens are sorted into runs of one slot. The shrink splits blocks of four A rows
// across torch's threads and multiplies each block by four tokens of a run at a time (sixteen sums in registers);
// the expand splits the output columns and adds, for four tokens of a run at a time, their `rank` scaled rows of the
// slot's B; a token left over from the fours (a decode step's lone token) shares its x loads across four A rows and
// streams its slot's B rows four at a time, front to back. Fewer adapted tokens than a tile (a batch-1 decode step)
// take `lora_few`: one pass of the thread pool, no sorting. The vector arithmetic is lora_vectors.h's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "lora.h"
#include "lora_vectors.h"

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace {

// the multiply-adds one thread's share should hold at least (smaller work stays on fewer threads): a fork and join
// of the thread pool costs about what this many multiply-adds over memory do, so a decode token's products (18k to
// 50k a layer for a rank-16 adapter of the default model) run on the calling thread; 16k measured 0.04-0.07 ms a
// batch-1 token slower there (bfloat16 buffers, 120 adapted products)
constexpr int64_t GRAIN_MACS = 65536;

int64_t grain(int64_t macs_per_item) { return std::max<int64_t>(1, GRAIN_MACS / std::max<int64_t>(1, macs_per_item)); }

// tokens the shrink and the expand take at a time (dot4x4, expand4); a step with fewer adapted tokens runs `lora_few`
constexpr int64_t TILE_TOKENS = 4;

// columns of the result one thread's share of the expand is cut in (a multiple of every tier's vector width)
constexpr int64_t COLUMN_BLOCK = 64;

// `tokens` (the rows of y that have a slot) in slot order, and where each slot's run of them starts and ends
struct SlotRuns {
  std::vector<int64_t> tokens;
  std::vector<int64_t> starts;  // run g: tokens[starts[g] .. starts[g + 1]), all of slot slot[tokens[starts[g]]]
};

SlotRuns slot_runs(const std::vector<int64_t>& active, const int64_t* slot) {
  SlotRuns runs{active, {}};
  std::stable_sort(runs.tokens.begin(), runs.tokens.end(), [slot](int64_t i, int64_t j) { return slot[i] < slot[j]; });
  for (size_t k = 0; k < runs.tokens.size(); ++k) {
    if (k == 0 || slot[runs.tokens[k]] != slot[runs.tokens[k - 1]]) runs.starts.push_back(static_cast<int64_t>(k));
  }
  runs.starts.push_back(static_cast<int64_t>(runs.tokens.size()));
  return runs;
}

template <typename W>
void lora_rows(const float* x, const W* a, const W* b, const std::vector<int64_t>& active, const int64_t* slot,
               const std::vector<int64_t>& part_start, int64_t max_loras, int64_t rank, int64_t in, int64_t out,
               float* result) {
  const int64_t parts = static_cast<int64_t>(part_start.size()) - 1;
  const int64_t count = static_cast<int64_t>(active.size());
  const int64_t width = parts * rank;  // a token's shrunk values: (part, rank), by its place in `runs.tokens`
  const SlotRuns runs = slot_runs(active, slot);
  std::vector<float> shrunk(count * width);
  // the shrink: four A rows at a time (a block), each block read once for every token of a slot, four tokens at a
  // time (sixteen sums in registers)
  const int64_t row_blocks = (width + 3) / 4;
  at::parallel_for(0, row_blocks, grain(4 * count * in), [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t j0 = block * 4, rows = std::min<int64_t>(4, width - j0);
      for (size_t g = 0; g + 1 < runs.starts.size(); ++g) {
        const int64_t first = runs.starts[g], last = runs.starts[g + 1], s = slot[runs.tokens[first]];
        const W* w[4];
        for (int64_t q = 0; q < 4; ++q) {
          const int64_t j = j0 + std::min(q, rows - 1), part = j / rank, r = j % rank;  // a short block repeats
          w[q] = a + ((part * max_loras + s) * rank + r) * in;
        }
        int64_t k = first;
        for (; k + 4 <= last; k += 4) {
          const float* xs[4];
          float sums[4][4];
          for (int t = 0; t < 4; ++t) xs[t] = x + runs.tokens[k + t] * in;
          dot4x4(xs, w, in, sums);
          for (int t = 0; t < 4; ++t)
            for (int64_t q = 0; q < rows; ++q) shrunk[(k + t) * width + j0 + q] = sums[t][q];
        }
        for (; k < last; ++k) {
          float sums[4];
          dot1x4(x + runs.tokens[k] * in, w, in, sums);
          for (int64_t q = 0; q < rows; ++q) shrunk[k * width + j0 + q] = sums[q];
        }
      }
    }
  });
  // the expand: B's rows are (slot, rank) over every output column; a token's columns of one part add `rank`
  // scaled rows of its slot
  const int64_t blocks = (out + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
  at::parallel_for(0, blocks, grain(count * rank * COLUMN_BLOCK), [&](int64_t begin, int64_t end) {
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t first = std::max(begin * COLUMN_BLOCK, part_start[part]);
      const int64_t last = std::min(end * COLUMN_BLOCK, part_start[part + 1]);
      if (first >= last) continue;
      for (size_t g = 0; g + 1 < runs.starts.size(); ++g) {
        const int64_t from = runs.starts[g], to = runs.starts[g + 1];
        const W* rows = b + slot[runs.tokens[from]] * rank * out;  // the run's slot's B rows
        int64_t k = from;
        for (; k + 4 <= to; k += 4) {
          float* dst[4];
          const float* coef[4];
          for (int t = 0; t < 4; ++t) {
            dst[t] = result + runs.tokens[k + t] * out;
            coef[t] = shrunk.data() + (k + t) * width + part * rank;
          }
          expand4(dst, coef, rows, out, rank, first, last);
        }
        for (; k < to; ++k) {
          expand_rows(result + runs.tokens[k] * out, shrunk.data() + k * width + part * rank, rows, out, rank, first,
                      last);
        }
      }
    }
  });
}

// Fewer tokens than a tile (a batch-1 decode step's one): one pass of the thread pool, each thread owning a share of
// the output columns. For each token a thread shrinks only the parts whose columns it owns (a part straddling two
// shares is shrunk by both: a few kB of A read twice) and adds each part's expand over its own columns right after:
// no second fork and join, no sorting, A's and then B's rows of a part streamed front to back. On the default model
// (120 adapted products a token, rank 16) this took 0.42-0.47 ms a batch-1 token against 0.57-0.63 for the tiled
// path (bfloat16 buffers; float32 0.63 against 0.84).
template <typename W>
void lora_few(const float* x, const W* a, const W* b, const std::vector<int64_t>& active, const int64_t* slot,
              const std::vector<int64_t>& part_start, int64_t max_loras, int64_t rank, int64_t in, int64_t out,
              float* result) {
  const int64_t parts = static_cast<int64_t>(part_start.size()) - 1;
  const int64_t blocks = (out + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
  const int64_t count = static_cast<int64_t>(active.size());
  // a share's work: its columns' expand and its parts' shrink, about a part's shrink per share
  const int64_t macs_per_block = count * rank * COLUMN_BLOCK + count * rank * in * parts / blocks;
  at::parallel_for(0, blocks, grain(macs_per_block), [&](int64_t begin, int64_t end) {
    const int64_t c0 = begin * COLUMN_BLOCK, c1 = std::min(out, end * COLUMN_BLOCK);
    std::vector<float> shrunk(rank + 4);
    for (int64_t part = 0; part < parts; ++part) {
      const int64_t first = std::max(c0, part_start[part]), last = std::min(c1, part_start[part + 1]);
      if (first >= last) continue;
      for (const int64_t token : active) {
        const int64_t s = slot[token];
        const W* rows = a + (part * max_loras + s) * rank * in;
        for (int64_t r = 0; r < rank; r += 4) {
          const W* w[4];
          for (int64_t q = 0; q < 4; ++q) w[q] = rows + std::min(r + q, rank - 1) * in;
          float sums[4];
          dot1x4(x + token * in, w, in, sums);
          for (int64_t q = 0; q < 4 && r + q < rank; ++q) shrunk[r + q] = sums[q];
        }
        expand_rows(result + token * out, shrunk.data(), b + s * rank * out, out, rank, first, last);
      }
    }
  });
}

}  // namespace

namespace KILN_TIER_NS {

void lora_accumulate(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& slots, at::IntArrayRef part_rows, int64_t max_loras, int64_t rank) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "lora_delta: x must be float32 [rows, in], got ",
              x.scalar_type(), " of ", x.sizes());
  const int64_t n = x.size(0), in = x.size(1), parts = static_cast<int64_t>(part_rows.size());
  TORCH_CHECK(parts > 0 && max_loras > 0 && rank > 0, "lora_delta: needs parts, slots and a rank");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora_delta: A and B must both be float32 or both bfloat16, got ", a.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(a.dim() == 2 && a.size(0) == parts * max_loras * rank && a.size(1) == in, "lora_delta: A must be [",
              parts * max_loras * rank, ", ", in, "], got ", a.sizes());
  std::vector<int64_t> part_start{0};  // part p's output columns: part_start[p] .. part_start[p + 1]
  for (int64_t p = 0; p < parts; ++p) {
    TORCH_CHECK(part_rows[p] > 0, "lora_delta: part ", p, " has no rows");
    part_start.push_back(part_start.back() + part_rows[p]);
  }
  const int64_t out = part_start.back();
  TORCH_CHECK(b.dim() == 2 && b.size(0) == max_loras * rank && b.size(1) == out, "lora_delta: B must be [",
              max_loras * rank, ", ", out, "], got ", b.sizes());
  TORCH_CHECK(y.dim() == 2 && y.size(0) == n && y.size(1) == out && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "lora_delta: the output must be contiguous float32 [", n, ", ", out, "], got ", y.scalar_type(), " of ",
              y.sizes());
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.size(0) >= n,
              "lora_delta: slots must be int64 with at least ", n, " entries, got ", slots.scalar_type(), " of ",
              slots.sizes());
  const at::Tensor ss = slots.contiguous();
  const int64_t* slot = ss.data_ptr<int64_t>();
  std::vector<int64_t> active;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= -1 && slot[i] < max_loras, "lora_delta: token ", i, " has slot ", slot[i],
                "; the buffers hold slots 0 to ", max_loras - 1, " (-1: none)");
    if (slot[i] >= 0) active.push_back(i);
  }
  if (active.empty()) return;  // nothing read: a step without adapters costs these checks
  const at::Tensor xs = x.contiguous(), as = a.contiguous(), bs = b.contiguous();
  // fewer adapted tokens than a tile: one pass of the pool (`lora_few`); else the tokens' runs of a slot, tiled
  const bool few = static_cast<int64_t>(active.size()) < TILE_TOKENS;
  const auto run = [&](auto* a_data, auto* b_data) {
    using W = std::remove_const_t<std::remove_pointer_t<decltype(a_data)>>;
    (few ? lora_few<W> : lora_rows<W>)(xs.data_ptr<float>(), a_data, b_data, active, slot, part_start, max_loras, rank,
                                       in, out, y.data_ptr<float>());
  };
  if (as.scalar_type() == at::kFloat) {
    run(as.data_ptr<float>(), bs.data_ptr<float>());
  } else {
    run(as.data_ptr<at::BFloat16>(), bs.data_ptr<at::BFloat16>());
  }
}

}  // namespace KILN_TIER_NS

namespace {

at::Tensor lora_delta(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& slots,
                      at::IntArrayRef part_rows, int64_t max_loras, int64_t rank) {
  int64_t out = 0;
  for (const int64_t rows : part_rows) out += rows;
  at::Tensor result = at::zeros({x.dim() == 2 ? x.size(0) : 0, out}, x.options().dtype(at::kFloat));
  KILN_TIER_NS::lora_accumulate(result, x, a, b, slots, part_rows, max_loras, rank);
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("lora_delta(Tensor x, Tensor a, Tensor b, Tensor slots, int[] part_rows, int max_loras, int rank) -> Tensor");
  m.impl("lora_delta", c10::DispatchKey::CPU, TORCH_FN(lora_delta));
}
