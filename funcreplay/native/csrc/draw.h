// The draws of a sample: which slots, in which order, bit for bit the portable
// programs (funcreplay/core/sampling/uniform_lean.py, prioritized_lean.py,
// draw.py; BUILD.md "Bit recipe"). Each function names the Python it follows.
#ifndef FUNCREPLAY_NATIVE_DRAW_H_
#define FUNCREPLAY_NATIVE_DRAW_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "parallel.h"
#include "random.h"

namespace funcreplay {

// Rounds of candidate draws of the masked uniform program before its O(C)
// completion (draw.ROUNDS), and the candidates per round (draw.candidates_per_round).
constexpr int64_t kRounds = 4;
inline int64_t CandidatesPerRound(int64_t b) { return b + std::max<int64_t>(8, b / 2); }
// Rounds of the prioritized completion: each adds at least one item, so a
// batch never needs more than b; the bound only guards a malformed tree
// (draw.successive stops at the same count).
inline int64_t MaxCompletionRounds(int64_t b) { return b; }

// x when bit is 1, else +0.0f, without a branch (x - 0.0f is x exactly).
inline float Select(uint32_t bit, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits &= 0u - bit;
  std::memcpy(&x, &bits, sizeof bits);
  return x;
}

// weight_descent.redraw_depth: the depth at which a weight descent draws its target afresh,
// 4 * ((depth + 4) / 8), none below depth 8 (the module doc says why).
inline int64_t RedrawDepth(int64_t p) {
  int64_t depth = 0;
  while ((int64_t{1} << (depth + 1)) <= p) ++depth;
  return depth < 8 ? 0 : 4 * ((depth + 4) / 8);
}

// weight_descent.descend_weight for n targets at once: level by level over all of
// them, prefetching the next level, so the cache misses of the descents
// overlap; each step branch-free (its direction is a coin flip ~20 times per
// draw, which the branch predictor would miss half the time). At depth
// RedrawDepth(p) the target becomes fresh[i] * the reached node's sum.
inline void DescendWeight(const float* tree, int64_t p, float* target, const float* fresh,
                          int64_t n, int32_t* out) {
  std::vector<int64_t> node(n, 1);
  const int64_t redraw = RedrawDepth(p);
  int64_t depth = 0;
  for (int64_t level = 1; level < p; level <<= 1) {
    ++depth;
    for (int64_t i = 0; i < n; ++i) __builtin_prefetch(tree + 2 * node[i]);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t left = 2 * node[i];
      const float lsum = tree[left], rsum = tree[left + 1];
      // Right when past the left sum (and the right subtree has weight) or
      // when the left subtree has none.
      const uint32_t right = (static_cast<uint32_t>(target[i] >= lsum) &
                              static_cast<uint32_t>(rsum > 0.0f)) |
                             static_cast<uint32_t>(lsum <= 0.0f);
      target[i] -= Select(right, lsum);
      node[i] = left + right;
    }
    if (depth == redraw) {
      for (int64_t i = 0; i < n; ++i) target[i] = fresh[i] * tree[node[i]];
    }
  }
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(node[i] - p);
}

// Descents a chunk of DescendWeights holds at least: each chunk descends level by level
// over its own targets, so a chunk of 64 keeps 64 cache misses in flight a level.
constexpr int64_t kDescentsPerChunk = 64;

// DescendWeight in chunks on ``pool`` (parallel.h): each target's descent is its own, so
// the chunks give the same slots as one call.
inline void DescendWeights(const RowPool& pool, const float* tree, int64_t p, float* target,
                           const float* fresh, int64_t n, int32_t* out) {
  pool.For(n, kDescentsPerChunk, [&](int64_t lo, int64_t hi) {
    DescendWeight(tree, p, target + lo, fresh + lo, hi - lo, out + lo);
  });
}

// The descents of KthOccupied, level by level over the n ranks (their next level's nodes
// prefetched together, so the cache misses of a level overlap).
inline void DescendCounts(const int32_t* tree, int64_t p, const int64_t* k_in, int64_t n,
                          int32_t* out) {
  std::vector<int64_t> node(n, 1), k(k_in, k_in + n);
  for (int64_t level = 1; level < p; level <<= 1) {
    for (int64_t i = 0; i < n; ++i) __builtin_prefetch(tree + 2 * node[i]);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t left = 2 * node[i];
      const int64_t lcount = tree[left];
      const int64_t right = k[i] >= lcount;
      k[i] -= lcount & -right;
      node[i] = left + right;
    }
  }
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(node[i] - p);
}

