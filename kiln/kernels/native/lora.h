// What lora.cpp gives the other sources of its tier (dispatch.cpp's `kiln::packed_linear_lora`): each token's
// adapter product added into a product's output, in place. In the tier's own namespace: two tiers' objects in one
// process never share the symbol.
#pragma once

#include <ATen/core/Tensor.h>

#ifndef KILN_TIER_NS
#error "KILN_TIER_NS (the op namespace of this tier) must be defined"
#endif

namespace KILN_TIER_NS {

// y [n, out] (float32, contiguous) += B[slot] @ (A[slot] @ x) of each token's slot (lora.cpp's `lora_delta` names
// the operands); tokens of slot -1 are left as they are.
void lora_accumulate(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& slots, at::IntArrayRef part_rows, int64_t max_loras, int64_t rank);

}  // namespace KILN_TIER_NS
