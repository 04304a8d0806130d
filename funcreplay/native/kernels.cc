// CPU kernels for funcreplay's hot paths, called from jitted code through the
// XLA FFI (jax.ffi.ffi_call). Each kernel does in one call what the portable
// JAX implementation spreads over ~100-160 XLA operations; on XLA:CPU every
// operation has a fixed cost of about a microsecond, which dominated small
// batches. Semantics are those of funcreplay/sampling.py (see the docstring of
// funcreplay/native/__init__.py); tests compare the two implementations.
//
// Buffers are updated in place: every state leaf a kernel reads or writes is
// passed as an operand aliased to a result, so XLA orders later writers of
// those leaves after the kernel without copies (when the state is donated).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// --- randomness: threefry-2x32 (20 rounds) in counter mode over the key ---

inline uint32_t Rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

class Threefry {
 public:
  Threefry(uint32_t k0, uint32_t k1) : k0_(k0), k1_(k1) {}

  uint64_t Next64() {
    uint32_t x0 = static_cast<uint32_t>(counter_ >> 32);
    uint32_t x1 = static_cast<uint32_t>(counter_);
    ++counter_;
    const uint32_t ks[3] = {k0_, k1_, k0_ ^ k1_ ^ 0x1BD11BDAu};
    static const int kRot[8] = {13, 15, 26, 6, 17, 29, 16, 24};
    x0 += ks[0];
    x1 += ks[1];
    for (int i = 0; i < 5; ++i) {
      const int* r = kRot + 4 * (i % 2);
      for (int j = 0; j < 4; ++j) {
        x0 += x1;
        x1 = Rotl(x1, r[j]);
        x1 ^= x0;
      }
      x0 += ks[(i + 1) % 3];
      x1 += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
    }
    return (static_cast<uint64_t>(x0) << 32) | x1;
  }

  void Seek(uint64_t counter) { counter_ = counter; }

  // Uniform integer in [0, n), n >= 1 (bias below n / 2**64).
  int64_t Below(int64_t n) {
    unsigned __int128 m = static_cast<unsigned __int128>(Next64()) * static_cast<uint64_t>(n);
    return static_cast<int64_t>(m >> 64);
  }

 private:
  uint32_t k0_, k1_;
  uint64_t counter_ = 0;
};

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

template <typename Rets>
VersionIndex OpenIndex(Rets& rets, size_t hist_at, size_t bounds_at) {
  VersionIndex index;
  auto h = rets.template get<ffi::AnyBuffer>(hist_at).value();
  index.v = static_cast<int64_t>(h->element_count());
  if (index.v > 0) {
    index.hist = static_cast<int32_t*>(h->untyped_data());
    index.bounds = static_cast<int32_t*>(
        rets.template get<ffi::AnyBuffer>(bounds_at).value()->untyped_data());
  }
  return index;
}

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
  bool Open(uint32_t* words, int64_t n, ffi::Span<const int64_t> layout) {
    if (layout.size() != kLNumEntries + 3) return false;
    for (size_t e = 0; e < kLNumEntries; ++e) {
      const int64_t width = e < kLInserts ? 1 : 2;
      if (layout[e] < 0 || layout[e] + width > n) return false;
    }
    words_ = words;
    layout_ = layout.begin();
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
  // limiter_diff += p * inserted - q * sampled in wrapping int32, clipped to
  // +-limit: rate_limiters.update_diff bit for bit.
  void UpdateLimiter(int64_t inserted, int64_t sampled) {
    const uint32_t p = static_cast<uint32_t>(layout_[kLNumEntries]);
    const uint32_t q = static_cast<uint32_t>(layout_[kLNumEntries + 1]);
    const int32_t limit = static_cast<int32_t>(layout_[kLNumEntries + 2]);
    const int32_t d = Wrap(static_cast<uint32_t>(GetInt(kLLimiterDiff)) +
                           p * static_cast<uint32_t>(inserted) -
                           q * static_cast<uint32_t>(sampled));
    SetInt(kLLimiterDiff, std::min(std::max(d, -limit), limit));
  }

 private:
  uint32_t* words_ = nullptr;
  const int64_t* layout_ = nullptr;
};

template <typename Rets>
bool OpenLedger(Rets& rets, size_t at, ffi::Span<const int64_t> layout, Ledger* ledger) {
  auto buf = rets.template get<ffi::AnyBuffer>(at).value();
  return ledger->Open(static_cast<uint32_t*>(buf->untyped_data()),
                      static_cast<int64_t>(buf->element_count()), layout);
}

ffi::Error LedgerMismatch(const char* kernel) {
  return ffi::Error::InvalidArgument(
      std::string(kernel) + ": the ledger layout does not fit the ledger operand "
      "(native.ledger_attr and kernels.cc disagree; rebuild the native kernels)");
}

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

