// priority**alpha in integer arithmetic, step for step as funcreplay/core/powers.py
// computes it in JAX (that module's docstring has the algorithm, its fixed-point
// formats and its error), so a weight here has the same bits as the jitted
// program's on every backend. The tables and constants come from Python
// (powers.constants(), correctly rounded there once) through PowTables, so
// nothing here re-derives them with this machine's libm.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "fixedpoint.h"

namespace funcreplay {

// The layout powers.constants() is flattened into (host/direct.py): three tables
// of kPowEntries uint32 (log2 m_i Q.32, 1/m_i Q.32, 2**(j/256) Q.30), then
// inv_ln2 Q.31, ln2 Q.32, third Q.32, sixth Q.32.
constexpr int kPowIndexBits = 8;
constexpr int kPowEntries = 1 << kPowIndexBits;
constexpr int kPowWords = 3 * kPowEntries + 4;

struct PowParams {
  const uint32_t* t;  // kPowWords words
  uint32_t m;         // float32(alpha) == m * 2**e, m < 2**24
  int e;
  bool zero, one;     // alpha == 0, alpha == 1
};

inline PowParams MakePowParams(const uint32_t* words, float alpha) {
  PowParams p{words, 0, 0, alpha == 0.0f, alpha == 1.0f};
  int ex = 0;
  const double frac = std::frexp(static_cast<double>(alpha), &ex);  // exact
  p.m = static_cast<uint32_t>(frac * 16777216.0);
  p.e = ex - 24;
  return p;
}

// float32 priority**alpha; 0 for priority <= 0, at most 2**96 for a finite priority
// (powers.power; its docstring's step 5 says why the weights saturate there).
inline float PowerWeight(float priority, const PowParams& p) {
  constexpr uint32_t kTinyBits = 0x0DA24260u;  // float32(1e-30), numerics.TINY
  constexpr uint32_t kMaxFinite = 0x7F7FFFFFu, kInf = 0x7F800000u;
  constexpr uint32_t kMaxWeightBits = 0x6F800000u;  // float32(2**96), powers.MAX_WEIGHT
  uint32_t bits;
  std::memcpy(&bits, &priority, sizeof bits);
  if (static_cast<int32_t>(bits) <= 0) return 0.0f;
  uint32_t out;
  const bool special = bits >= kInf;
  const uint32_t x = bits < kTinyBits ? kTinyBits : (bits > kMaxFinite ? kMaxFinite : bits);
  if (p.zero) {
    out = special && bits > kInf ? bits : 0x3F800000u;
  } else if (p.one) {
    out = special ? bits : x;
  } else if (special) {
    out = bits;
  } else {
    const uint32_t* t = p.t;
    const uint32_t inv_ln2 = t[3 * kPowEntries], ln2 = t[3 * kPowEntries + 1];
    const uint32_t third = t[3 * kPowEntries + 2], sixth = t[3 * kPowEntries + 3];
    // 1. L = log2(m), Q.32.
    const int32_t e = static_cast<int32_t>(x >> 23) - 127;
    const uint32_t f = x & 0x7FFFFFu;
    const uint32_t i = f >> (23 - kPowIndexBits);
    const uint32_t low = f & ((1u << (23 - kPowIndexBits)) - 1);
    const uint32_t u = MulHi(low << (17 + kPowIndexBits - 8), t[kPowEntries + i]);
    const uint32_t u2 = MulHi(u, u), u3 = MulHi(u2, u);
    const uint32_t ln = u - (u2 >> 9) + (MulHi(u3, third) >> 16);
    const uint32_t big_l = t[i] + (MulHi(ln, inv_ln2) >> 7);
    // 2. P = M * (e * 2**32 + L) = hi * 2**32 + lo; y = P / 2**(32 - E).
    const int32_t hi = e * static_cast<int32_t>(p.m) + static_cast<int32_t>(MulHi(big_l, p.m));
    const uint32_t lo = big_l * p.m;
    const int k = 32 - p.e - 32;  // >= 8 (alpha < 2**15)
    const int32_t whole = hi >> (k < 31 ? k : 31);
    uint32_t frac;
    if (k < 32) {
      frac = (static_cast<uint32_t>(hi) << (32 - k)) | (lo >> k);
    } else {
      frac = static_cast<uint32_t>(hi >> (k - 32 < 31 ? k - 32 : 31));
    }
    // 3. 2**frac, Q.30.
    const uint32_t j = frac >> (32 - kPowIndexBits);
    const uint32_t r = frac & ((1u << (32 - kPowIndexBits)) - 1);
    const uint32_t tt = MulHi(r << kPowIndexBits, ln2);
    const uint32_t t2 = MulHi(tt, tt), t3 = MulHi(t2, tt);
    const uint32_t s = tt + (t2 >> 9) + (MulHi(t3, sixth) >> 16);
    const uint32_t b = t[2 * kPowEntries + j];
    // 4. Round to 24 bits, add the exponent.
    const uint32_t mant = (b + (MulHi(b, s) >> 8) + 64) >> 7;
    const int32_t biased = whole + 127 + static_cast<int32_t>(mant >> 24);
    if (biased >= 255) {
      out = kInf;
    } else if (biased <= 0) {
      out = 0;
    } else {
      out = (static_cast<uint32_t>(biased) << 23) | (mant & 0x7FFFFFu);
    }
  }
  if (!special && out > kMaxWeightBits) out = kMaxWeightBits;
  float w;
  std::memcpy(&w, &out, sizeof w);
  return w;
}

}  // namespace funcreplay
