// The ring insert (Fifo remover) of funcreplay's native code, over raw
// pointers: kernels.cc's FFI handler checks XLA's buffers, binds them into an
// ``InsertJob`` and runs ``RunFifoInsert``, as it does for the sample
// (sample_core.h) and the priority update (priorities_core.h).
// Semantics: ops.insert (the portable implementation), bit for bit.
#ifndef FUNCREPLAY_NATIVE_INSERT_CORE_H_
#define FUNCREPLAY_NATIVE_INSERT_CORE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"
#include "item_info.h"
#include "position_index.h"

namespace funcreplay {

// One insert call: B rows and the state they go into.
struct InsertJob {
  // The rows: mask bool[B], version int32[B], priority float32[B],
  // weight float32[B] (priority**alpha; null unless prioritized), the number
  // of invalid priorities among them, one int32[B] row per metadata column
  // and one [B, ...] row block per item leaf (row_bytes[d] bytes a row).
  int64_t b = 0;
  const bool* mask = nullptr;
  const int32_t* in_version = nullptr;
  const float* in_priority = nullptr;
  const float* in_weight = nullptr;
  uint32_t n_bad = 0;
  std::vector<const int32_t*> in_meta;
  std::vector<const char*> in_data;
  // The state, updated in place (wtree null unless prioritized).
  int64_t capacity = 0;
  bool* occupied = nullptr;
  ItemInfo info;            // item_info uint32[C, 4]
  int32_t* tree = nullptr;  // occ_tree int32[2P]
  int64_t p = 0;            // leaves of the trees
  float* wtree = nullptr;
  Ledger ledger;
  VersionIndex index;
  PositionIndex pindex;        // TableSpec.position_index (off: order null)
  std::vector<int32_t*> meta;  // int32[C] per metadata column
  std::vector<char*> data;     // [C, ...] per item leaf
  std::vector<size_t> row_bytes;
};

// Besides the rows, the kernel keeps the ledger as ops.insert does: ring
// position, next key, counters, max_priority and the rate limiter's diff.
inline void RunFifoInsert(InsertJob& job) {
  const int64_t b = job.b, c = job.capacity, p = job.p;
  const bool* mask = job.mask;
  bool* occupied = job.occupied;
  int32_t* tree = job.tree;
  float* wtree = job.wtree;
  Ledger& ledger = job.ledger;
  job.index.Advance(job.in_version, mask, b);
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
    if (wtree != nullptr) {
      // occ_tree[0] counts the occupied items of zero sampling weight, which
      // are not eligible (indexes.zero_weight_count).
      if (occupied[s] && !(wtree[p + s] > 0.0f)) --tree[0];
      if (!(job.in_weight[i] > 0.0f)) ++tree[0];
    }
    if (occupied[s]) {
      victim[i] = 1;
      victim_version[i] = job.info.version(s);
      ++n_victims;
      reuse_sum += static_cast<uint64_t>(static_cast<uint32_t>(job.info.times_sampled(s)));
    } else {
      occupied[s] = true;
      for (int64_t node = p + s; node >= 1; node >>= 1) ++tree[node];
      if (job.pindex.on()) job.pindex.Append(static_cast<int32_t>(s));  // position_index.add
    }
    job.info.set_row(s, key++, job.in_version[i], 0, job.in_priority[i]);
    largest = std::max(largest, job.in_priority[i]);
    for (size_t m = 0; m < job.meta.size(); ++m) job.meta[m][s] = job.in_meta[m][i];
    if (wtree != nullptr) {
      wtree[p + s] = job.in_weight[i];
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
    for (size_t d = 0; d < job.data.size(); ++d) {
      const size_t rb = job.row_bytes[d];
      std::memcpy(job.data[d] + s * rb, job.in_data[d] + i * rb, (j - i) * rb);
    }
    i = j;
  }
  // As the portable path: remove the overwritten items, then add the new ones.
  job.index.Shift(victim_version.data(), victim.data(), b, -1);
  job.index.Shift(job.in_version, mask, b, 1);
  ledger.SetInt(kLWritePos, static_cast<int32_t>(pos));
  *ledger.Word(kLNextKey) = key;
  ledger.Count(kLInserts, n_real);
  ledger.Count(kLEvictedCapacity, n_victims);
  ledger.Count(kLRemovedReuse, reuse_sum);
  ledger.Count(kLInvalidPriorities, job.n_bad);
  ledger.SetFloat(kLMaxPriority, std::max(ledger.GetFloat(kLMaxPriority), largest));
  ledger.UpdateLimiter(static_cast<int64_t>(n_real), 0);
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_INSERT_CORE_H_