template <typename T>
T* Ptr(ffi::RemainingArgs& args, size_t i) {
  return static_cast<T*>(args.get<ffi::AnyBuffer>(i).value().untyped_data());
}
template <typename T>
T* Ptr(ffi::RemainingRets& rets, size_t i) {
  return static_cast<T*>(rets.get<ffi::AnyBuffer>(i).value()->untyped_data());
}

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

// Operand layout of Sample (R = results aliased to state operands):
enum Arg : size_t {
  kKey = 0,       // uint32[k] PRNG key data
  kParams,        // int32[4] [version, staleness threshold, num_eligible, enabled]
  kTotal,         // float32[] eligible weight (prioritized; else unused)
  kWhere,         // bool[C] or bool[0]
  kOccupied,      // bool[C]          (aliased, R0)
  kKeys,          // uint32[C]        (R1)
  kVersion,       // int32[C]         (R2)
  kTimes,         // int32[C]         (R3)
  kPriority,      // float32[C]       (R4)
  kOccTree,       // int32[2P]        (R5)
  kWeightTree,    // float32[2P] (prioritized) or float32[0]  (R6)
  kLedger,        // uint32[L]        (R7) scalars and counters
  kHist,          // int32[V]         (R8) staleness version index
  kBounds,        // int32[3]         (R9)
  kData,          // data leaves [C, ...] (R10 ...)
};
constexpr size_t kFirstState = kOccupied;

// Draws slot candidates proportionally to their sampling weight: uniform over
// the occupied slots (a ring position while the Fifo ring has no holes, else
// the k-th occupied slot from the count tree), or proportional to
// priority**alpha from the weight tree. -1: the draw found no weight.
class Drawer {
 public:
  Drawer(Threefry* rng, const int32_t* tree, const float* wtree, int64_t p, int64_t c,
         int64_t size, int64_t ring_start, int64_t ring_filled, bool ring)
      : rng_(rng), tree_(tree), wtree_(wtree), p_(p), c_(c), size_(size),
        start_(ring_start), filled_(ring_filled), ring_(ring) {}

  bool HasWeight() const { return wtree_ != nullptr ? wtree_[1] > 0.0f : size_ > 0; }

  // n draws at once: the tree descents advance level by level over all of
  // them, prefetching the next level's nodes, so their cache misses overlap
  // (one descent is a chain of ~log2(C) dependent loads from a tree larger
  // than the caches). Each step is branch-free: its direction is a coin flip
  // the branch predictor would miss half the time, ~20 times per draw.
  void DrawMany(int64_t n, int32_t* out) {
    if (wtree_ == nullptr && (ring_ || size_ <= 0)) {
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(Draw());
      return;
    }
    std::vector<int64_t> node(n, 1);
    if (wtree_ != nullptr) {
      const float total = wtree_[1];
      if (!(total > 0.0f)) {
        for (int64_t i = 0; i < n; ++i) out[i] = -1;
        return;
      }
      std::vector<float> target(n);
      for (int64_t i = 0; i < n; ++i) target[i] = Uniform24() * total;
      for (int64_t level = 1; level < p_; level <<= 1) {
        for (int64_t i = 0; i < n; ++i) __builtin_prefetch(wtree_ + 2 * node[i]);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t left = 2 * node[i];
          const float lsum = wtree_[left], rsum = wtree_[left + 1];
          // As DrawWeighted: right when past the left sum (and the right
          // subtree has weight) or when the left subtree has none.
          const uint32_t right = (static_cast<uint32_t>(target[i] >= lsum) &
                                  static_cast<uint32_t>(rsum > 0.0f)) |
                                 static_cast<uint32_t>(lsum <= 0.0f);
          target[i] -= Select(right, lsum);
          node[i] = left + right;
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        out[i] = wtree_[node[i]] > 0.0f ? static_cast<int32_t>(node[i] - p_) : -1;
      }
      return;
    }
    std::vector<int64_t> k(n);
    for (int64_t i = 0; i < n; ++i) k[i] = rng_->Below(size_);
    for (int64_t level = 1; level < p_; level <<= 1) {
      for (int64_t i = 0; i < n; ++i) __builtin_prefetch(tree_ + 2 * node[i]);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t left = 2 * node[i];
        const int64_t lcount = tree_[left];
        const int64_t right = k[i] >= lcount;
        k[i] -= lcount & -right;
        node[i] = left + right;
      }
    }
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(node[i] - p_);
  }

  int64_t Draw() {
    if (wtree_ != nullptr) return DrawWeighted();
    if (size_ <= 0) return -1;
    if (ring_) return (start_ + rng_->Below(filled_)) % c_;
    int64_t k = rng_->Below(size_);
    int64_t node = 1;
    while (node < p_) {
      const int64_t left = tree_[2 * node];
      if (k < left) {
        node = 2 * node;
      } else {
        k -= left;
        node = 2 * node + 1;
      }
    }
    return node - p_;
  }

 private:
  int64_t DrawWeighted() {
    const float total = wtree_[1];
    if (!(total > 0.0f)) return -1;
    float target = Uniform24() * total;
    int64_t node = 1;
    while (node < p_) {
      const int64_t left = 2 * node;
      const float lsum = wtree_[left], rsum = wtree_[left + 1];
      // A child whose subtree sums to zero is never entered (float rounding
      // can push the target past the last positive leaf).
      const bool right = (target >= lsum && rsum > 0.0f) || lsum <= 0.0f;
      if (right) target -= lsum;
      node = left + (right ? 1 : 0);
    }
    return wtree_[node] > 0.0f ? node - p_ : -1;
  }

  // x when bit is 1, else +0.0f, without a branch (x - 0.0f is x exactly).
  static float Select(uint32_t bit, float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    bits &= 0u - bit;
    std::memcpy(&x, &bits, sizeof bits);
    return x;
  }

  // u in [0, 1) with 24 random bits, as a float32 uniform.
  float Uniform24() { return static_cast<float>(rng_->Next64() >> 40) * (1.0f / 16777216.0f); }

  Threefry* rng_;
  const int32_t* tree_;
  const float* wtree_;
  int64_t p_, c_, size_, start_, filled_;
  bool ring_;
};

