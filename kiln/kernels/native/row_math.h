// What the two scorers of logits rows share (row_scores.cpp over written logits, head_scores.cpp over the head's
// tiles as they are made): exp of a non-positive float, written so that a loop over it vectorizes.
#pragma once

#include <cstdint>
#include <cstring>

namespace {

// exp(x) for x <= 0 (logit - largest), written so that a loop over it vectorizes: no calls, no branches.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // exp(-87) ~ 1.6e-38: a normal float, and nothing next to the largest's 1
  // round to nearest by the 1.5 * 2^23 shift (the default rounding mode), which vectorizes where nearbyint does not
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace
