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

// Operands of Sample. The fixed ones are typed (dtype and rank checked by
// XLA's FFI binding: a reordered operand is an error, never a misread
// buffer); the state operands follow, each aliased to the result of the same
// position, and the kernel writes through the results.
//   key uint32[2] (threefry key data), params int32[2] [version, enabled],
//   where bool[C] or bool[0];
//   state: occupied bool[C], keys uint32[C], version int32[C],
//   times_sampled int32[C], priority float32[C], occ_tree int32[2P],
//   weight_tree float32[2P] or [0], ledger uint32[L], version_hist int32[V],
//   version_bounds int32[3], then the data leaves [C, ...].
// Results: the state (typed as above, then the data leaves), then the batch
// (the data rows and seven info columns, or one packed uint8 buffer), the
// valid rows int32[], num_eligible int32[], the next key uint32[2].
using Bool1 = ffi::Buffer<ffi::PRED, 1>;
using U32_1 = ffi::Buffer<ffi::U32, 1>;
using S32_1 = ffi::Buffer<ffi::S32, 1>;
using F32_1 = ffi::Buffer<ffi::F32, 1>;
template <ffi::DataType T>
using Out1 = ffi::ResultBuffer<T, 1>;

ffi::Error SampleImpl(U32_1 key, S32_1 params, Bool1 where, ffi::RemainingArgs state_args,
                      Out1<ffi::PRED> occupied, Out1<ffi::U32> keys, Out1<ffi::S32> version,
                      Out1<ffi::S32> times, Out1<ffi::F32> priority, Out1<ffi::S32> occ_tree,
                      Out1<ffi::F32> weight_tree, Out1<ffi::U32> ledger, Out1<ffi::S32> hist,
                      Out1<ffi::S32> bounds, ffi::RemainingRets rets, int64_t batch_size,
                      int64_t capacity, bool replace, int64_t max_times_sampled,
                      bool has_version, int64_t max_staleness, bool split_key,
                      ffi::Span<const int64_t> packed, ffi::Span<const int64_t> ledger_layout,
                      ffi::Span<const int64_t> fields) {
  const int64_t b = batch_size;
  const int64_t c = capacity;
  constexpr size_t kFixedState = 10;  // the typed state results above
  if (state_args.size() < kFixedState || key.element_count() != 2 ||
      params.element_count() != 2 || occupied->element_count() != static_cast<size_t>(c) ||
      (where.element_count() != 0 && where.element_count() != static_cast<size_t>(c))) {
    return ffi::Error::InvalidArgument(
        "funcreplay_sample: operand shapes do not match the call layout (key uint32[2], "
        "params int32[2], where bool[C] or [0], then the state)");
  }
  const size_t n_data = state_args.size() - kFixedState;

  SampleJob job;
  job.batch = b;
  job.capacity = c;
  job.replace = replace;
  job.max_times_sampled = max_times_sampled;
  job.max_staleness = max_staleness;
  job.has_version = has_version;
  job.split_key = split_key;
  job.key = key.typed_data();
  job.version = params.typed_data()[0];
  job.enabled = params.typed_data()[1] != 0;  // false: sample nothing, change nothing
  job.where = where.element_count() > 0 ? where.typed_data() : nullptr;
  job.occupied = occupied->typed_data();
  job.keys = keys->typed_data();
  job.versions = version->typed_data();
  job.times = times->typed_data();
  job.priority = priority->typed_data();
  job.tree = occ_tree->typed_data();
  job.p = static_cast<int64_t>(occ_tree->element_count()) / 2;
  job.wtree = weight_tree->element_count() > 0 ? weight_tree->typed_data() : nullptr;
  if (!job.ledger.Open(ledger->typed_data(), static_cast<int64_t>(ledger->element_count()),
                       ledger_layout.begin(), ledger_layout.size())) {
    return LedgerMismatch("funcreplay_sample");
  }
  job.index.v = static_cast<int64_t>(hist->element_count());
  if (job.index.v > 0) {
    job.index.hist = hist->typed_data();
    job.index.bounds = bounds->typed_data();
  }
  // ``fields``: [] when every item leaf is its own state array; with packed rows
  // (one uint32[C, R] state array) the word offsets of the item's leaves in a row,
  // 0 = f_0 < f_1 < ... < f_n = R (funcreplay/core/storage.py).
  const size_t n_fields = fields.size() == 0 ? n_data : fields.size() - 1;
  if (fields.size() > 0) {
    bool ok = n_data == 1 && fields.size() >= 2 && fields[0] == 0;
    for (size_t j = 1; ok && j < fields.size(); ++j) ok = fields[j] > fields[j - 1];
    if (!ok || rets.get<ffi::AnyBuffer>(0).value()->size_bytes() !=
                   static_cast<size_t>(c * fields[n_fields]) * sizeof(uint32_t)) {
      return ffi::Error::InvalidArgument(
          "funcreplay_sample: packed rows need one uint32[C, R] data array and increasing "
          "word offsets 0 = f_0 < ... < f_n = R");
    }
  }
  job.src.resize(n_fields);
  job.src_stride.resize(n_fields);
  job.row_bytes.resize(n_fields);
  const char* words = fields.size() == 0 ? nullptr : static_cast<const char*>(
      rets.get<ffi::AnyBuffer>(0).value()->untyped_data());
  for (size_t d = 0; d < n_fields; ++d) {
    if (words != nullptr) {
      job.src[d] = words + fields[d] * sizeof(uint32_t);
      job.src_stride[d] = static_cast<size_t>(fields[n_fields]) * sizeof(uint32_t);
      job.row_bytes[d] = static_cast<size_t>(fields[d + 1] - fields[d]) * sizeof(uint32_t);
    } else {
      auto leaf = rets.get<ffi::AnyBuffer>(d).value();
      job.src[d] = static_cast<const char*>(leaf->untyped_data());
      job.row_bytes[d] = job.src_stride[d] = c > 0 ? leaf->size_bytes() / c : 0;
    }
  }

  // Outputs after the state: the rows and info columns as separate arrays, or
  // (``packed`` = byte offsets of the n_data leaves, valid, the six info
  // columns, num_eligible, then the total size) all in one uint8 buffer
  // (funcreplay/packing.py's layout). packed = [-1]: separate arrays.
  const bool is_packed = !(packed.size() == 1 && packed[0] == -1);
  size_t o = n_data;
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
  } else {
    job.rows.resize(n_fields);
    for (size_t d = 0; d < n_fields; ++d) {
      job.rows[d] = static_cast<char*>(rets.get<ffi::AnyBuffer>(o++).value()->untyped_data());
    }
    for (size_t j = 0; j < 7; ++j) {
      columns[j] = static_cast<char*>(rets.get<ffi::AnyBuffer>(o++).value()->untyped_data());
    }
  }
  if (rets.size() != o + 3) {
    return ffi::Error::InvalidArgument("funcreplay_sample: wrong number of results");
  }
  job.BindColumns(columns);
  int32_t* out_n = Ptr<int32_t>(rets, o++);
  int32_t* out_eligible = Ptr<int32_t>(rets, o++);
  uint32_t* next_key = Ptr<uint32_t>(rets, o++);

  *out_n = static_cast<int32_t>(RunSample(job));
  *out_eligible = job.num_eligible;
  if (is_packed) std::memcpy(columns[7], &job.num_eligible, sizeof(int32_t));
  next_key[0] = job.next_key[0];
  next_key[1] = job.next_key[1];
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
                                  .Arg<U32_1>()    // key
                                  .Arg<S32_1>()    // params
                                  .Arg<Bool1>()    // where
                                  .RemainingArgs()  // the state (aliased)
                                  .Ret<Bool1>()    // occupied
                                  .Ret<U32_1>()    // keys
                                  .Ret<S32_1>()    // version
                                  .Ret<S32_1>()    // times_sampled
                                  .Ret<F32_1>()    // priority
                                  .Ret<S32_1>()    // occ_tree
                                  .Ret<F32_1>()    // weight_tree
                                  .Ret<U32_1>()    // ledger
                                  .Ret<S32_1>()    // version_hist
                                  .Ret<S32_1>()    // version_bounds
                                  .RemainingRets()  // data leaves, the batch, n, eligible, key
                                  .Attr<int64_t>("batch_size")
                                  .Attr<int64_t>("capacity")
                                  .Attr<bool>("replace")
                                  .Attr<int64_t>("max_times_sampled")
                                  .Attr<bool>("has_version")
                                  .Attr<int64_t>("max_staleness")
                                  .Attr<bool>("split_key")
                                  .Attr<ffi::Span<const int64_t>>("packed")
                                  .Attr<ffi::Span<const int64_t>>("ledger")
                                  .Attr<ffi::Span<const int64_t>>("fields"));

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
