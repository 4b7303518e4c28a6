// What the ops over a weight's bf16 copy in oneDNN's VNNI order share (dense_brgemm.cpp's product, head_scores.cpp's
// scorer): the copy's layout, [blocks, in / 2, FORM_BLOCK_N, 2] (the pairs of one output's consecutive inputs
// adjacent; outputs past `n` in the last block are zeros: kiln/kernels/compute_forms.py makes it), how much of it a
// thread walks before its next block of rows, and the checks of the operands.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace {

constexpr int64_t FORM_BLOCK_N = 32;                    // outputs per block (kiln/kernels/compute_forms.py BLOCK_N)
constexpr int64_t FORM_GROUP_BYTES = int64_t{1} << 20;  // weight bytes a thread walks before its next row block

// x [rows, in] float32 against `packed`, the copy of a weight of `n` outputs; errors name `op` and `what` it holds.
inline void check_form_operands(const char* op, const char* what, const at::Tensor& x, const at::Tensor& packed,
                                int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be a float32 matrix, got ",
              x.scalar_type(), " of ", x.dim(), " dims");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == FORM_BLOCK_N &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              op, ": the ", what, " must be a contiguous bf16 [blocks, in/2, ", FORM_BLOCK_N, ", 2] copy");
  const int64_t in = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == in, op, ": x has ", in, " inputs, the ", what, " ", packed.size(1) * 2);
  TORCH_CHECK(n > (blocks - 1) * FORM_BLOCK_N && n <= blocks * FORM_BLOCK_N, op, ": ", n, " outputs do not fill ",
              blocks, " blocks of ", FORM_BLOCK_N);
}

}  // namespace
