// The sampling kernel of funcreplay's native code, over raw pointers: the
// jitted path (kernels.cc, an XLA FFI custom call) and the direct host path
// (direct.cc, called from Python on a host Table's own CPU buffers) both
// bind their buffers into a ``SampleJob`` and run ``RunSample``: the prologue
// (staleness threshold, eligible count, the key), the draw (draw.h) and the
// bookkeeping. Bit for bit the portable program for the same (state, key):
// core/sampling/sample.py (which program), uniform_lean.py, prioritized_lean.py,
// draw.py (the draws), uniform_lean.finish / finish.py (the bookkeeping).
#ifndef FUNCREPLAY_NATIVE_SAMPLE_CORE_H_
#define FUNCREPLAY_NATIVE_SAMPLE_CORE_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "draw.h"
#include "fixedpoint.h"
#include "item_info.h"
#include "parallel.h"
#include "position_index.h"
#include "random.h"
#include "rows.h"

namespace funcreplay {

// numerics.MIN_TOTAL: the floor of a total before a division (the smallest normal float).
constexpr float kMinTotal = std::numeric_limits<float>::min();

// Items with version >= thr: staleness.count_fresh, the O(1) / O(V) answers
// from the version index, else the O(C) pass it falls back to.
inline int32_t CountFresh(const VersionIndex& index, int32_t size, int32_t thr,
                          const bool* occupied, const ItemInfo& info, int64_t c) {
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
  for (int64_t s = 0; s < c; ++s) n += (occupied[s] && info.version(s) >= thr) ? 1u : 0u;
  return Wrap(n);
}

// staleness.threshold: version - max_staleness, saturated at the int32 minimum.
inline int32_t StalenessThreshold(int32_t version, int64_t max_staleness) {
  const int32_t ms = static_cast<int32_t>(max_staleness);
  return std::max(version, std::numeric_limits<int32_t>::min() + ms) - ms;
}

// One sample call: everything but the buffers' origin.
struct SampleJob {
  // Static configuration.
  int64_t batch = 0, capacity = 0, max_times_sampled = 0;
  int64_t max_staleness = -1;  // -1: none
  bool replace = false, has_version = false;
  // A table without holes (TableSpec.holes false): the unmasked uniform draw maps a
  // position to its slot by ring arithmetic (uniform_lean.ring_slot), not the tree.
  bool ring = false;
  // This call: the key words (threefry: 2), the version, whether to sample at
  // all, the slot mask (bool[C] or null), whether to split the key
  // (sampling.sample(split_key=True): next key = split(key)[0], sample with
  // split(key)[1]).
  const uint32_t* key = nullptr;
  bool split_key = false;
  int32_t version = 0;
  bool enabled = true;
  const bool* where = nullptr;
  // The state, updated in place.
  bool* occupied = nullptr;
  ItemInfo info;              // item_info uint32[C, 4]: times sampled is written
  int32_t* tree = nullptr;    // int32[2P] count tree (node 0: zero-weight items)
  int64_t p = 0;
  float* wtree = nullptr;     // float32[2P] weight tree, or null (uniform)
  Ledger ledger;
  VersionIndex index;
  PositionIndex pindex;  // TableSpec.position_index (off: order null)
  // Where the rows are copied (parallel.h); the calling thread alone by default.
  const RowPool* pool = &kSerialRows;
  // The item fields (signature leaves): each at ``src[d] + slot * src_stride[d]``,
  // ``row_bytes[d]`` bytes. One array per leaf: stride == row_bytes; packed rows
  // (funcreplay/core/storage.py): every field inside the one [C, R] words array.
  std::vector<const char*> src;
  std::vector<size_t> src_stride;
  std::vector<size_t> row_bytes;   // bytes per field of one item
  // Outputs: B rows per data leaf, the seven info columns [B], the next key.
  std::vector<char*> rows;
  bool* out_valid = nullptr;
  int32_t* out_slot = nullptr;
  uint32_t* out_key = nullptr;
  float* out_prob = nullptr;
  float* out_prio = nullptr;
  int32_t* out_times = nullptr;
  int32_t* out_version = nullptr;
  uint32_t next_key[2] = {0, 0};
  // Points src / src_stride / row_bytes at the item fields of ``leaves`` ({data, bytes}
  // of each [C, ...] state array). ``fields`` empty: one field per array; else one
  // uint32[C, R] array of packed rows, the fields at word offsets 0 = f_0 < ... < f_n = R
  // (funcreplay/core/storage.py). False if the arrays do not fit that description.
  bool BindFields(const std::vector<std::pair<const char*, size_t>>& leaves,
                  const int64_t* fields, size_t n_offsets) {
    const size_t n = n_offsets == 0 ? leaves.size() : n_offsets - 1;
    src.resize(n);
    src_stride.resize(n);
    row_bytes.resize(n);
    if (n_offsets == 0) {
      for (size_t d = 0; d < n; ++d) {
        src[d] = leaves[d].first;
        row_bytes[d] = src_stride[d] = capacity > 0 ? leaves[d].second / capacity : 0;
      }
      return true;
    }
    bool ok = leaves.size() == 1 && n_offsets >= 2 && fields[0] == 0;
    for (size_t j = 1; ok && j < n_offsets; ++j) ok = fields[j] > fields[j - 1];
    const size_t stride = static_cast<size_t>(fields[n]) * sizeof(uint32_t);
    if (!ok || leaves[0].second != static_cast<size_t>(capacity) * stride) return false;
    for (size_t d = 0; d < n; ++d) {
      src[d] = leaves[0].first + fields[d] * sizeof(uint32_t);
      src_stride[d] = stride;
      row_bytes[d] = static_cast<size_t>(fields[d + 1] - fields[d]) * sizeof(uint32_t);
    }
    return true;
  }
  // Set by the prologue (once: a caller that ran it first keeps its results).
  bool prologue_done = false;
  bool stale = false, masked = false;
  int32_t threshold = std::numeric_limits<int32_t>::min();
  int32_t num_eligible = 0;

