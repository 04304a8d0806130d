// Integer arithmetic for float results that must have the same bits as the
// portable programs on every backend: funcreplay/core/fixedpoint.py, step for
// step (that module says why: XLA:GPU's float32 division is not IEEE).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace funcreplay {

inline uint32_t MulHi(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

// float32 num / den correctly rounded, a result below the smallest normal
// flushed to 0 after rounding to 24 bits (fixedpoint.divide), by the same long
// division. DivideExact below is the fast equivalent the kernels call.
inline float DivideLong(float num, float den) {
  constexpr uint32_t kInf = 0x7F800000u, kNaN = 0x7FC00000u;
  uint32_t a, b;
  std::memcpy(&a, &num, sizeof a);
  std::memcpy(&b, &den, sizeof b);
  const int32_t ea = static_cast<int32_t>(a >> 23), eb = static_cast<int32_t>(b >> 23);
  const uint32_t ma = (a & 0x7FFFFFu) | 0x800000u, mb = (b & 0x7FFFFFu) | 0x800000u;
  // q = floor(ma * 2**25 / mb): one step of 1 bit, three of 8.
  uint32_t r = ma << 1;
  uint32_t q = r / mb;
  r -= q * mb;
  for (int step = 0; step < 3; ++step) {
    r <<= 8;
    const uint32_t d = r / mb;
    q = (q << 8) | d;
    r -= d * mb;
  }
  const int32_t wide = static_cast<int32_t>(q >> 25);
  const uint32_t shift = 1 + static_cast<uint32_t>(wide);
  uint32_t mant = q >> shift;
  const uint32_t half = (q >> (shift - 1)) & 1u;
  const bool sticky = (q & (shift - 1)) != 0 || r != 0;
  mant += half & static_cast<uint32_t>(sticky || (mant & 1u) == 1u);
  const int32_t biased = ea - eb + 126 + wide + static_cast<int32_t>(mant >> 24);
  uint32_t bits;
  if (biased >= 255) {
    bits = kInf;
  } else if (biased < 1 || ea == 0) {
    bits = 0;
  } else {
    bits = (static_cast<uint32_t>(biased) << 23) | (mant & 0x7FFFFFu);
  }
  if (b == kInf) bits = 0;
  if (a == kInf) bits = kInf;
  if (a > kInf || b > kInf || (a == kInf && b == kInf)) bits = kNaN;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// DivideLong's bits, faster (the kernels divide once per sampled row): the
// quotient of two floats in double, rounded to float, is the correctly rounded
// float quotient (double rounding is innocuous for division when the wide
// format has >= 2p + 2 bits, 53 >= 50; Figueroa 1995). Below the smallest
// normal float the long division rounds to 24 bits and then flushes, so only a
// quotient that rounds up to FLT_MIN survives: scaled by 2**64 that is a test
// on a normal float. tests/native/test_native_numerics.py compares the two
// with fixedpoint.divide.
inline float DivideExact(float num, float den) {
  // A denormal numerator counts as 0, as in the long division (its exponent field is 0).
  const double n = std::fabs(num) < 0x1p-126f ? 0.0 : static_cast<double>(num);
  const double q = n / static_cast<double>(den);
  constexpr double kMinNormal = 1.17549435082228750797e-38;  // FLT_MIN, 2**-126
  if (q != q) {  // the quiet NaN DivideLong returns (x86 would give a negative one)
    constexpr uint32_t kNaN = 0x7FC00000u;
    float nan;
    std::memcpy(&nan, &kNaN, sizeof nan);
    return nan;
  }
  if (q >= kMinNormal) return static_cast<float>(q);  // normal or inf
  return static_cast<float>(q * 0x1p64) >= 0x1p-62f ? static_cast<float>(kMinNormal) : 0.0f;
}

}  // namespace funcreplay
