// Direct host entry points: the sampling and priority-update kernels run on a
// host Table's own CPU buffers, called from Python (ctypes) instead of
// through a jitted program.
//
// A jitted call of ours costs ~25 us of dispatch for the 16-leaf state before
// the kernel starts, and hands the batch out as a fresh XLA buffer that torch
// must import through DLPack (~10-20 us more). A host Table owns its state
// exclusively and serialises every use of it under its lock, so it may
// instead run the same kernel on the buffers in place, with the batch written
// straight into memory the caller owns (e.g. a torch tensor). This file does
// what the jitted program does around the kernel (funcreplay/table.py's
// ``_Ops.sample``): the eligible count (staleness version index), the rate
// limiter and min_valid checks, and the key advance, bit for bit; then it runs
// ``RunSample`` (sample_core.h), the very code the FFI handler runs. A
// priority update likewise runs ``RunUpdatePriorities`` (priorities_core.h),
// after computing the weights priority**alpha that the jitted program
// computes in XLA: for a non-integer exponent XLA:CPU's float32 ``pow``
// agreed with libm's ``powf`` on every value tried (numpy's vectorised power
// differs on ~20% of them by an ulp), so this file calls ``powf``. A
// whole-number exponent >= 2 JAX computes by multiplication, and 0.5 XLA by
// a square root: such tables do not update here (direct.py).
// tests/test_direct.py compares the trees bit for bit over many priorities
// and exponents.
// funcreplay/native/direct.py is the Python side and says when this applies.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "priorities_core.h"
#include "sample_core.h"

namespace funcreplay {
namespace {

// Layout of the int64 configuration vector (mirrored in direct.py).
enum Config : size_t {
  kAbi = 0,          // kAbiVersion: guards against a stale Python/C++ pair
  kBatch,            // B rows
  kCapacity,         // C slots
  kReplace,          // 0 / 1
  kMaxTimesSampled,  // 0: unlimited
  kRing,             // Uniform sampler over a Fifo ring
  kNData,            // item leaves
  kVersion,          // the learner's policy version (int32)
  kMinValid,         // fail (flags[0] = 0) below this many eligible items
  kMaxStaleness,     // -1: no staleness limit
  kMinSize,          // rate limiter: min_size_to_sample
  kHasMinDiff,       // rate limiter: 0 when min_diff is -inf
  kQ,                // rate limiter: samples_per_insert = p / q
  kQMin,             // rate limiter: ceil(min_diff * q) (rate_limiters.RateLimiter.q_min)
  kTreeNodes,        // 2P (count tree; also the weight tree when prioritized)
  kHistSize,         // V (0 without staleness)
  kLedgerWords,      // words of the ledger
  kKeyWords,         // words of the PRNG key
  kOutBytes,         // bytes of the output buffer
  kFixed,            // then: row bytes [n_data], packed offsets [n_data + 9],
                     // ledger layout [kLNumEntries + 3]
};
constexpr int64_t kAbiVersion = 3;

// Layout of the pointer vector.
enum Pointer : size_t {
  kPKey = 0,     // uint32[nk], advanced in place
  kPOccupied,    // bool[C]
  kPKeys,        // uint32[C]
  kPVersion,     // int32[C]
  kPTimes,       // int32[C]
  kPPriority,    // float32[C]
  kPOccTree,     // int32[2P]
  kPWeightTree,  // float32[2P] or null (uniform)
  kPLedger,      // uint32[L]
  kPHist,        // int32[V] or null
  kPBounds,      // int32[3] or null
  kPOut,         // uint8[out bytes]
  kPData,        // item leaves [C, ...]
};

// Layout of the int64 configuration vector of a priority update.
enum UpdateConfig : size_t {
  kUAbi = 0,        // kAbiVersion
  kUCapacity,       // C slots
  kUTreeNodes,      // 2P nodes of the weight tree (0: not prioritized)
  kUAlphaBits,      // float32 bits of the priority exponent
  kULedgerWords,    // words of the ledger
  kUFixed,          // then: ledger layout [kLNumEntries + 3]
};

// Layout of the row pointers of a priority update (K rows each).
enum UpdateRows : size_t {
  kRSlots = 0,   // int32[K]
  kRKeys,        // uint32[K]
  kRPriorities,  // float32[K], as given
};

// Items with version >= thr: staleness.count_fresh, the O(1) / O(V) answers
// from the version index, else the O(C) pass it falls back to.
int32_t CountFresh(const VersionIndex& index, int32_t size, int32_t thr, const bool* occupied,
                   const int32_t* version, int64_t c) {
  const int64_t v = index.v;
  const int32_t hi = index.bounds[0], n_old = index.bounds[1], old_min = index.bounds[2];
  int32_t lowest = Wrap(static_cast<uint32_t>(Sub(hi, v)) + 1u);
  if (n_old > 0) lowest = std::min(old_min, lowest);
  if (thr <= lowest) return size;
  if (thr > Sub(hi, v)) {
    uint32_t sum = 0;  // int32 with wrap-around, as jnp.sum
    for (int64_t b = 0; b < v; ++b) {
      const int32_t vb = Sub(hi, static_cast<uint32_t>(Sub(hi, b)) & static_cast<uint32_t>(v - 1));
      if (vb >= thr) sum += static_cast<uint32_t>(index.hist[b]);
    }
    return Wrap(sum);
  }
  uint32_t n = 0;
  for (int64_t s = 0; s < c; ++s) n += (occupied[s] && version[s] >= thr) ? 1u : 0u;
  return Wrap(n);
}

}  // namespace
}  // namespace funcreplay

