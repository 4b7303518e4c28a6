// bf16 products on the CPU's matrix unit through oneDNN's batch-reduce GEMM ukernel, as ATen exposes it
// (`at::native::cpublas::brgemm`, the route SGLang's CPU kernels take): AMX tiles where the CPU has them and Linux
// granted them (oneDNN asks the kernel for tile permission itself), AVX-512 BF16 or AVX-512 otherwise.
//
// `brgemm_bf16_linear(x, packed, n)`: x [rows, in] float32 times a weight held as a bf16 copy in oneDNN's VNNI
// order, BLOCK_N outputs a block: packed [blocks, in / 2, BLOCK_N, 2] (the pairs of one output's consecutive inputs
// adjacent; outputs past `n` in the last block are zeros). x is rounded to bf16 once; products accumulate in
// float32 and are written as float32 (no bf16 rounding of the output: it alone gave the default model a mean KL of
// 6e-4 against float32, the rounded inputs 1.5e-4). kiln/kernels/compute_forms.py makes the copies.
//
// Blocking: threads share out the output blocks; each walks its blocks in groups whose weights fit half of a
// 2 MB L2 and, for each group, every BLOCK_M rows of x: a weight block is read from memory once per group and
// from L2 for the other row blocks, an x block stays in L1/L2 across its group (a 1,024-row product of 3072x576:
// 3.3 ms against 5.1 ms walking all blocks per row block, one loaded core). One brgemm_release per thread and call:
// releasing per block costs as much as the block (a shape change reloads the tile configuration).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>

#include "bf16_form.h"

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace {

constexpr int64_t BLOCK_N = FORM_BLOCK_N;
constexpr int64_t BLOCK_M = 64;  // rows of x per brgemm call

at::Tensor brgemm_bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  check_form_operands("brgemm_bf16_linear", "weight", x, packed, n);
  const int64_t rows = x.size(0), in = x.size(1), blocks = packed.size(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
#ifdef CPUBLAS_BRGEMM_BF16BF16F32
  const at::Tensor xb = x.contiguous().to(at::kBFloat16);
  const at::BFloat16* a = xb.data_ptr<at::BFloat16>();
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  float* c = out.data_ptr<float>();
  const int64_t group = std::max<int64_t>(1, FORM_GROUP_BYTES / (in * BLOCK_N * 2));
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g0 = begin; g0 < end; g0 += group) {
      const int64_t g1 = std::min(end, g0 + group);
      for (int64_t m0 = 0; m0 < rows; m0 += BLOCK_M) {
        const int64_t m = std::min(BLOCK_M, rows - m0);
        for (int64_t b = g0; b < g1; ++b) {
          const int64_t cols = std::min(BLOCK_N, n - b * BLOCK_N);
          at::native::cpublas::brgemm(m, cols, in, /*ld_a=*/in, /*ld_b=*/BLOCK_N, /*ld_c=*/n, /*add_C=*/false,
                                      a + m0 * in, w + b * in * BLOCK_N, c + m0 * n + b * BLOCK_N, /*is_vnni=*/true);
        }
      }
    }
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  });
  return out;
#else
  TORCH_CHECK(false, "brgemm_bf16_linear: this torch has no bf16 cpublas::brgemm");
  return out;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(KILN_TIER_NS, m) {
  m.def("brgemm_bf16_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.impl("brgemm_bf16_linear", c10::DispatchKey::CPU, TORCH_FN(brgemm_bf16_linear));
}