  void BindColumns(char* const columns[8]) {
    out_valid = reinterpret_cast<bool*>(columns[0]);
    out_slot = reinterpret_cast<int32_t*>(columns[1]);
    out_key = reinterpret_cast<uint32_t*>(columns[2]);
    out_prob = reinterpret_cast<float*>(columns[3]);
    out_prio = reinterpret_cast<float*>(columns[4]);
    out_times = reinterpret_cast<int32_t*>(columns[5]);
    out_version = reinterpret_cast<int32_t*>(columns[6]);
  }

  // ops.eligible_mask for one slot (prioritized: a positive weight leaf).
  bool Eligible(int64_t s) const {
    return occupied[s] && (!stale || info.version(s) >= threshold) &&
           (where == nullptr || where[s]) && (wtree == nullptr || wtree[p + s] > 0.0f);
  }
};

// The prologue, shared by both callers: the staleness threshold and the
// eligible count (ops.count: O(1) unmasked, the version index under the
// staleness mask alone, O(C) with ``where`` or a prioritized sampler).
inline void SamplePrologue(SampleJob& job) {
  if (job.prologue_done) return;
  job.prologue_done = true;
  job.stale = job.has_version && job.max_staleness >= 0;
  job.masked = job.stale || job.where != nullptr;
  if (job.stale) job.threshold = StalenessThreshold(job.version, job.max_staleness);
  const int32_t size = job.tree[1];
  if (!job.masked) {
    job.num_eligible = job.wtree != nullptr ? size - job.tree[0] : size;
  } else if (job.wtree != nullptr || job.where != nullptr) {
    uint32_t n = 0;
    for (int64_t s = 0; s < job.capacity; ++s) n += job.Eligible(s) ? 1u : 0u;
    job.num_eligible = Wrap(n);
  } else {
    job.num_eligible = CountFresh(job.index, size, job.threshold, job.occupied, job.info,
                                  job.capacity);
  }
}

// The draw (sample.py's choice of program): ``picked`` gets the valid rows
// in order; returns their number and sets ``*total`` (prioritized: the
// eligible weight the probabilities divide by).
inline int64_t SampleDraw(SampleJob& job, uint32_t k0, uint32_t k1, int32_t* picked,
                          float* total) {
  const int64_t b = job.batch, c = job.capacity, p = job.p;
  if (job.wtree != nullptr) {  // prioritized_lean / draw.draw_prioritized
    if (!job.masked) {
      *total = job.wtree[1];
      return Successive(job.wtree, p, k0, k1, b, job.replace, picked, *job.pool);
    }
    std::vector<float> t = MaskedTree(job.wtree, p, c, [&](int32_t s) { return job.Eligible(s); });
    *total = t[1];
    return Successive(t.data(), p, k0, k1, b, job.replace, picked, *job.pool);
  }
  *total = 0.0f;
  // uniform_lean, with or without a reuse limit (used-up items are freed below, so
  // every occupied item is eligible: sampling/used_up.py).
  if (!job.masked) {
    const int32_t write_pos = job.ring ? job.ledger.GetInt(kLWritePos) : -1;
    return DrawUniformLean(job.tree, p, c, write_pos, k0, k1, b, job.replace, picked,
                           *job.pool, job.pindex.order);
  }
  return DrawUniformRounds(job.tree, p, c, k0, k1, b, job.replace,  // draw.draw_uniform
                           [&](int32_t s) { return job.Eligible(s); }, picked);
}

// Runs the whole sample: prologue, key, draw, rows and info columns, and the
// state (times sampled, counters, the rate limiter's diff, items freed on
// reaching max_times_sampled). ``enabled`` false: nothing sampled or changed
// (the key is kept). Returns the number of valid rows.
inline int64_t RunSample(SampleJob& job) {
  SamplePrologue(job);
  const int64_t b = job.batch, p = job.p;
  uint32_t k0 = job.key[0], k1 = job.key[1];
  job.next_key[0] = k0;
  job.next_key[1] = k1;
  if (job.split_key && job.enabled) {
    SplitKey(job.key[0], job.key[1], 0, &job.next_key[0], &job.next_key[1]);
    SplitKey(job.key[0], job.key[1], 1, &k0, &k1);
  }
  std::vector<int32_t> picked(b, -1);
  float total = 0.0f;
  const int64_t n = job.enabled ? SampleDraw(job, k0, k1, picked.data(), &total) : 0;

  ItemInfo& info = job.info;
  const size_t n_data = job.src.size();
  // times_sampled + 1 (int32 with wrap-around, as the portable add), read back after the
  // increment. Without replacement the slots are distinct: each row increments its own
  // slot where it reads its info (below, in its chunk). With replacement a slot may
  // repeat, and every row reads the count after all the batch's increments: first.
  const bool distinct = !job.replace;
  if (!distinct) {
    for (int64_t i = 0; i < n; ++i) {
      const int32_t s = picked[i];
      info.set_times_sampled(s, Wrap(static_cast<uint32_t>(info.times_sampled(s)) + 1u));
    }
  }
  const float uniform_prob =
      DivideExact(1.0f, static_cast<float>(std::max<int32_t>(job.num_eligible, 1)));
  // w / total as fixedpoint.divide computes it (fixedpoint.h).
  const float safe_total = std::max(total, kMinTotal);
  // The rows and their info: chunks of rows, each with its own prefetch window, on the
  // calling thread and (the jitted path) XLA's pool (parallel.h). Every chunk writes
  // its own rows only.
  auto prefetch_row = [&](int64_t i) {
    const int32_t s = picked[i];
    __builtin_prefetch(info.row(s));  // key, version, times sampled and priority
    for (size_t d = 0; d < n_data; ++d) {
      const char* row = job.src[d] + s * job.src_stride[d];
      for (size_t at = 0; at < job.row_bytes[d]; at += 64) __builtin_prefetch(row + at);
    }
  };
  // At most ~256 KB of rows in flight, whatever the item size.
  size_t item_bytes = 0;
  for (size_t d = 0; d < n_data; ++d) item_bytes += job.row_bytes[d];
  const int64_t ahead = std::clamp<int64_t>(
      static_cast<int64_t>((256 << 10) / std::max<size_t>(item_bytes, 1)), 1, kRowsAhead);
  auto copy_rows = [&](int64_t lo, int64_t hi) {
    const int64_t valid_end = std::min(hi, n);
    for (int64_t i = lo; i < std::min(lo + ahead, valid_end); ++i) prefetch_row(i);
    for (int64_t i = lo; i < hi; ++i) {
      if (i < n) {
        if (i + ahead < valid_end) prefetch_row(i + ahead);
        const int32_t s = picked[i];
        job.out_valid[i] = true;
        job.out_slot[i] = s;
        job.out_key[i] = info.key(s);
        job.out_prob[i] = job.wtree != nullptr ? DivideExact(job.wtree[p + s], safe_total)
                                               : uniform_prob;
        job.out_prio[i] = info.priority(s);
        if (distinct) {
          info.set_times_sampled(s, Wrap(static_cast<uint32_t>(info.times_sampled(s)) + 1u));
        }
        job.out_times[i] = info.times_sampled(s);
        job.out_version[i] = info.version(s);
        for (size_t d = 0; d < n_data; ++d) {
          CopyRow(job.rows[d] + i * job.row_bytes[d], job.src[d] + s * job.src_stride[d],
                  job.row_bytes[d]);
        }
      } else {
        job.out_valid[i] = false;
        job.out_slot[i] = -1;
        job.out_key[i] = 0;
        job.out_prob[i] = 0.0f;
        job.out_prio[i] = 0.0f;
        job.out_times[i] = 0;
        job.out_version[i] = 0;
        for (size_t d = 0; d < n_data; ++d) {
          std::memset(job.rows[d] + i * job.row_bytes[d], 0, job.row_bytes[d]);
        }
      }
    }
  };
  job.pool->For(b, RowsPerChunk(item_bytes), copy_rows);
  uint64_t stale_sum = 0;
  if (job.has_version) {
    for (int64_t i = 0; i < n; ++i) stale_sum += Behind(job.version, job.out_version[i]);
  }
  if (!job.enabled) return 0;  // disabled: the state stays untouched
  job.ledger.Count(kLSamples, static_cast<uint64_t>(n));
  if (job.has_version) job.ledger.Count(kLStaleSum, stale_sum);
  job.ledger.UpdateLimiter(0, n);

  if (job.max_times_sampled > 0) {
    // Free items that reached max_times_sampled, once per slot (with
    // replacement a slot may repeat: its last row reports it).
    uint64_t n_freed = 0, reuse_sum = 0;
    std::vector<uint8_t> exhausted(b, 0);
    std::vector<int64_t> freed;  // weight-tree leaves set to 0
    SlotSet done(job.replace ? n : 1);
    for (int64_t i = n - 1; i >= 0; --i) {
      const int32_t s = picked[i];
      const int32_t times = info.times_sampled(s);
      if (times < job.max_times_sampled) continue;
      if (job.replace && !done.Insert(s)) continue;
      exhausted[i] = 1;
      job.occupied[s] = false;
      AddCount(job.tree, p, s, -1);
      if (job.wtree != nullptr) {
        job.wtree[p + s] = 0.0f;
        freed.push_back(p + s);
      }
      ++n_freed;
      reuse_sum += static_cast<uint64_t>(static_cast<uint32_t>(times));
    }
    if (job.wtree != nullptr) RecomputeSumMany(job.wtree, std::move(freed));
    if (job.pindex.on()) job.pindex.Drop(picked.data(), exhausted.data(), n);
    job.ledger.Count(kLEvictedReuse, n_freed);
    job.ledger.Count(kLRemovedReuse, reuse_sum);
    job.index.Shift(job.out_version, exhausted.data(), b, -1);
  }
  return n;
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_SAMPLE_CORE_H_