using namespace funcreplay;  // NOLINT

// Samples cfg[kBatch] rows into ptrs[kPOut] (packed layout) and updates the
// state in place, exactly as the jitted Table sample with the native kernel.
// flags (int32[3]): ok, rate limiter ok, eligible count, as that program
// returns them. Returns 0, or 1 (ABI mismatch), 2 (ledger layout), 3
// (packed layout): the state is untouched in those cases.
extern "C" int funcreplay_direct_sample(const int64_t* cfg, void* const* ptrs, int32_t* flags) {
  if (cfg[kAbi] != kAbiVersion) return 1;
  const int64_t b = cfg[kBatch], c = cfg[kCapacity];
  const size_t n_data = static_cast<size_t>(cfg[kNData]);
  const int64_t* row_bytes = cfg + kFixed;
  const int64_t* packed = row_bytes + n_data;
  const int64_t* ledger_layout = packed + n_data + 9;

  SampleJob job;
  job.batch = b;
  job.capacity = c;
  job.replace = cfg[kReplace] != 0;
  job.max_times_sampled = cfg[kMaxTimesSampled];
  job.has_version = true;  // a Table always samples at a version
  job.ring = cfg[kRing] != 0;
  job.occupied = static_cast<bool*>(ptrs[kPOccupied]);
  job.keys = static_cast<const uint32_t*>(ptrs[kPKeys]);
  job.versions = static_cast<const int32_t*>(ptrs[kPVersion]);
  job.times = static_cast<int32_t*>(ptrs[kPTimes]);
  job.priority = static_cast<const float*>(ptrs[kPPriority]);
  job.tree = static_cast<int32_t*>(ptrs[kPOccTree]);
  job.p = cfg[kTreeNodes] / 2;
  job.wtree = static_cast<float*>(ptrs[kPWeightTree]);
  if (!job.ledger.Open(static_cast<uint32_t*>(ptrs[kPLedger]), cfg[kLedgerWords], ledger_layout,
                       kLNumEntries + 3)) {
    return 2;
  }
  job.index.v = cfg[kHistSize];
  job.index.hist = static_cast<int32_t*>(ptrs[kPHist]);
  job.index.bounds = static_cast<int32_t*>(ptrs[kPBounds]);
  job.src.resize(n_data);
  job.row_bytes.resize(n_data);
  for (size_t d = 0; d < n_data; ++d) {
    job.src[d] = static_cast<const char*>(ptrs[kPData + d]);
    job.row_bytes[d] = static_cast<size_t>(row_bytes[d]);
  }
  char* columns[8] = {};
  if (!BindPacked(static_cast<char*>(ptrs[kPOut]), cfg[kOutBytes], packed, n_data + 9, b,
                  job.row_bytes, &job.rows, columns)) {
    return 3;
  }
  job.BindColumns(columns);

  // The jitted program's prologue (table.py _Ops.sample, native/sample.py).
  const int32_t size = job.tree[1];
  const int32_t ver = static_cast<int32_t>(cfg[kVersion]);
  int32_t thr = std::numeric_limits<int32_t>::min();
  // Zero-weight items are not eligible (occ_tree[0], indexes.zero_weight_count).
  int32_t cnt = job.wtree != nullptr ? size - job.tree[0] : size;
  if (cfg[kMaxStaleness] >= 0) {  // staleness.threshold, then ops.count
    const int32_t ms = static_cast<int32_t>(cfg[kMaxStaleness]);
    thr = std::max(ver, std::numeric_limits<int32_t>::min() + ms) - ms;
    cnt = CountFresh(job.index, size, thr, job.occupied, job.versions, c);
  }
  const int64_t n_valid = job.replace ? (cnt > 0 ? b : 0) : std::min<int64_t>(cnt, b);
  bool limiter_ok = size >= cfg[kMinSize];  // rate_limiters.can_sample, exact integers
  if (cfg[kHasMinDiff] != 0) {
    const int64_t diff = job.ledger.GetInt(kLLimiterDiff);
    limiter_ok = limiter_ok && diff - cfg[kQ] * n_valid >= cfg[kQMin];
  }
  const bool ok = limiter_ok && cnt >= cfg[kMinValid];

  uint32_t* kw = static_cast<uint32_t*>(ptrs[kPKey]);
  const size_t nk = static_cast<size_t>(cfg[kKeyWords]);
  FoldKey(kw, nk, &job.k0, &job.k1);
  NextKey(job.k0, job.k1, ok, kw, kw, nk);
  job.version = ver;
  job.threshold = thr;
  job.num_eligible = cnt;
  job.enabled = ok;
  job.total = job.wtree != nullptr ? job.wtree[1] : 0.0f;
  std::memcpy(columns[7], &cnt, sizeof cnt);
  RunSample(job);
  flags[0] = ok ? 1 : 0;
  flags[1] = limiter_ok ? 1 : 0;
  flags[2] = cnt;
  return 0;
}