// True when the occupied slots are exactly [0, tree[1]) (a table that is full, or a Fifo
// ring that has not wrapped or holes): then the k-th occupied slot is k itself, the same
// answer as the descent, at no cost. One descent decides it: the (size - 1)-th occupied
// slot is size - 1 only if every slot below it is occupied.
inline bool OccupiedIsPrefix(const int32_t* tree, int64_t p) {
  const int64_t size = tree[1];
  if (size <= 0) return true;
  if (size == p) return true;
  const int64_t last = size - 1;
  int32_t slot;
  DescendCounts(tree, p, &last, 1, &slot);
  return slot == last;
}

// uniform_lean.kth_occupied (= trees.descend_count(free=False)) for n ranks k < tree[1].
// ``pool``: the descents in chunks of kDescentsPerChunk on it (parallel.h; each rank's
// descent is its own, so the chunks give the slots one call gives). Only a table with
// holes descends (a full table or a ring without holes takes the prefix shortcut): 256
// descents of a 2**18-leaf tree cost the in-scan native step ~5 us on one thread (~11
// in the VM's slow spells), ~1-2 us less in chunks (BUILD.md finding 35).
inline void KthOccupied(const int32_t* tree, int64_t p, const int64_t* k_in, int64_t n,
                        int32_t* out, const RowPool& pool = kSerialRows) {
  if (n > 1 && OccupiedIsPrefix(tree, p)) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(k_in[i]);
    return;
  }
  pool.For(n, kDescentsPerChunk, [&](int64_t lo, int64_t hi) {
    DescendCounts(tree, p, k_in + lo, hi - lo, out + lo);
  });
}

// Adds delta to leaf P + s of an int32 count tree and all its ancestors.
inline void AddCount(int32_t* tree, int64_t p, int64_t s, int32_t delta) {
  for (int64_t node = p + s; node >= 1; node >>= 1) tree[node] += delta;
}

// uniform_lean.sample's draw: positions on stream 0 (without replacement: a
// partial Fisher-Yates; with: i.i.d.), each the k-th occupied slot, or with
// write_pos >= 0 (a table without holes) the x-th oldest, (write_pos - size + x)
// mod c (uniform_lean.ring_slot). Returns the number of valid rows (a prefix of picked).
// ``order``: the position index's order row (TableSpec.position_index: slot =
// order[x], uniform_lean.sample), or null.
inline int64_t DrawUniformLean(const int32_t* tree, int64_t p, int64_t c, int32_t write_pos,
                               uint32_t k0, uint32_t k1, int64_t b, bool replace,
                               int32_t* picked, const RowPool& pool = kSerialRows,
                               const int32_t* order = nullptr) {
  const int64_t size = tree[1];
  std::vector<int64_t> x(b);
  const int64_t n = Positions(k0, k1, 0, size, b, replace, b, x.data());
  if (order != nullptr) {
    for (int64_t i = 0; i < n; ++i) picked[i] = order[x[i]];
    return n;
  }
  if (write_pos < 0) {
    KthOccupied(tree, p, x.data(), n, picked, pool);
    return n;
  }
  for (int64_t i = 0; i < n; ++i) {
    picked[i] = static_cast<int32_t>((write_pos - size + x[i] + c) % c);
  }
  return n;
}

// draw.successive: prioritized sampling from the sum tree ``tree`` (the
// table's weight tree, or its masked copy). M = B + max(8, B / 2) i.i.d.
// descents on stream 0, targets from the hi words and redrawn from the lo
// words (M = B with replacement: those are the batch); the
// first B distinct in draw order; if fewer, rounds j = 1, 2, ... on a copy
// with every slot picked so far zeroed, M descents on stream j each, keeping
// first occurrences, until B or no weight is left. Returns the valid rows.
inline int64_t Successive(const float* tree, int64_t p, uint32_t k0, uint32_t k1, int64_t b,
                          bool replace, int32_t* picked, const RowPool& pool = kSerialRows) {
  const float total = tree[1];
  if (!(total > 0.0f)) return 0;
  const int64_t m = replace ? b : CandidatesPerRound(b);
  std::vector<uint32_t> hi(m), lo(m);
  std::vector<float> target(m), fresh(m);
  std::vector<int32_t> d(m);
  StreamWords(k0, k1, 0, m, m, hi.data(), lo.data());
  for (int64_t i = 0; i < m; ++i) {
    target[i] = Uniform24(hi[i]) * total;
    fresh[i] = Uniform24(lo[i]);
  }
  DescendWeights(pool, tree, p, target.data(), fresh.data(), m, d.data());
  if (replace) {
    std::copy(d.begin(), d.begin() + b, picked);
    return b;
  }
  SlotSet seen(b);
  int64_t n = 0;
  for (int64_t i = 0; i < m && n < b; ++i) {
    if (seen.Insert(d[i])) picked[n++] = d[i];
  }
  if (n == b) return n;
  // The completion (rare: weight concentrated on fewer than ~B items).
  std::vector<float> t(tree, tree + 2 * p);
  std::vector<int64_t> nodes;
  for (int64_t i = 0; i < n; ++i) {
    t[p + picked[i]] = 0.0f;
    nodes.push_back(p + picked[i]);
  }
  RecomputeSumMany(t.data(), nodes);
  for (int64_t j = 1; n < b && t[1] > 0.0f && j <= MaxCompletionRounds(b); ++j) {
    StreamWords(k0, k1, static_cast<uint32_t>(j), m, m, hi.data(), lo.data());
    const float tot = t[1];
    for (int64_t i = 0; i < m; ++i) {
      target[i] = Uniform24(hi[i]) * tot;
      fresh[i] = Uniform24(lo[i]);
    }
    DescendWeights(pool, t.data(), p, target.data(), fresh.data(), m, d.data());
    nodes.clear();
    for (int64_t i = 0; i < m && n < b; ++i) {
      if (!seen.Insert(d[i])) continue;
      picked[n++] = d[i];
      t[p + d[i]] = 0.0f;
      nodes.push_back(p + d[i]);
    }
    RecomputeSumMany(t.data(), nodes);
  }
  return n;
}

