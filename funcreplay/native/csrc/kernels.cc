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
//
// The shared pieces live in common.h; the sampling kernel itself in
// sample_core.h (also used by direct.cc). This file binds XLA's buffers.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "priorities_core.h"
#include "sample_core.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace funcreplay;  // NOLINT: this file is the FFI binding of those pieces

namespace {

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

template <typename Rets>
bool OpenLedger(Rets& rets, size_t at, ffi::Span<const int64_t> layout, Ledger* ledger) {
  auto buf = rets.template get<ffi::AnyBuffer>(at).value();
  return ledger->Open(static_cast<uint32_t*>(buf->untyped_data()),
                      static_cast<int64_t>(buf->element_count()), layout.begin(),
                      layout.size());
}

ffi::Error LedgerMismatch(const char* kernel) {
  return ffi::Error::InvalidArgument(
      std::string(kernel) + ": the ledger layout does not fit the ledger operand "
      "(native.ledger_attr and kernels.cc disagree; rebuild the native kernels)");
}

template <typename T>
T* Ptr(ffi::RemainingArgs& args, size_t i) {
  return static_cast<T*>(args.get<ffi::AnyBuffer>(i).value().untyped_data());
}
template <typename T>
T* Ptr(ffi::RemainingRets& rets, size_t i) {
  return static_cast<T*>(rets.get<ffi::AnyBuffer>(i).value()->untyped_data());
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

ffi::Error SampleImpl(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t batch_size,
                      int64_t capacity, bool replace, int64_t max_times_sampled,
                      bool has_version, bool has_where, bool ring,
                      ffi::Span<const int64_t> packed, ffi::Span<const int64_t> ledger_layout) {
  const int64_t b = batch_size;
  const int64_t c = capacity;
  const size_t n_data = args.size() - kData;
  const size_t n_state = kData - kFirstState + n_data;

  SampleJob job;
  job.batch = b;
  job.capacity = c;
  job.replace = replace;
  job.max_times_sampled = max_times_sampled;
  job.has_version = has_version;
  job.ring = ring;

  auto key_buf = args.get<ffi::AnyBuffer>(kKey).value();
  const uint32_t* kw = static_cast<const uint32_t*>(key_buf.untyped_data());
  const size_t nk = key_buf.element_count();
  FoldKey(kw, nk, &job.k0, &job.k1);

  const int32_t* params = Ptr<int32_t>(args, kParams);
  job.version = params[0];
  job.threshold = params[1];
  job.num_eligible = params[2];
  job.enabled = params[3] != 0;  // false: sample nothing, change nothing
  job.total = *Ptr<float>(args, kTotal);
  job.where = has_where ? Ptr<bool>(args, kWhere) : nullptr;

  // State results alias their operands: write through the results.
  job.occupied = Ptr<bool>(rets, kOccupied - kFirstState);
  job.keys = Ptr<uint32_t>(rets, kKeys - kFirstState);
  job.versions = Ptr<int32_t>(rets, kVersion - kFirstState);
  job.times = Ptr<int32_t>(rets, kTimes - kFirstState);
  job.priority = Ptr<float>(rets, kPriority - kFirstState);
  auto tree_buf = rets.get<ffi::AnyBuffer>(kOccTree - kFirstState).value();
  job.tree = static_cast<int32_t*>(tree_buf->untyped_data());
  job.p = static_cast<int64_t>(tree_buf->element_count()) / 2;
  auto wt_buf = rets.get<ffi::AnyBuffer>(kWeightTree - kFirstState).value();
  job.wtree = wt_buf->element_count() > 0 ? static_cast<float*>(wt_buf->untyped_data())
                                          : nullptr;
  if (!OpenLedger(rets, kLedger - kFirstState, ledger_layout, &job.ledger)) {
    return LedgerMismatch("funcreplay_sample");
  }
  job.index = OpenIndex(rets, kHist - kFirstState, kBounds - kFirstState);
  job.src.resize(n_data);
  job.row_bytes.resize(n_data);
  for (size_t d = 0; d < n_data; ++d) {
    auto leaf = rets.get<ffi::AnyBuffer>(kData - kFirstState + d).value();
    job.src[d] = static_cast<const char*>(leaf->untyped_data());
    job.row_bytes[d] = c > 0 ? leaf->size_bytes() / c : 0;
  }

  // Outputs after the state: the rows and info columns as separate arrays, or
  // (``packed`` = byte offsets of the n_data leaves, valid, the six info
  // columns, num_eligible, then the total size) all in one uint8 buffer
  // (funcreplay/packing.py's layout). packed = [-1]: separate arrays.
  const bool is_packed = !(packed.size() == 1 && packed[0] == -1);
  size_t o = n_state;
  char* columns[8] = {};  // valid, slot, key, prob, prio, times, version, num_eligible
  if (is_packed) {  // the layout comes from funcreplay/packing.py; check it anyway
    auto buf = rets.get<ffi::AnyBuffer>(o++);
    if (!buf.has_value() ||
        !BindPacked(static_cast<char*>((*buf)->untyped_data()),
                    static_cast<int64_t>((*buf)->size_bytes()), packed.begin(), packed.size(),
                    b, job.row_bytes, &job.rows, columns)) {
      return ffi::Error::InvalidArgument(
          "funcreplay_sample: the packed layout does not match the operands (expected "
          "n_data + 9 increasing byte offsets ending with the output's size)");
    }
    std::memcpy(columns[7], &params[2], sizeof(int32_t));
  } else {
    job.rows.resize(n_data);
    for (size_t d = 0; d < n_data; ++d) {
      job.rows[d] = static_cast<char*>(rets.get<ffi::AnyBuffer>(o++).value()->untyped_data());
    }
    for (size_t j = 0; j < 7; ++j) {
      columns[j] = static_cast<char*>(rets.get<ffi::AnyBuffer>(o++).value()->untyped_data());
    }
  }
  job.BindColumns(columns);
  int32_t* out_n = Ptr<int32_t>(rets, o++);
  // num_eligible goes back out through the kernel: the caller computed it
  // from reads of the count tree, and returning those reads directly would
  // leave them unordered with this in-place update (XLA would copy the tree).
  *Ptr<int32_t>(rets, o++) = params[2];
  auto next_buf = rets.get<ffi::AnyBuffer>(o++).value();
  NextKey(job.k0, job.k1, job.enabled, kw, static_cast<uint32_t*>(next_buf->untyped_data()),
          next_buf->element_count());

  *out_n = static_cast<int32_t>(RunSample(job));
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
    if (wtree != nullptr) {
      // occ_tree[0] counts the occupied items of zero sampling weight, which
      // are not eligible (indexes.zero_weight_count).
      if (occupied[s] && !(wtree[p + s] > 0.0f)) --tree[0];
      if (!(in_weight[i] > 0.0f)) ++tree[0];
    }
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
// invalid_priorities counter), occ_tree (its node 0, the zero-weight count).
// Applied only where the slot still holds the key; the last row for a slot
// wins; negative / NaN / inf priorities are stored as 0 and counted (among
// the winning rows), as ops.update_priorities.
ffi::Error UpdatePrioritiesImpl(ffi::RemainingArgs args, ffi::RemainingRets rets,
                                int64_t capacity, ffi::Span<const int64_t> ledger_layout) {
  UpdateJob job;
  auto slots_buf = args.get<ffi::AnyBuffer>(0).value();
  job.k = static_cast<int64_t>(slots_buf.element_count());
  job.slots = static_cast<const int32_t*>(slots_buf.untyped_data());
  job.keys = Ptr<uint32_t>(args, 1);
  job.priorities = Ptr<float>(args, 2);
  auto w_buf = args.get<ffi::AnyBuffer>(3).value();
  job.weights =
      w_buf.element_count() > 0 ? static_cast<const float*>(w_buf.untyped_data()) : nullptr;
  job.capacity = capacity;
  job.occupied = Ptr<bool>(rets, 0);
  job.item_keys = Ptr<uint32_t>(rets, 1);
  job.priority = Ptr<float>(rets, 2);
  auto wt_buf = rets.get<ffi::AnyBuffer>(3).value();
  job.wtree = wt_buf->element_count() > 0 ? static_cast<float*>(wt_buf->untyped_data())
                                          : nullptr;
  job.p = static_cast<int64_t>(wt_buf->element_count()) / 2;
  if (!OpenLedger(rets, 4, ledger_layout, &job.ledger)) {
    return LedgerMismatch("funcreplay_update_priorities");
  }
  if (job.wtree != nullptr) job.zero_count = Ptr<int32_t>(rets, 5);
  RunUpdatePriorities(job);
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
