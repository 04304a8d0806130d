// The sampling kernel of funcreplay's native code, over raw pointers: the
// jitted path (kernels.cc, an XLA FFI custom call) and the direct host path
// (direct.cc, called from Python on a host Table's own CPU buffers) both
// bind their buffers into a ``SampleJob`` and run ``RunSample``, so the two
// draw the same items from the same key and update the state identically.
// Semantics: funcreplay/sampling.py (the portable implementation).
#ifndef FUNCREPLAY_NATIVE_SAMPLE_CORE_H_
#define FUNCREPLAY_NATIVE_SAMPLE_CORE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"

namespace funcreplay {

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
inline std::vector<int32_t> WeightedWithoutReplacement(Threefry& rng, const std::vector<int32_t>& items,
                                                       const std::vector<float>& w,
                                                       int64_t k) {
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

// The two threefry key words of a key's data: keys of more than two words
// (e.g. rbg) are folded in; the constant separates this stream from
// jax.random's own uses of the same key.
inline void FoldKey(const uint32_t* kw, size_t nk, uint32_t* k0_out, uint32_t* k1_out) {
  uint32_t k0 = nk > 0 ? kw[0] : 0, k1 = nk > 1 ? kw[1] : 0;
  for (size_t i = 2; i < nk; ++i) {
    (i % 2 ? k1 : k0) ^= Rotl(kw[i], static_cast<int>((7 * i) % 31) + 1);
  }
  *k0_out = k0 ^ 0x66726570u;  // "frep"
  *k1_out = k1;
}

// The next key of a key sequence (sampling.sample(split_key=True)): the same
// PRF at counters the draws never reach, as a split would. A disabled call
// keeps the key (it sampled nothing). ``next`` may alias ``kw``.
inline void NextKey(uint32_t k0, uint32_t k1, bool enabled, const uint32_t* kw, uint32_t* next,
                    size_t n) {
  if (!enabled) {
    if (next != kw) std::memmove(next, kw, n * sizeof(uint32_t));
    return;
  }
  Threefry derive(k0, k1);
  derive.Seek(uint64_t{1} << 63);
  for (size_t i = 0; i < n; i += 2) {
    const uint64_t v = derive.Next64();
    next[i] = static_cast<uint32_t>(v >> 32);
    if (i + 1 < n) next[i + 1] = static_cast<uint32_t>(v);
  }
}

// Points ``rows`` (one per data leaf) and ``columns`` (valid, slot, key,
// probability, priority, times_sampled, version, num_eligible) into a packed
// buffer of ``nbytes`` at the byte offsets ``packed`` (n_data + 9 of them:
// the leaves, the 8 columns, then the total size; funcreplay/packing.py's
// layout) and zeroes the alignment gaps (the buffer may come uninitialised).
// False if the offsets do not describe such a buffer.
inline bool BindPacked(char* base, int64_t nbytes, const int64_t* packed, size_t n_packed,
                       int64_t b, const std::vector<size_t>& row_bytes,
                       std::vector<char*>* rows, char* columns[8]) {
  const size_t n_data = row_bytes.size();
  bool ok = n_packed == n_data + 9 && packed[0] >= 0 && packed[n_data + 8] == nbytes;
  for (size_t j = 1; ok && j < n_packed; ++j) ok = packed[j] >= packed[j - 1];
  if (!ok) return false;
  std::vector<std::pair<int64_t, int64_t>> spans;
  rows->resize(n_data);
  for (size_t d = 0; d < n_data; ++d) {
    (*rows)[d] = base + packed[d];
    spans.emplace_back(packed[d], packed[d] + static_cast<int64_t>(b * row_bytes[d]));
  }
  for (size_t j = 0; j < 8; ++j) {  // sizes: B (valid), 4 * B, and 4 (num_eligible)
    columns[j] = base + packed[n_data + j];
    const int64_t size = j == 0 ? b : (j == 7 ? 4 : 4 * b);
    spans.emplace_back(packed[n_data + j], packed[n_data + j] + size);
  }
  int64_t end = 0;
  for (const auto& [lo, hi] : spans) {  // fields are laid out in order
    if (lo > end) std::memset(base + end, 0, static_cast<size_t>(lo - end));
    end = std::max(end, hi);
  }
  if (nbytes > end) std::memset(base + end, 0, static_cast<size_t>(nbytes - end));
  return end <= nbytes;
}

// One sample call: everything but the buffers' origin.
struct SampleJob {
  // Static configuration.
  int64_t batch = 0, capacity = 0, max_times_sampled = 0;
  bool replace = false, has_version = false, ring = false;
  // This call: the folded key, [version, staleness threshold], the eligible
  // count and weight (computed by the caller), whether to sample at all.
  uint32_t k0 = 0, k1 = 0;
  int32_t version = 0, threshold = 0;
  int64_t num_eligible = 0;
  bool enabled = true;
  float total = 0.0f;
  const bool* where = nullptr;  // bool[C] or null
  // The state, updated in place.
  bool* occupied = nullptr;
  const uint32_t* keys = nullptr;
  const int32_t* versions = nullptr;
  int32_t* times = nullptr;
  const float* priority = nullptr;
  int32_t* tree = nullptr;    // int32[2P] count tree
  int64_t p = 0;
  float* wtree = nullptr;     // float32[2P] weight tree, or null (uniform)
  Ledger ledger;
  VersionIndex index;
  std::vector<const char*> src;    // data leaves [C, ...]
  std::vector<size_t> row_bytes;   // bytes per row of each
  // Outputs: B rows per data leaf, and the seven info columns [B].
  std::vector<char*> rows;
  bool* out_valid = nullptr;
  int32_t* out_slot = nullptr;
  uint32_t* out_key = nullptr;
  float* out_prob = nullptr;
  float* out_prio = nullptr;
  int32_t* out_times = nullptr;
  int32_t* out_version = nullptr;

  void BindColumns(char* const columns[8]) {
    out_valid = reinterpret_cast<bool*>(columns[0]);
    out_slot = reinterpret_cast<int32_t*>(columns[1]);
    out_key = reinterpret_cast<uint32_t*>(columns[2]);
    out_prob = reinterpret_cast<float*>(columns[3]);
    out_prio = reinterpret_cast<float*>(columns[4]);
    out_times = reinterpret_cast<int32_t*>(columns[5]);
    out_version = reinterpret_cast<int32_t*>(columns[6]);
  }
};

// Draws the batch, writes the rows and info columns, and updates the state
// (times sampled, counters, the rate limiter's diff, and the items freed on
// reaching max_times_sampled). Returns the number of valid rows.
inline int64_t RunSample(SampleJob& job) {
  const int64_t b = job.batch, c = job.capacity;
  const bool replace = job.replace, has_version = job.has_version, enabled = job.enabled;
  const bool ring = job.ring;
  const int64_t max_times_sampled = job.max_times_sampled, num_eligible = job.num_eligible;
  const int32_t ver = job.version, thresh = job.threshold;
  const float total = job.total;
  const bool* where = job.where;
  bool* occupied = job.occupied;
  const uint32_t* keys = job.keys;
  const int32_t* version = job.versions;
  int32_t* times = job.times;
  const float* priority = job.priority;
  int32_t* tree = job.tree;
  const int64_t p = job.p;
  float* wtree = job.wtree;
  Ledger& ledger = job.ledger;
  const size_t n_data = job.src.size();
  const std::vector<const char*>& src = job.src;
  const std::vector<size_t>& row_bytes = job.row_bytes;
  const std::vector<char*>& rows = job.rows;
  bool* out_valid = job.out_valid;
  int32_t* out_slot = job.out_slot;
  uint32_t* out_key = job.out_key;
  float* out_prob = job.out_prob;
  float* out_prio = job.out_prio;
  int32_t* out_times = job.out_times;
  int32_t* out_version = job.out_version;
  Threefry rng(job.k0, job.k1);
  const int32_t write_pos = ledger.GetInt(kLWritePos);
  const uint32_t* inserts = ledger.Word(kLInserts);

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
    job.index.Shift(out_version, exhausted.data(), b, -1);
  }
  return n;
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_SAMPLE_CORE_H_
