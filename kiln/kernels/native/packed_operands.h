// The operands every native packed product takes, checked once: x [rows, in] float32; codes [out, groups, width]
// uint8 nibble pairs (width = group / 2) or int8 (width = group); scale and offset, one float32 per group.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

// How far ahead of the outputs being computed a product prefetches their packed rows (codes, scales, offsets). A
// tile reads T outputs' rows interleaved, group by group: 3 x T streams the hardware prefetchers lose track of,
// so without this a one-row product waits on memory (1.7x slower at one row on a 2-core Xeon, 3072 x 576 4-bit).
constexpr int64_t PREFETCH_OUTPUTS = 64;

// A prefetch hint for every cache line of `bytes` bytes at `offset` bytes from `base` (a hint never faults: past
// the end of the tensor is harmless; the address is formed as an integer, not as a pointer past the end).
inline void prefetch_lines(const void* base, int64_t offset, int64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(offset);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const void*>(start + b), 0, 3);
}

struct PackedShape {
  bool nibbles;
  int64_t n, groups, code_bytes, group;  // outputs, groups per output, bytes of one group's codes, values per group
};

// TORCH_CHECKs that name `op` and what was expected; the shape of the packed weight.
inline PackedShape check_packed_operands(const char* op, const at::Tensor& x, const at::Tensor& codes,
                                         const at::Tensor& scale, const at::Tensor& offset) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "kiln native ", op, ": x must be [rows, in] float32");
  TORCH_CHECK(codes.dim() == 3 && (codes.scalar_type() == at::kByte || codes.scalar_type() == at::kChar), "kiln native ",
              op, ": codes must be [out, groups, width] uint8 nibble pairs or int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && offset.scalar_type() == at::kFloat, "kiln native ", op,
              ": scale and offset must be float32");
  const bool nibbles = codes.scalar_type() == at::kByte;
  const int64_t n = codes.size(0), groups = codes.size(1), code_bytes = codes.size(2);
  const int64_t group = nibbles ? 2 * code_bytes : code_bytes;
  TORCH_CHECK(x.size(1) == groups * group, "kiln native ", op, ": x has ", x.size(1), " inputs, the weight ",
              groups * group);
  TORCH_CHECK(scale.numel() == n * groups && offset.numel() == n * groups, "kiln native ", op,
              ": one scale and one offset per group");
  return {nibbles, n, groups, code_bytes, group};
}
