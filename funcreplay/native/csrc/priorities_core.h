// The priority update of funcreplay's native code, over raw pointers: the
// jitted path (kernels.cc's FFI handler) and the direct host path (direct.cc,
// called from Python on a host Table's own CPU buffers) both run
// ``RunUpdatePriorities``, so the two leave the state bit for bit the same.
// Semantics: ops.update_priorities (the portable implementation).
#ifndef FUNCREPLAY_NATIVE_PRIORITIES_CORE_H_
#define FUNCREPLAY_NATIVE_PRIORITIES_CORE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "common.h"
#include "item_info.h"

namespace funcreplay {

// One update_priorities call: K rows and the state they apply to.
struct UpdateJob {
  // The rows: slots int32[K], keys uint32[K], priorities float32[K] (as
  // given), weights float32[K] (priority**alpha of the sanitized priorities)
  // or null (not prioritized).
  int64_t k = 0;
  const int32_t* slots = nullptr;
  const uint32_t* keys = nullptr;
  const float* priorities = nullptr;
  const float* weights = nullptr;
  // The state, updated in place (wtree null unless prioritized).
  int64_t capacity = 0;
  const bool* occupied = nullptr;
  ItemInfo info;  // item_info uint32[C, 4]: the keys are checked, the priorities written
  float* wtree = nullptr;
  int64_t p = 0;  // leaves of the weight tree
  int32_t* zero_count = nullptr;  // occ_tree[0] (with wtree): occupied zero-weight items
  Ledger ledger;
};

// True for a priority the update stores as 0 and counts as invalid.
inline bool BadPriority(float x) { return !std::isfinite(x) || x < 0.0f; }

// Applied only where the slot still holds the key; the last row for a slot
// wins; negative / NaN / inf priorities are stored as 0 and counted (among
// the winning rows) in the ledger's invalid_priorities; max_priority rises to
// the largest stored priority.
inline void RunUpdatePriorities(UpdateJob& job) {
  SlotSet done(job.k);
  std::vector<int64_t> changed;
  float largest = 0.0f;
  uint64_t n_bad = 0;
  for (int64_t i = job.k - 1; i >= 0; --i) {  // backwards: the first hit is the last write
    const int32_t s = job.slots[i];
    if (s < 0 || s >= job.capacity || !job.occupied[s] || job.info.key(s) != job.keys[i]) {
      continue;
    }
    if (!done.Insert(s)) continue;
    const bool bad = BadPriority(job.priorities[i]);
    const float clean = bad ? 0.0f : job.priorities[i];
    n_bad += bad ? 1 : 0;
    job.info.set_priority(s, clean);
    largest = std::max(largest, clean);
    if (job.wtree != nullptr) {
      *job.zero_count += (job.weights[i] > 0.0f ? 0 : 1) - (job.wtree[job.p + s] > 0.0f ? 0 : 1);
      job.wtree[job.p + s] = job.weights[i];
      changed.push_back(job.p + s);
    }
  }
  if (job.wtree != nullptr) RecomputeSumMany(job.wtree, std::move(changed));
  job.ledger.SetFloat(kLMaxPriority, std::max(job.ledger.GetFloat(kLMaxPriority), largest));
  job.ledger.Count(kLInvalidPriorities, n_bad);
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_PRIORITIES_CORE_H_
