// The random bits of a sample, bit for bit the portable programs' recipe
// (funcreplay/core/bits.py, core/sampling/draw.py; BUILD.md "Bit recipe"):
//
//   * threefry-2x32 (20 rounds) as jax.random's threefry2x32;
//   * stream s of a key (k0, k1), n rows: flat word c in [0, 2n) is y0 ^ y1 of
//     threefry2x32(k, (s, c)); row i takes hi = word i, lo = word n + i.
//     Stream 0 is jax.random.bits(key, (2, n), uint32) (bits.words);
//   * a uniform integer in [0, r): (hi * 2**64 + lo * 2**32) * r >> 64 (bits.below);
//   * split (jax.random.split(key), threefry keys): key i = threefry2x32(k, (0, i)).
#ifndef FUNCREPLAY_NATIVE_RANDOM_H_
#define FUNCREPLAY_NATIVE_RANDOM_H_

#include <algorithm>
#include <cstdint>
#include <vector>

namespace funcreplay {

inline uint32_t Rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// threefry2x32(key, (x0, x1)): jax's, 20 rounds.
inline void Threefry2x32(uint32_t k0, uint32_t k1, uint32_t x0, uint32_t x1, uint32_t* y0,
                         uint32_t* y1) {
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  static constexpr int kRot[8] = {13, 15, 26, 6, 17, 29, 16, 24};
  x0 += ks[0];
  x1 += ks[1];
  for (int i = 0; i < 5; ++i) {
    const int* r = kRot + 4 * (i % 2);
    for (int j = 0; j < 4; ++j) {
      x0 += x1;
      x1 = Rotl(x1, r[j]) ^ x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
  }
  *y0 = x0;
  *y1 = x1;
}

// Word c of stream s: y0 ^ y1 of threefry2x32(k, (s, c)).
inline uint32_t StreamWord(uint32_t k0, uint32_t k1, uint32_t s, uint32_t c) {
  uint32_t y0, y1;
  Threefry2x32(k0, k1, s, c, &y0, &y1);
  return y0 ^ y1;
}

// Rows [0, count) of stream s laid out for n rows: hi[i] = word i, lo[i] =
// word n + i (lo may be null: only the hi words are computed then).
inline void StreamWords(uint32_t k0, uint32_t k1, uint32_t s, int64_t n, int64_t count,
                        uint32_t* hi, uint32_t* lo) {
  for (int64_t i = 0; i < count; ++i) hi[i] = StreamWord(k0, k1, s, static_cast<uint32_t>(i));
  if (lo == nullptr) return;
  for (int64_t i = 0; i < count; ++i) {
    lo[i] = StreamWord(k0, k1, s, static_cast<uint32_t>(n + i));
  }
}

// floor((hi * 2**32 + lo) * r / 2**64): uniform in [0, r) (bits.below).
inline int64_t Below(uint32_t hi, uint32_t lo, uint32_t r) {
  const uint64_t a = static_cast<uint64_t>(hi) * r;
  const uint64_t b = (static_cast<uint64_t>(lo) * r) >> 32;
  return static_cast<int64_t>((a + b) >> 32);
}

// A float32 in [0, 1) from the top 24 bits of a word (prioritized_lean: (hi >> 8) * 2**-24).
inline float Uniform24(uint32_t hi) {
  return static_cast<float>(hi >> 8) * (1.0f / 16777216.0f);
}

// jax.random.split(key)[i] for a threefry key: threefry2x32(k, (0, i)).
inline void SplitKey(uint32_t k0, uint32_t k1, uint32_t i, uint32_t* out0, uint32_t* out1) {
  Threefry2x32(k0, k1, 0u, i, out0, out1);
}

// A small open-addressing map int32 -> int32 (the virtual Fisher-Yates array).
class IntMap {
 public:
  explicit IntMap(int64_t expected) {
    size_t cap = 16;
    while (cap < static_cast<size_t>(expected) * 2) cap <<= 1;
    keys_.assign(cap, -1);
    vals_.assign(cap, 0);
    mask_ = cap - 1;
  }
  // The value at k, or k itself when absent.
  int64_t Get(int64_t k) const {
    size_t h = Hash(k);
    while (keys_[h] != -1) {
      if (keys_[h] == k) return vals_[h];
      h = (h + 1) & mask_;
    }
    return k;
  }
  void Set(int64_t k, int64_t v) {
    size_t h = Hash(k);
    while (keys_[h] != -1 && keys_[h] != k) h = (h + 1) & mask_;
    keys_[h] = k;
    vals_[h] = v;
  }

 private:
  size_t Hash(int64_t k) const {
    return ((static_cast<uint64_t>(k) * 0x9E3779B97F4A7C15ull) >> 40) & mask_;
  }
  std::vector<int64_t> keys_, vals_;
  size_t mask_;
};

// Positions of a uniform draw of ``b`` rows from [0, n) on stream s of the key
// (uniform_lean.positions / bits.without_replacement): with ``replace``, row i
// is below(hi_i, lo_i, max(n, 1)) (all rows valid when n > 0); without, the
// first min(b, n) entries of a partial Fisher-Yates shuffle of [0, n), j_i =
// i + below(hi_i, lo_i, n - i) (rows i >= n invalid). Writes ``count`` rows
// into out (count <= b: the first rows depend on the first words only).
// Returns the number of valid rows written.
inline int64_t Positions(uint32_t k0, uint32_t k1, uint32_t s, int64_t n, int64_t b,
                         bool replace, int64_t count, int64_t* out) {
  std::vector<uint32_t> hi(count), lo(count);
  StreamWords(k0, k1, s, b, count, hi.data(), lo.data());
  if (replace) {
    if (n <= 0) return 0;
    for (int64_t i = 0; i < count; ++i) out[i] = Below(hi[i], lo[i], static_cast<uint32_t>(n));
    return count;
  }
  const int64_t valid = std::min(count, n);
  IntMap a(valid);
  for (int64_t i = 0; i < valid; ++i) {
    const int64_t j = i + Below(hi[i], lo[i], static_cast<uint32_t>(n - i));
    out[i] = a.Get(j);
    a.Set(j, a.Get(i));
  }
  return valid;
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_RANDOM_H_
