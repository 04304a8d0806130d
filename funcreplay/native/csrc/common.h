// Shared pieces of funcreplay's native kernels: two-word
// counters, the staleness version index, the ledger, a slot set and sum-tree
// refreshes. Plain C++ over raw pointers (no XLA types), so the FFI handlers
// (kernels.cc) and the direct host entry points (direct.cc) share them.
#ifndef FUNCREPLAY_NATIVE_COMMON_H_
#define FUNCREPLAY_NATIVE_COMMON_H_

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace funcreplay {

// --- two-word counters: uint32[2] = [hi, lo] ---

inline void CounterAdd(uint32_t* c, uint64_t n) {
  uint64_t v = (static_cast<uint64_t>(c[0]) << 32) | c[1];
  v += n;
  c[0] = static_cast<uint32_t>(v >> 32);
  c[1] = static_cast<uint32_t>(v);
}


// --- the staleness version index (funcreplay/staleness.py), bit for bit ---
// hist int32[V] counts the items of the V newest versions (bucket version & (V-1));
// bounds int32[3] = [newest version, items older than the window, their lowest
// version (a lower bound)]. int32 arithmetic wraps, as in the JAX code.

constexpr int32_t kNone = 2147483647;

inline int32_t Wrap(uint32_t x) { return static_cast<int32_t>(x); }
inline int32_t Sub(int32_t a, int64_t b) {
  return Wrap(static_cast<uint32_t>(a) - static_cast<uint32_t>(b));
}
// How many versions ``item`` is behind ``version`` (0 at or ahead), exact for any two
// int32 versions: staleness.behind, the sampled_staleness_sum counter's terms.
inline uint32_t Behind(int32_t version, int32_t item) {
  return version > item ? static_cast<uint32_t>(version) - static_cast<uint32_t>(item) : 0u;
}

struct VersionIndex {
  int32_t* hist = nullptr;    // int32[V], or null without max_staleness
  int32_t* bounds = nullptr;  // int32[3]
  int64_t v = 0;

  // Move the window up to the newest of versions[mask] (staleness.advance).
  void Advance(const int32_t* versions, const bool* mask, int64_t n) {
    if (v == 0) return;
    const int32_t hi = bounds[0];
    int32_t new_hi = hi, n_old = bounds[1], old_min = bounds[2];
    for (int64_t i = 0; i < n; ++i) {
      if (mask[i]) new_hi = std::max(new_hi, versions[i]);
    }
    const int32_t limit = Sub(new_hi, v);
    for (int64_t b = 0; b < v; ++b) {
      const int32_t vb = Sub(hi, static_cast<uint32_t>(Sub(hi, b)) & static_cast<uint32_t>(v - 1));
      if (vb <= limit && hist[b] > 0) {
        n_old = Wrap(static_cast<uint32_t>(n_old) + static_cast<uint32_t>(hist[b]));
        old_min = std::min(old_min, vb);
        hist[b] = 0;
      }
    }
    bounds[0] = new_hi;
    bounds[1] = n_old;
    bounds[2] = old_min;
  }

  // Count versions[mask] in (delta = 1) or out (-1) (staleness._shift).
  template <typename Mask>  // bool or uint8_t flags
  void Shift(const int32_t* versions, const Mask* mask, int64_t n, int32_t delta) {
    if (v == 0) return;
    const int32_t limit = Sub(bounds[0], v);
    int32_t n_old_items = 0, min_old = kNone;
    for (int64_t i = 0; i < n; ++i) {
      if (!mask[i]) continue;
      if (versions[i] > limit) {
        hist[static_cast<uint32_t>(versions[i]) & static_cast<uint32_t>(v - 1)] += delta;
      } else {
        ++n_old_items;
        min_old = std::min(min_old, versions[i]);
      }
    }
    const int32_t n_old = Wrap(static_cast<uint32_t>(bounds[1]) +
                               static_cast<uint32_t>(delta * n_old_items));
    bounds[1] = n_old;
    if (delta > 0) {
      bounds[2] = std::min(bounds[2], min_old);
    } else if (n_old <= 0) {  // a lower bound: reset only when no old item is left
      bounds[2] = kNone;
    }
  }
};

// --- the ledger (funcreplay/state.py): the table's scalars and two-word
// counters in one uint32 array. The attribute ``ledger`` gives the word of
// each entry, in this order (native.ledger_attr: state.ledger_words()), then the rate
// limiter's [p, q, diff limit] (rate_limiters.update_diff).
enum LedgerEntry : size_t {
  kLWritePos = 0, kLNextKey, kLMaxPriority, kLLimiterDiff,  // one word each
  kLInserts, kLSamples, kLDeletes, kLEvictedCapacity, kLEvictedStale,  // two words each
  kLEvictedReuse, kLRemovedReuse, kLStaleSum, kLInvalidPriorities,
  kLNumEntries,
};

class Ledger {
 public:
  // False if ``layout`` does not fit a ledger of ``n`` words.
  bool Open(uint32_t* words, int64_t n, const int64_t* layout, size_t layout_size) {
    if (layout_size != kLNumEntries + 3) return false;
    for (size_t e = 0; e < kLNumEntries; ++e) {
      const int64_t width = e < kLInserts ? 1 : 2;
      if (layout[e] < 0 || layout[e] + width > n) return false;
    }
    words_ = words;
    layout_ = layout;
    return true;
  }
  uint32_t* Word(LedgerEntry e) const { return words_ + layout_[e]; }
  int32_t GetInt(LedgerEntry e) const { return static_cast<int32_t>(*Word(e)); }
  void SetInt(LedgerEntry e, int32_t v) { *Word(e) = static_cast<uint32_t>(v); }
  float GetFloat(LedgerEntry e) const {
    float f;
    std::memcpy(&f, Word(e), sizeof f);
    return f;
  }
  void SetFloat(LedgerEntry e, float f) { std::memcpy(Word(e), &f, sizeof f); }
  void Count(LedgerEntry e, uint64_t n) { CounterAdd(Word(e), n); }
  // limiter_diff += p * inserted (clipped to +limit), then -= q * sampled
  // (clipped to -limit): rate_limiters.update_diff, exact (p, q <= 2**29).
  void UpdateLimiter(int64_t inserted, int64_t sampled) {
    const int64_t p = layout_[kLNumEntries];
    const int64_t q = layout_[kLNumEntries + 1];
    const int64_t limit = layout_[kLNumEntries + 2];
    int64_t d = GetInt(kLLimiterDiff);
    d = std::min(d + p * inserted, limit);
    d = std::max(d - q * sampled, -limit);
    SetInt(kLLimiterDiff, static_cast<int32_t>(d));
  }

 private:
  uint32_t* words_ = nullptr;
  const int64_t* layout_ = nullptr;
};

// --- a small open-addressing set of slots (without-replacement dedup) ---

class SlotSet {
 public:
  explicit SlotSet(int64_t expected) {
    size_t cap = 16;
    while (cap < static_cast<size_t>(expected) * 2) cap <<= 1;
    table_.assign(cap, -1);
    mask_ = cap - 1;
  }
  // Inserts s; false if it was present.
  bool Insert(int32_t s) {
    size_t h = (static_cast<uint32_t>(s) * 2654435761u) & mask_;
    while (table_[h] != -1) {
      if (table_[h] == s) return false;
      h = (h + 1) & mask_;
    }
    table_[h] = s;
    return true;
  }
  bool Contains(int32_t s) const {
    size_t h = (static_cast<uint32_t>(s) * 2654435761u) & mask_;
    while (table_[h] != -1) {
      if (table_[h] == s) return true;
      h = (h + 1) & mask_;
    }
    return false;
  }

 private:
  std::vector<int32_t> table_;
  size_t mask_;
};

// Recompute the ancestors of changed leaves (tree nodes P + slot, all on the
// leaf level) in a float sum tree: each node becomes fl(left + right) of its
// children, exactly as the portable refresh does. Level by level, so every
// node is recomputed after its children's final values, and the loads of one
// level are prefetched together so their cache misses overlap.
inline void RecomputeSumMany(float* tree, std::vector<int64_t> nodes) {
  while (!nodes.empty() && nodes[0] > 1) {
    for (auto& n : nodes) {
      n >>= 1;
      __builtin_prefetch(tree + 2 * n);
    }
    for (int64_t n : nodes) tree[n] = tree[2 * n] + tree[2 * n + 1];
  }
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_COMMON_H_