// Applies K priority updates to the state in place, exactly as the jitted
// Table.update_priorities with the native kernel. ptrs is the pointer vector
// of funcreplay_direct_sample (only the occupied, keys, priority, weight tree
// and ledger entries are read). Returns 0, or 1 (ABI mismatch), 2 (ledger
// layout): the state is untouched in those cases.
extern "C" int funcreplay_direct_update_priorities(const int64_t* cfg, void* const* ptrs,
                                                   void* const* rows, int64_t k) {
  if (cfg[kUAbi] != kAbiVersion) return 1;
  UpdateJob job;
  if (!job.ledger.Open(static_cast<uint32_t*>(ptrs[kPLedger]), cfg[kULedgerWords], cfg + kUFixed,
                       kLNumEntries + 3)) {
    return 2;
  }
  job.k = k;
  job.slots = static_cast<const int32_t*>(rows[kRSlots]);
  job.keys = static_cast<const uint32_t*>(rows[kRKeys]);
  job.priorities = static_cast<const float*>(rows[kRPriorities]);
  job.capacity = cfg[kUCapacity];
  job.occupied = static_cast<const bool*>(ptrs[kPOccupied]);
  job.item_keys = static_cast<const uint32_t*>(ptrs[kPKeys]);
  job.priority = static_cast<float*>(ptrs[kPPriority]);
  std::vector<float> weights;
  if (cfg[kUTreeNodes] > 0) {
    // The jitted update's weights (native/priorities.py): the sanitized
    // priority, then indexes.sample_weight, where(p > 0, pow(max(p, 1e-30),
    // alpha), 0) in float32. XLA:CPU calls libm's powf for that pow (not for
    // alpha 0.5 or a whole number >= 2: direct.py keeps those off this path)
    // and flushes denormal results to zero; denormal inputs it treats one way
    // or the other depending on the surrounding program, so Table sends calls
    // with a denormal priority to the jitted update instead.
    float alpha;
    const uint32_t bits = static_cast<uint32_t>(cfg[kUAlphaBits]);
    std::memcpy(&alpha, &bits, sizeof alpha);
    weights.resize(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) {
      const float x = job.priorities[i];
      const float clean = BadPriority(x) ? 0.0f : x;
      const float w = clean > 0.0f ? ::powf(std::max(clean, 1e-30f), alpha) : 0.0f;
      weights[i] = w < std::numeric_limits<float>::min() ? 0.0f : w;
    }
    job.weights = weights.data();
    job.wtree = static_cast<float*>(ptrs[kPWeightTree]);
    job.p = cfg[kUTreeNodes] / 2;
    job.zero_count = static_cast<int32_t*>(ptrs[kPOccTree]);
  }
  RunUpdatePriorities(job);
  return 0;
}