// draw.draw_uniform: the masked (or reuse-limited) uniform program. Rounds
// r = 0 .. kRounds - 1 of M candidates on stream r, each the k-th occupied
// slot of the count tree with k = below(hi, lo, tree[1]); in draw order a
// candidate is taken if eligible (and, without replacement, its first
// occurrence in the round) while the batch has room. Before each later round
// the previous round's first occurrences that were taken (without
// replacement) or found ineligible are zeroed in the count tree (restored at
// the end, before the bookkeeping). If the batch is still short: the eligible
// slots not picked, in slot order, and positions on stream kRounds among them
// (uniform_lean.positions). ``eligible(s)``: the masks. Returns the valid rows.
template <typename Eligible>
int64_t DrawUniformRounds(int32_t* tree, int64_t p, int64_t c, uint32_t k0, uint32_t k1,
                          int64_t b, bool replace, Eligible eligible, int32_t* picked) {
  const int64_t m = CandidatesPerRound(b);
  std::vector<uint32_t> hi(m), lo(m);
  std::vector<int64_t> k(m);
  std::vector<int32_t> d(m), remove, zeroed;
  int64_t n = 0;
  for (int64_t r = 0; r < kRounds; ++r) {
    if (r > 0) {
      if (n >= b) break;
      for (int32_t s : remove) AddCount(tree, p, s, -1);
      zeroed.insert(zeroed.end(), remove.begin(), remove.end());
      remove.clear();
    }
    const int64_t tot = tree[1];
    if (tot <= 0) break;
    StreamWords(k0, k1, static_cast<uint32_t>(r), m, m, hi.data(), lo.data());
    for (int64_t i = 0; i < m; ++i) k[i] = Below(hi[i], lo[i], static_cast<uint32_t>(tot));
    KthOccupied(tree, p, k.data(), m, d.data());
    SlotSet first(m);
    for (int64_t i = 0; i < m; ++i) {
      const int32_t s = d[i];
      const bool is_first = first.Insert(s);
      const bool ok = eligible(s);
      bool take = false;
      if (ok && (replace || is_first) && n < b) {
        picked[n++] = s;
        take = true;
      }
      if (is_first && (replace ? !ok : (take || !ok))) remove.push_back(s);
    }
  }
  for (int32_t s : zeroed) AddCount(tree, p, s, 1);
  if (n >= b) return n;
  std::vector<int32_t> rest;
  {
    SlotSet taken(replace ? 1 : n);
    for (int64_t i = 0; !replace && i < n; ++i) taken.Insert(picked[i]);
    for (int64_t s = 0; s < c; ++s) {
      if (eligible(static_cast<int32_t>(s)) && (replace || !taken.Contains(static_cast<int32_t>(s)))) {
        rest.push_back(static_cast<int32_t>(s));
      }
    }
  }
  const int64_t need = b - n;
  std::vector<int64_t> x(need);
  const int64_t got = Positions(k0, k1, static_cast<uint32_t>(kRounds),
                                static_cast<int64_t>(rest.size()), b, replace, need, x.data());
  for (int64_t i = 0; i < got; ++i) picked[n++] = rest[x[i]];
  return n;
}

// trees.build_sum over the leaves of ``tree`` kept by ``keep(s)`` (others 0):
// the masked weight tree of the prioritized program under masks.
template <typename Keep>
std::vector<float> MaskedTree(const float* tree, int64_t p, int64_t c, Keep keep) {
  std::vector<float> t(2 * p, 0.0f);
  for (int64_t s = 0; s < c; ++s) t[p + s] = keep(static_cast<int32_t>(s)) ? tree[p + s] : 0.0f;
  for (int64_t node = p - 1; node >= 1; --node) t[node] = t[2 * node] + t[2 * node + 1];
  return t;
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_DRAW_H_