// Weighted sampling without replacement of up to ``k`` of ``items`` (weights
// ``w`` > 0): Efraimidis-Spirakis keys u**(1/w), the k largest, in decreasing
// key order. This is successive sampling, the distribution of repeated draws
// with repeats discarded. (Uniform weights: a uniform random ordering.)
std::vector<int32_t> WeightedWithoutReplacement(Threefry& rng, const std::vector<int32_t>& items,
                                                const std::vector<float>& w, int64_t k) {
  std::vector<std::pair<double, int32_t>> keyed(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    // log(u) / w: the log of the key, monotone in it; u in (0, 1].
    const double u = (static_cast<double>(rng.Next64() >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    keyed[i] = {std::log(u) / static_cast<double>(w[i]), items[i]};
  }
  k = std::min<int64_t>(k, static_cast<int64_t>(keyed.size()));
  std::partial_sort(keyed.begin(), keyed.begin() + k, keyed.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<int32_t> out(k);
  for (int64_t i = 0; i < k; ++i) out[i] = keyed[i].second;
  return out;
}

// memcpy of one row; the common scalar sizes inline as one load and store
// instead of a library call each.
inline void CopyRow(char* dst, const char* src, size_t n) {
  switch (n) {
    case 4: std::memcpy(dst, src, 4); break;
    case 8: std::memcpy(dst, src, 8); break;
    case 1: *dst = *src; break;
    case 2: std::memcpy(dst, src, 2); break;
    default: std::memcpy(dst, src, n);
  }
}

// Prefetch distances (candidates, rows): far enough ahead to keep many cache
// misses in flight, near enough that the lines are still cached when used (a
// whole large batch's rows would not fit in L2).
constexpr size_t kMetaAhead = 64;
constexpr int64_t kRowsAhead = 32;

ffi::Error SampleImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t batch_size,
                      int64_t capacity, bool replace, int64_t max_times_sampled,
                      bool has_version, bool has_where, bool ring,
                      ffi::Span<const int64_t> packed, ffi::Span<const int64_t> ledger_layout) {
  const int64_t b = batch_size;
  const int64_t c = capacity;
  const size_t n_data = args.size() - kData;
  const size_t n_state = kData - kFirstState + n_data;

  auto key_buf = args.get<ffi::AnyBuffer>(kKey).value();
  const uint32_t* kw = static_cast<const uint32_t*>(key_buf.untyped_data());
  const size_t nk = key_buf.element_count();
  // Keys of more than two words (e.g. rbg) are folded in; the constant
  // separates this stream from jax.random's own uses of the same key.
  uint32_t k0 = nk > 0 ? kw[0] : 0, k1 = nk > 1 ? kw[1] : 0;
  for (size_t i = 2; i < nk; ++i) {
    (i % 2 ? k1 : k0) ^= Rotl(kw[i], static_cast<int>((7 * i) % 31) + 1);
  }
  k0 ^= 0x66726570u;  // "frep"
  Threefry rng(k0, k1);

  const int32_t* params = Ptr<int32_t>(args, kParams);
  const int32_t ver = params[0], thresh = params[1];
  const int64_t num_eligible = params[2];
  const bool enabled = params[3] != 0;  // false: sample nothing, change nothing
  const float total = *Ptr<float>(args, kTotal);
  const bool* where = has_where ? Ptr<bool>(args, kWhere) : nullptr;

  // State results alias their operands: write through the results.
  bool* occupied = Ptr<bool>(rets, kOccupied - kFirstState);
  const uint32_t* keys = Ptr<uint32_t>(rets, kKeys - kFirstState);
  const int32_t* version = Ptr<int32_t>(rets, kVersion - kFirstState);
  int32_t* times = Ptr<int32_t>(rets, kTimes - kFirstState);
  const float* priority = Ptr<float>(rets, kPriority - kFirstState);
  auto tree_buf = rets.get<ffi::AnyBuffer>(kOccTree - kFirstState).value();
  int32_t* tree = static_cast<int32_t*>(tree_buf->untyped_data());
  const int64_t p = static_cast<int64_t>(tree_buf->element_count()) / 2;
  auto wt_buf = rets.get<ffi::AnyBuffer>(kWeightTree - kFirstState).value();
  float* wtree = wt_buf->element_count() > 0 ? static_cast<float*>(wt_buf->untyped_data())
                                             : nullptr;
  Ledger ledger;
  if (!OpenLedger(rets, kLedger - kFirstState, ledger_layout, &ledger)) {
    return LedgerMismatch("funcreplay_sample");
  }
  const int32_t write_pos = ledger.GetInt(kLWritePos);
  const uint32_t* inserts = ledger.Word(kLInserts);

  // Outputs after the state: the rows and info columns as separate arrays, or
  // (``packed`` = byte offsets of the n_data leaves, valid, the six info
  // columns, num_eligible, then the total size) all in one uint8 buffer
  // (funcreplay/packing.py's layout). packed = [-1]: separate arrays.
  const bool is_packed = !(packed.size() == 1 && packed[0] == -1);
  if (is_packed) {  // the layout comes from funcreplay/packing.py; check it anyway
    bool ok = packed.size() == n_data + 9;
    for (size_t j = 1; ok && j < packed.size(); ++j) ok = packed[j] >= packed[j - 1];
    auto buf = rets.get<ffi::AnyBuffer>(n_state);
    ok = ok && packed[0] >= 0 && buf.has_value() &&
         packed[n_data + 8] == static_cast<int64_t>((*buf)->size_bytes());
    if (!ok) {
      return ffi::Error::InvalidArgument(
          "funcreplay_sample: the packed layout does not match the operands (expected "
          "n_data + 9 increasing byte offsets ending with the output's size)");
    }
  }
  size_t o = n_state;
  std::vector<const char*> src(n_data);
  for (size_t d = 0; d < n_data; ++d) src[d] = Ptr<const char>(rets, kData - kFirstState + d);
  std::vector<char*> rows(n_data);
  std::vector<size_t> row_bytes(n_data);
  for (size_t d = 0; d < n_data; ++d) {
    auto leaf = rets.get<ffi::AnyBuffer>(kData - kFirstState + d).value();
    row_bytes[d] = c > 0 ? leaf->size_bytes() / c : 0;
  }
  std::vector<char*> columns(8);  // valid, slot, key, prob, prio, times, version, num_eligible
  if (is_packed) {
    auto buf = rets.get<ffi::AnyBuffer>(o++).value();
    char* base = static_cast<char*>(buf->untyped_data());
    // Zero the alignment gaps (the buffer comes uninitialised); fields are
    // written below. Sizes: rows * row bytes, B * 4 (valid: B), 4.
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (size_t d = 0; d < n_data; ++d) {
      rows[d] = base + packed[d];
      spans.emplace_back(packed[d], packed[d] + static_cast<int64_t>(b * row_bytes[d]));
    }
    for (size_t j = 0; j < 8; ++j) {
      columns[j] = base + packed[n_data + j];
      const int64_t size = j == 0 ? b : (j == 7 ? 4 : 4 * b);
      spans.emplace_back(packed[n_data + j], packed[n_data + j] + size);
    }
    int64_t end = 0;
    for (const auto& [lo, hi] : spans) {  // fields are laid out in order
      if (lo > end) std::memset(base + end, 0, static_cast<size_t>(lo - end));
      end = hi;
    }
    const int64_t total = packed[n_data + 8];
    if (total > end) std::memset(base + end, 0, static_cast<size_t>(total - end));
  } else {
    for (size_t d = 0; d < n_data; ++d) {
      rows[d] = static_cast<char*>(rets.get<ffi::AnyBuffer>(o++).value()->untyped_data());
    }
    for (size_t j = 0; j < 7; ++j) {
      columns[j] = static_cast<char*>(rets.get<ffi::AnyBuffer>(o++).value()->untyped_data());
    }
  }
  bool* out_valid = reinterpret_cast<bool*>(columns[0]);
  int32_t* out_slot = reinterpret_cast<int32_t*>(columns[1]);
  uint32_t* out_key = reinterpret_cast<uint32_t*>(columns[2]);
  float* out_prob = reinterpret_cast<float*>(columns[3]);
  float* out_prio = reinterpret_cast<float*>(columns[4]);
  int32_t* out_times = reinterpret_cast<int32_t*>(columns[5]);
  int32_t* out_version = reinterpret_cast<int32_t*>(columns[6]);
  if (is_packed) std::memcpy(columns[7], &params[2], sizeof(int32_t));
  int32_t* out_n = Ptr<int32_t>(rets, o++);
  // num_eligible goes back out through the kernel: the caller computed it
  // from reads of the count tree, and returning those reads directly would
  // leave them unordered with this in-place update (XLA would copy the tree).
  *Ptr<int32_t>(rets, o++) = params[2];
  {
    // The next key of a key sequence (sampling.sample(split_key=True)): the
    // same PRF at counters the draws below never reach, as a split would.
    auto next_buf = rets.get<ffi::AnyBuffer>(o++).value();
    uint32_t* next = static_cast<uint32_t*>(next_buf->untyped_data());
    // A disabled call keeps the key (it sampled nothing).
    Threefry derive(k0, k1);
    derive.Seek(uint64_t{1} << 63);
    for (size_t i = 0; i < next_buf->element_count(); i += 2) {
      const uint64_t v = derive.Next64();
      next[i] = enabled ? static_cast<uint32_t>(v >> 32) : kw[i];
      if (i + 1 < next_buf->element_count()) {
        next[i + 1] = enabled ? static_cast<uint32_t>(v) : kw[i + 1];
      }
    }
  }

  auto eligible = [&](int64_t s) {
    return occupied[s] && version[s] >= thresh && (where == nullptr || where[s]);
  };
  auto weight = [&](int64_t s) { return wtree != nullptr ? wtree[p + s] : 1.0f; };

  const int64_t size = tree[1];
  const int64_t filled = inserts[0] > 0 ? c : std::min<int64_t>(inserts[1], c);
  const int64_t start = ((write_pos - filled) % c + c) % c;
  Drawer drawer(&rng, tree, wtree, p, c, size, start, filled, ring && size == filled);

  std::vector<int32_t> picked;
  picked.reserve(b);
  if (enabled && num_eligible > 0 && size > 0) {
    const int64_t want = replace ? b : std::min<int64_t>(b, num_eligible);
    // Rejection (i.i.d. draws by weight, keeping eligible slots not taken yet)
    // is exactly successive sampling; it is fast while eligible items hold a
    // fair share of the weight and the batch is not most of them. Otherwise
    // (or when a draw budget runs out) the rest comes from the enumerated
    // remaining eligible slots, with the same distribution.
    const float all_weight = wtree != nullptr ? wtree[1] : static_cast<float>(size);
    const float eligible_weight = wtree != nullptr ? total : static_cast<float>(num_eligible);
    const bool heavy = eligible_weight * 8.0f < all_weight ||
                       (!replace && want * 2 > num_eligible);
    int64_t budget = heavy ? 0 : 32 * b + 256;
    SlotSet seen(replace ? 1 : want);
    // Draw the first candidates up front and prefetch their eligibility
    // fields a window ahead: the columns are far larger than the caches, so
    // each candidate costs a few cache misses, which then overlap instead of
    // running one after another. (The rows are prefetched while copying.)
    std::vector<int32_t> first;
    auto prefetch_meta = [&](size_t i) {
      if (i >= first.size() || first[i] < 0) return;
      const int32_t s = first[i];
      __builtin_prefetch(occupied + s);
      __builtin_prefetch(version + s);
      __builtin_prefetch(times + s);
      if (where != nullptr) __builtin_prefetch(where + s);
    };
    if (budget > 0) {
      first.resize(static_cast<size_t>(want + want / 8 + 8));
      drawer.DrawMany(static_cast<int64_t>(first.size()), first.data());
      for (size_t i = 0; i < kMetaAhead; ++i) prefetch_meta(i);
    }
    size_t next = 0;
    while (static_cast<int64_t>(picked.size()) < want && budget-- > 0) {
      prefetch_meta(next + kMetaAhead);
      const int64_t s = next < first.size() ? first[next++] : drawer.Draw();
      if (s < 0) {
        if (drawer.HasWeight()) continue;  // a float rounding miss: draw again
        break;                             // no weight left
      }
      if (!eligible(s)) continue;
      if (!replace && !seen.Insert(static_cast<int32_t>(s))) continue;
      picked.push_back(static_cast<int32_t>(s));
    }
    if (static_cast<int64_t>(picked.size()) < want) {
      std::vector<int32_t> rest;
      std::vector<float> rest_w;
      for (int64_t s = 0; s < c; ++s) {
        if (!eligible(s) || !(weight(s) > 0.0f)) continue;
        if (!replace && seen.Contains(static_cast<int32_t>(s))) continue;
        rest.push_back(static_cast<int32_t>(s));
        rest_w.push_back(weight(s));
      }
      const int64_t need = want - static_cast<int64_t>(picked.size());
      if (!rest.empty() && replace) {
        // i.i.d. draws by weight: inverse CDF over the enumerated weights.
        std::vector<double> cum(rest.size());
        double acc = 0.0;
        for (size_t i = 0; i < rest.size(); ++i) cum[i] = acc += rest_w[i];
        for (int64_t i = 0; i < need; ++i) {
          const double u = static_cast<double>(rng.Next64() >> 11) * (acc / 9007199254740992.0);
          size_t j = std::upper_bound(cum.begin(), cum.end(), u) - cum.begin();
          picked.push_back(rest[std::min(j, rest.size() - 1)]);
        }
      } else if (!rest.empty()) {
        for (int32_t s : WeightedWithoutReplacement(rng, rest, rest_w, need)) picked.push_back(s);
      }
    }
  }
  const int64_t n = static_cast<int64_t>(picked.size());

  for (int64_t i = 0; i < n; ++i) ++times[picked[i]];

  const float uniform_prob = 1.0f / static_cast<float>(std::max<int64_t>(num_eligible, 1));
  uint64_t stale_sum = 0;
  auto prefetch_row = [&](int64_t i) {
    if (i >= n) return;
    const int32_t s = picked[i];
    // The info columns read below (version and times were prefetched with
    // the candidates, the weight-tree leaf by the descent).
    __builtin_prefetch(keys + s);
    __builtin_prefetch(priority + s);
    for (size_t d = 0; d < n_data; ++d) {
      const char* row = src[d] + s * row_bytes[d];
      for (size_t at = 0; at < row_bytes[d]; at += 64) __builtin_prefetch(row + at);
    }
  };
  // At most ~256 KB of rows in flight, whatever the item size.
  size_t item_bytes = 0;
  for (size_t d = 0; d < n_data; ++d) item_bytes += row_bytes[d];
  const int64_t ahead = std::clamp<int64_t>(
      static_cast<int64_t>((256 << 10) / std::max<size_t>(item_bytes, 1)), 1, kRowsAhead);
  for (int64_t i = 0; i < ahead; ++i) prefetch_row(i);
  for (int64_t i = 0; i < b; ++i) {
    if (i < n) {
      prefetch_row(i + ahead);
      const int32_t s = picked[i];
      out_valid[i] = true;
      out_slot[i] = s;
      out_key[i] = keys[s];
      out_prob[i] = wtree != nullptr ? wtree[p + s] / std::max(total, 1e-30f) : uniform_prob;
      out_prio[i] = priority[s];
      out_times[i] = times[s];
      out_version[i] = version[s];
      for (size_t d = 0; d < n_data; ++d) {
        CopyRow(rows[d] + i * row_bytes[d], src[d] + s * row_bytes[d], row_bytes[d]);
      }
      if (has_version) {
        // int32 arithmetic with wrap-around, as the portable path computes it.
        stale_sum += static_cast<uint64_t>(std::max<int32_t>(Sub(ver, version[s]), 0));
      }
    } else {
      out_valid[i] = false;
      out_slot[i] = -1;
      out_key[i] = 0;
      out_prob[i] = 0.0f;
      out_prio[i] = 0.0f;
      out_times[i] = 0;
      out_version[i] = 0;
      for (size_t d = 0; d < n_data; ++d) std::memset(rows[d] + i * row_bytes[d], 0, row_bytes[d]);
    }
  }
  *out_n = static_cast<int32_t>(n);
  ledger.Count(kLSamples, static_cast<uint64_t>(n));
  if (has_version) ledger.Count(kLStaleSum, stale_sum);
  ledger.UpdateLimiter(0, n);

  if (max_times_sampled > 0 && enabled) {  // disabled: the state stays untouched
    // Free items that reached max_times_sampled, once per slot (with
    // replacement a slot may repeat: its last row reports it).
    uint64_t n_freed = 0, reuse_sum = 0;
    std::vector<uint8_t> exhausted(b, 0);
    std::vector<int64_t> freed;  // weight-tree leaves set to 0
    SlotSet done(replace ? n : 1);
    for (int64_t i = n - 1; i >= 0; --i) {
      const int32_t s = picked[i];
      if (times[s] < max_times_sampled) continue;
      if (replace && !done.Insert(s)) continue;
      exhausted[i] = 1;
      occupied[s] = false;
      for (int64_t node = p + s; node >= 1; node >>= 1) --tree[node];
      if (wtree != nullptr) {
        wtree[p + s] = 0.0f;
        freed.push_back(p + s);
      }
      ++n_freed;
      reuse_sum += static_cast<uint64_t>(static_cast<uint32_t>(times[s]));
    }
    if (wtree != nullptr) RecomputeSumMany(wtree, std::move(freed));
    ledger.Count(kLEvictedReuse, n_freed);
    ledger.Count(kLRemovedReuse, reuse_sum);
    VersionIndex index = OpenIndex(rets, kHist - kFirstState, kBounds - kFirstState);
    index.Shift(out_version, exhausted.data(), b, -1);
  }
  return ffi::Error::Success();
}

// Operand layout of FifoInsert. Rows (B = batch), then the state, aliased:
//   mask bool[B], version int32[B], priority float32[B], weight float32[B]
//   (priority**alpha for a prioritized sampler, else float32[0]),
//   n_meta metadata rows int32[B], n_data item leaves [B, ...];
//   n_bad uint32[] (invalid priorities among the rows, counted here);
//   state: occupied, key, version, times_sampled, priority, occ_tree,
//   weight_tree (float32[0] unless prioritized), ledger, version_hist,
//   version_bounds, n_meta metadata columns, n_data data leaves.
// Besides the rows, the kernel keeps the ledger as ops.insert does: ring
// position, next key, counters, max_priority and the rate limiter's diff.
enum InsertState : size_t {
  kIOccupied = 0, kIKeys, kIVersion, kITimes, kIPriority, kIOccTree, kIWeightTree,
  kILedger, kIHist, kIBounds, kIFixed,
};


ffi::Error FifoInsertImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t capacity,
                          int64_t n_meta, int64_t n_data,
                          ffi::Span<const int64_t> ledger_layout) {
  const int64_t c = capacity;
  const bool* mask = Ptr<bool>(args, 0);
  auto ver_buf = args.get<ffi::AnyBuffer>(1).value();
  const int64_t b = static_cast<int64_t>(ver_buf.element_count());
  const int32_t* in_version = static_cast<const int32_t*>(ver_buf.untyped_data());
  const float* in_priority = Ptr<float>(args, 2);
  auto w_buf = args.get<ffi::AnyBuffer>(3).value();
  const float* in_weight =
      w_buf.element_count() > 0 ? static_cast<const float*>(w_buf.untyped_data()) : nullptr;
  const uint32_t n_bad = *Ptr<uint32_t>(args, 4);
  std::vector<const int32_t*> in_meta(n_meta);
  for (int64_t m = 0; m < n_meta; ++m) in_meta[m] = Ptr<int32_t>(args, 5 + m);
  std::vector<const char*> in_data(n_data);
  for (int64_t d = 0; d < n_data; ++d) in_data[d] = Ptr<const char>(args, 5 + n_meta + d);

  bool* occupied = Ptr<bool>(rets, kIOccupied);
  uint32_t* keys = Ptr<uint32_t>(rets, kIKeys);
  int32_t* version = Ptr<int32_t>(rets, kIVersion);
  int32_t* times = Ptr<int32_t>(rets, kITimes);
  float* priority = Ptr<float>(rets, kIPriority);
  auto tree_buf = rets.get<ffi::AnyBuffer>(kIOccTree).value();
  int32_t* tree = static_cast<int32_t*>(tree_buf->untyped_data());
  const int64_t p = static_cast<int64_t>(tree_buf->element_count()) / 2;
  auto wt_buf = rets.get<ffi::AnyBuffer>(kIWeightTree).value();
  float* wtree = wt_buf->element_count() > 0 ? static_cast<float*>(wt_buf->untyped_data())
                                             : nullptr;
  Ledger ledger;
  if (!OpenLedger(rets, kILedger, ledger_layout, &ledger)) {
    return LedgerMismatch("funcreplay_fifo_insert");
  }
  std::vector<int32_t*> meta(n_meta);
  for (int64_t m = 0; m < n_meta; ++m) meta[m] = Ptr<int32_t>(rets, kIFixed + m);
  std::vector<char*> data(n_data);
  std::vector<size_t> row_bytes(n_data);
  for (int64_t d = 0; d < n_data; ++d) {
    auto r = rets.get<ffi::AnyBuffer>(kIFixed + n_meta + d).value();
    data[d] = static_cast<char*>(r->untyped_data());
    row_bytes[d] = r->size_bytes() / c;
  }
  VersionIndex index = OpenIndex(rets, kIHist, kIBounds);
  index.Advance(in_version, mask, b);
  std::vector<uint8_t> victim(b, 0);
  std::vector<int32_t> victim_version(b, 0);
  std::vector<int32_t> slot_of(b, -1);
  std::vector<int64_t> changed;  // weight-tree leaves written

  // Rows go in one at a time, in order, at the ring position: the oldest
  // written slot, overwritten whether it holds an item or a hole.
  int64_t pos = ledger.GetInt(kLWritePos);
  uint32_t key = *ledger.Word(kLNextKey);
  uint64_t n_real = 0, n_victims = 0, reuse_sum = 0;
  float largest = 0.0f;  // max over the real rows' priorities (as jnp.max(where(mask, p, 0)))
  for (int64_t i = 0; i < b; ++i) {
    if (!mask[i]) continue;
    const int64_t s = pos;
    slot_of[i] = static_cast<int32_t>(s);
    pos = pos + 1 == c ? 0 : pos + 1;
    if (occupied[s]) {
      victim[i] = 1;
      victim_version[i] = version[s];
      ++n_victims;
      reuse_sum += static_cast<uint64_t>(static_cast<uint32_t>(times[s]));
    } else {
      occupied[s] = true;
      for (int64_t node = p + s; node >= 1; node >>= 1) ++tree[node];
    }
    keys[s] = key++;
    version[s] = in_version[i];
    times[s] = 0;
    priority[s] = in_priority[i];
    largest = std::max(largest, in_priority[i]);
    for (int64_t m = 0; m < n_meta; ++m) meta[m][s] = in_meta[m][i];
    if (wtree != nullptr) {
      wtree[p + s] = in_weight[i];
      changed.push_back(p + s);
    }
    ++n_real;
  }
  if (wtree != nullptr) RecomputeSumMany(wtree, std::move(changed));
  // Item rows, one memcpy per leaf for each run of consecutive slots.
  for (int64_t i = 0; i < b;) {
    if (slot_of[i] < 0) {
      ++i;
      continue;
    }
    int64_t j = i + 1;
    while (j < b && slot_of[j] == slot_of[j - 1] + 1) ++j;
    const int64_t s = slot_of[i];
    for (int64_t d = 0; d < n_data; ++d) {
      std::memcpy(data[d] + s * row_bytes[d], in_data[d] + i * row_bytes[d],
                  (j - i) * row_bytes[d]);
    }
    i = j;
  }
  // As the portable path: remove the overwritten items, then add the new ones.
  index.Shift(victim_version.data(), victim.data(), b, -1);
  index.Shift(in_version, mask, b, 1);
  ledger.SetInt(kLWritePos, static_cast<int32_t>(pos));
  *ledger.Word(kLNextKey) = key;
  ledger.Count(kLInserts, n_real);
  ledger.Count(kLEvictedCapacity, n_victims);
  ledger.Count(kLRemovedReuse, reuse_sum);
  ledger.Count(kLInvalidPriorities, n_bad);
  ledger.SetFloat(kLMaxPriority, std::max(ledger.GetFloat(kLMaxPriority), largest));
  ledger.UpdateLimiter(static_cast<int64_t>(n_real), 0);
  return ffi::Error::Success();
}

// UpdatePriorities: operands slots int32[K], keys uint32[K], priorities
// float32[K] (as given), weights float32[K] (priority**alpha of the sanitized
// priorities, prioritized sampler) or float32[0]; then the state, aliased:
// occupied, key, priority, weight_tree, ledger (max_priority and the
// invalid_priorities counter).
// Applied only where the slot still holds the key; the last row for a slot
// wins; negative / NaN / inf priorities are stored as 0 and counted (among
// the winning rows), as ops.update_priorities.
ffi::Error UpdatePrioritiesImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                int64_t capacity, ffi::Span<const int64_t> ledger_layout) {
  auto slots_buf = args.get<ffi::AnyBuffer>(0).value();
  const int64_t k = static_cast<int64_t>(slots_buf.element_count());
  const int32_t* slots = static_cast<const int32_t*>(slots_buf.untyped_data());
  const uint32_t* want_keys = Ptr<uint32_t>(args, 1);
  const float* prios = Ptr<float>(args, 2);
  auto w_buf = args.get<ffi::AnyBuffer>(3).value();
  const float* weights =
      w_buf.element_count() > 0 ? static_cast<const float*>(w_buf.untyped_data()) : nullptr;
  const bool* occupied = Ptr<bool>(rets, 0);
  const uint32_t* keys = Ptr<uint32_t>(rets, 1);
  float* priority = Ptr<float>(rets, 2);
  auto wt_buf = rets.get<ffi::AnyBuffer>(3).value();
  float* wtree = wt_buf->element_count() > 0 ? static_cast<float*>(wt_buf->untyped_data())
                                             : nullptr;
  const int64_t p = static_cast<int64_t>(wt_buf->element_count()) / 2;
  Ledger ledger;
  if (!OpenLedger(rets, 4, ledger_layout, &ledger)) {
    return LedgerMismatch("funcreplay_update_priorities");
  }

  SlotSet done(k);
  std::vector<int64_t> changed;
  float largest = 0.0f;
  uint64_t n_bad = 0;
  for (int64_t i = k - 1; i >= 0; --i) {  // backwards: the first hit is the last write
    const int32_t s = slots[i];
    if (s < 0 || s >= capacity || !occupied[s] || keys[s] != want_keys[i]) continue;
    if (!done.Insert(s)) continue;
    const bool bad = !std::isfinite(prios[i]) || prios[i] < 0.0f;
    const float clean = bad ? 0.0f : prios[i];
    n_bad += bad ? 1 : 0;
    priority[s] = clean;
    largest = std::max(largest, clean);
    if (wtree != nullptr) {
      wtree[p + s] = weights[i];
      changed.push_back(p + s);
    }
  }
  if (wtree != nullptr) RecomputeSumMany(wtree, std::move(changed));
  ledger.SetFloat(kLMaxPriority, std::max(ledger.GetFloat(kLMaxPriority), largest));
  ledger.Count(kLInvalidPriorities, n_bad);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FuncreplaySample, SampleImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("batch_size")
                                  .Attr<int64_t>("capacity")
                                  .Attr<bool>("replace")
                                  .Attr<int64_t>("max_times_sampled")
                                  .Attr<bool>("has_version")
                                  .Attr<bool>("has_where")
                                  .Attr<bool>("ring")
                                  .Attr<ffi::Span<const int64_t>>("packed")
                                  .Attr<ffi::Span<const int64_t>>("ledger"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FuncreplayFifoInsert, FifoInsertImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("n_meta")
                                  .Attr<int64_t>("n_data")
                                  .Attr<ffi::Span<const int64_t>>("ledger"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FuncreplayUpdatePriorities, UpdatePrioritiesImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("capacity")
                                  .Attr<ffi::Span<const int64_t>>("ledger"));
