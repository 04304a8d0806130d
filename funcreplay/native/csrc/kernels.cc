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
// One checked calling layout (issue 24): every fixed operand but the aliased
// state (the rows) and every fixed result (the state columns) is a typed
// ffi::Buffer<dtype, rank>, so XLA's binding checks its dtype and rank
// before the kernel runs, and an operand passed in the wrong place is an error
// ("Failed to decode all FFI handler operands (bad operands at: i)", i counting
// the entries of the handler's binding in order), never a misread buffer. The
// state operands, each aliased to a typed result, are checked through it
// (kStateColumns in ffi_binding.h says why); they and the variable-length
// tails (item leaves, metadata columns, the batch) are RemainingArgs /
// RemainingRets, which the kernels check themselves, with every element
// count, naming the operand that does not fit.
//
// The kernels' bodies are plain C++ over raw pointers, shared with the direct
// host path (direct.cc): sample_core.h, insert_core.h, priorities_core.h, over
// common.h. This file binds XLA's buffers to them (helpers: ffi_binding.h).

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "ffi_binding.h"
#include "insert_core.h"
#include "priorities_core.h"
#include "sample_core.h"
#include "xla/ffi/api/ffi.h"

using namespace funcreplay;  // NOLINT: this file is the FFI binding of those pieces

namespace {

// Operands of Sample, in native/sample.py's order: key uint32[2] (threefry
// key data), params int32[2] [version, enabled], where bool[C] or bool[0],
// then the state (aliased): the eight state columns, the data leaves [C, ...].
// Results: the state (StateRets, then the data leaves), then the batch: the
// data rows and kInfoColumns info columns, or one packed uint8 buffer; then
// kTailResults scalars: the valid rows int32[], num_eligible int32[] and the
// next key uint32[2]. XLA's "bad operands at" positions: 0 the thread pool
// (a context, parallel.h), 1 key, 2 params, 3 where, 4 the state operands,
// 5-12 the state results, 13 the rest.
constexpr size_t kInfoColumns = 7;  // valid, slot, key, probability, priority, times, version
constexpr size_t kTailResults = 3;
constexpr const char* kSample = "funcreplay_sample";

ffi::Error SampleImpl(ffi::ThreadPool pool, U32_1 key, S32_1 params, Bool1 where, ffi::RemainingArgs state_args,
                      Out1<ffi::PRED> occupied, OutInfo item_info, Out1<ffi::S32> occ_tree,
                      Out1<ffi::F32> weight_tree, Out1<ffi::U32> ledger, Out1<ffi::S32> hist,
                      Out1<ffi::S32> bounds, OutIndex pindex, ffi::RemainingRets rets,
                      int64_t batch_size,
                      int64_t capacity, bool replace, int64_t max_times_sampled,
                      bool has_version, int64_t max_staleness, bool split_key, bool ring,
                      ffi::Span<const int64_t> packed, ffi::Span<const int64_t> ledger_layout,
                      ffi::Span<const int64_t> fields) {
  const int64_t b = batch_size;
  const int64_t c = capacity;
  if (state_args.size() < kStateColumns) {
    return BadOperand(kSample, "expected the eight state columns after key, params and where");
  }
  const size_t n_data = state_args.size() - kStateColumns;
  // Item fields in the batch: the data arrays, or the leaves packed in one row (fields).
  const size_t n_fields = fields.size() == 0 ? n_data : fields.size() - 1;
  // ``packed`` = [-1]: separate arrays; else the byte offsets of the n_data
  // leaves, valid, the six info columns, num_eligible, then the total size:
  // all in one uint8 buffer (funcreplay/packing.py's layout).
  const bool is_packed = !(packed.size() == 1 && packed[0] == -1);
  const size_t n_batch = is_packed ? 1 : n_fields + kInfoColumns;
  if (rets.size() != n_data + n_batch + kTailResults) {
    return BadOperand(kSample, "expected " + std::to_string(n_data + n_batch + kTailResults) +
                                   " results after the state columns, got " +
                                   std::to_string(rets.size()));
  }
  std::string bad = FirstMismatch(
      {{"key", key.element_count(), 2}, {"params", params.element_count(), 2},
       {"where", where.element_count(), where.element_count() ? c : 0},
       {"occupied", occupied->element_count(), c},
       {"position_index", pindex->element_count(), pindex->element_count() ? 2 * (c + 1) : 0}});
  if (bad.empty()) bad = CheckItemInfo(*item_info, c);
  if (!bad.empty()) return BadOperand(kSample, bad);

  SampleJob job;
  const XlaRowPool rows_pool(pool);
  job.pool = &rows_pool;
  job.batch = b;
  job.capacity = c;
  job.replace = replace;
  job.max_times_sampled = max_times_sampled;
  job.max_staleness = max_staleness;
  job.has_version = has_version;
  job.split_key = split_key;
  job.ring = ring;
  job.key = key.typed_data();
  job.version = params.typed_data()[0];
  job.enabled = params.typed_data()[1] != 0;  // false: sample nothing, change nothing
  job.where = where.element_count() > 0 ? where.typed_data() : nullptr;
  job.occupied = occupied->typed_data();
  job.info = ItemInfo(item_info->typed_data());
  job.tree = occ_tree->typed_data();
  job.p = static_cast<int64_t>(occ_tree->element_count()) / 2;
  job.wtree = weight_tree->element_count() > 0 ? weight_tree->typed_data() : nullptr;
  if (!job.ledger.Open(ledger->typed_data(), static_cast<int64_t>(ledger->element_count()),
                       ledger_layout.begin(), ledger_layout.size())) {
    return LedgerMismatch(kSample);
  }
  job.index.v = static_cast<int64_t>(hist->element_count());
  if (job.index.v > 0) {
    job.index.hist = hist->typed_data();
    job.index.bounds = bounds->typed_data();
  }
  job.pindex.Bind(pindex->element_count() ? pindex->typed_data() : nullptr, c);
  std::vector<std::pair<const char*, size_t>> leaves(n_data);  // [C, ...] state arrays
  for (size_t d = 0; d < n_data; ++d) {
    auto leaf = rets.get<ffi::AnyBuffer>(d).value();
    leaves[d] = {static_cast<const char*>(leaf->untyped_data()), leaf->size_bytes()};
  }
  if (!job.BindFields(leaves, fields.begin(), fields.size())) {
    return BadOperand(kSample, "packed rows need one uint32[C, R] data array and word "
                               "offsets 0 = f_0 < ... < f_n = R (attribute fields)");
  }

  // Outputs after the state: the rows and info columns as separate arrays, or
  // all in one packed buffer. num_eligible is written to both places.
  size_t o = n_data;
  char* columns[kInfoColumns + 1] = {};  // the info columns, then num_eligible
  if (is_packed) {  // the layout comes from funcreplay/packing.py; check it anyway
    auto buf = rets.get<ffi::AnyBuffer>(o++).value();
    if (!BindPacked(static_cast<char*>(buf->untyped_data()),
                    static_cast<int64_t>(buf->size_bytes()), packed.begin(), packed.size(), b,
                    job.row_bytes, &job.rows, columns)) {
      return BadOperand(kSample, "the packed layout does not match the operands (expected "
                                 "n_fields + 9 increasing byte offsets ending with the output's "
                                 "size)");
    }
  } else {
    job.rows.resize(n_fields);
    for (size_t d = 0; d < n_fields; ++d) {
      job.rows[d] = static_cast<char*>(rets.get<ffi::AnyBuffer>(o++).value()->untyped_data());
    }
    for (size_t j = 0; j < kInfoColumns; ++j) {
      columns[j] = static_cast<char*>(rets.get<ffi::AnyBuffer>(o++).value()->untyped_data());
    }
  }
  job.BindColumns(columns);
  auto out = [&rets](size_t i) { return rets.get<ffi::AnyBuffer>(i).value()->untyped_data(); };
  int32_t* out_n = static_cast<int32_t*>(out(o));
  int32_t* out_eligible = static_cast<int32_t*>(out(o + 1));
  uint32_t* next_key = static_cast<uint32_t*>(out(o + 2));

  *out_n = static_cast<int32_t>(RunSample(job));
  *out_eligible = job.num_eligible;
  if (is_packed) std::memcpy(columns[kInfoColumns], &job.num_eligible, sizeof(int32_t));
  next_key[0] = job.next_key[0];
  next_key[1] = job.next_key[1];
  return ffi::Error::Success();
}

// Operands of FifoInsert, in native/insert.py's order. The rows (B = batch):
// mask bool[B], version int32[B], priority float32[B], weight float32[B]
// (priority**alpha for a prioritized sampler, else float32[0]), n_bad
// uint32[] (invalid priorities among the rows, counted here); then the rest:
// the variable tail of n_meta + n_data rows (metadata rows int32[B], item
// leaves [B, ...]), then the state (aliased): the eight state columns, the
// metadata columns int32[C] and data leaves [C, ...]. Results: the eight state
// columns (StateRets), then the metadata columns and data leaves.
// XLA's "bad operands at" positions: 0 mask, 1 version, 2 priority, 3 weight,
// 4 n_bad, 5 the rest, 6-13 the state results.
constexpr const char* kInsert = "funcreplay_fifo_insert";

ffi::Error FifoInsertImpl(Bool1 mask, S32_1 in_version, F32_1 in_priority, F32_1 in_weight,
                          U32_0 n_bad, ffi::RemainingArgs rest, Out1<ffi::PRED> occupied,
                          OutInfo item_info, Out1<ffi::S32> occ_tree, Out1<ffi::F32> weight_tree,
                          Out1<ffi::U32> ledger, Out1<ffi::S32> hist, Out1<ffi::S32> bounds,
                          OutIndex pindex, ffi::RemainingRets columns, int64_t capacity, int64_t n_meta,
                          int64_t n_data, ffi::Span<const int64_t> ledger_layout) {
  const int64_t c = capacity;
  const int64_t b = static_cast<int64_t>(mask.element_count());
  const size_t n_tail = static_cast<size_t>(n_meta + n_data);
  if (n_meta < 0 || n_data < 0 || rest.size() != 2 * n_tail + kStateColumns ||
      columns.size() != n_tail) {
    return BadOperand(kInsert, "expected n_meta + n_data = " + std::to_string(n_tail) +
                                   " rows, the eight state columns and " +
                                   std::to_string(n_tail) + " more after n_bad, and " +
                                   std::to_string(n_tail) + " results after the state "
                                   "columns; got " + std::to_string(rest.size()) +
                                   " operands and " + std::to_string(columns.size()) +
                                   " results");
  }
  const int64_t n_tree = static_cast<int64_t>(occ_tree->element_count());
  const int64_t v = static_cast<int64_t>(hist->element_count());
  const bool prioritized = weight_tree->element_count() > 0;
  std::string bad = FirstMismatch(
      {{"version", in_version.element_count(), b}, {"priority", in_priority.element_count(), b},
       {"weight", in_weight.element_count(), prioritized ? b : 0},
       {"occupied column", occupied->element_count(), c},
       {"weight_tree", weight_tree->element_count(), prioritized ? n_tree : 0},
       {"version_bounds", bounds->element_count(), v > 0 ? 3 : 0},
       {"position_index", pindex->element_count(), pindex->element_count() ? 2 * (c + 1) : 0}});
  if (bad.empty()) bad = CheckItemInfo(*item_info, c);
  if (!bad.empty()) return BadOperand(kInsert, bad);
  if (n_tree < 2 * c || n_tree % 2 != 0 || (v & (v - 1)) != 0) {
    return BadOperand(kInsert, "operand occ_tree has " + std::to_string(n_tree) +
                                   " elements (expected 2P >= 2C) and version_hist " +
                                   std::to_string(v) + " (expected a power of two, or 0)");
  }

  InsertJob job;
  job.b = b;
  job.mask = mask.typed_data();
  job.in_version = in_version.typed_data();
  job.in_priority = in_priority.typed_data();
  job.in_weight = prioritized ? in_weight.typed_data() : nullptr;
  job.n_bad = *n_bad.typed_data();
  job.capacity = c;
  job.occupied = occupied->typed_data();
  job.info = ItemInfo(item_info->typed_data());
  job.tree = occ_tree->typed_data();
  job.p = n_tree / 2;
  job.wtree = prioritized ? weight_tree->typed_data() : nullptr;
  if (!job.ledger.Open(ledger->typed_data(), static_cast<int64_t>(ledger->element_count()),
                       ledger_layout.begin(), ledger_layout.size())) {
    return LedgerMismatch(kInsert);
  }
  job.index.v = v;
  if (v > 0) {
    job.index.hist = hist->typed_data();
    job.index.bounds = bounds->typed_data();
  }
  job.pindex.Bind(pindex->element_count() ? pindex->typed_data() : nullptr, c);
  job.in_meta.reserve(n_meta);
  job.meta.reserve(n_meta);
  job.in_data.reserve(n_data);
  job.data.reserve(n_data);
  job.row_bytes.reserve(n_data);
  for (size_t i = 0; i < n_tail; ++i) {  // checked as bound; nothing is written before the end
    const ffi::AnyBuffer row_buf = rest.get<ffi::AnyBuffer>(i).value();
    auto col = columns.get<ffi::AnyBuffer>(i).value();
    const std::string bad_tail = CheckTail(i, n_meta, row_buf, *col, b, c);
    if (!bad_tail.empty()) return BadOperand(kInsert, bad_tail);
    const void* row = row_buf.untyped_data();
    if (static_cast<int64_t>(i) < n_meta) {
      job.in_meta.push_back(static_cast<const int32_t*>(row));
      job.meta.push_back(static_cast<int32_t*>(col->untyped_data()));
    } else {
      job.in_data.push_back(static_cast<const char*>(row));
      job.data.push_back(static_cast<char*>(col->untyped_data()));
      job.row_bytes.push_back(c > 0 ? col->size_bytes() / c : 0);
    }
  }
  RunFifoInsert(job);
  return ffi::Error::Success();
}

// Operands of UpdatePriorities, in native/priorities.py's order, all fixed:
// slots int32[K], keys uint32[K], priorities float32[K] (as given), weights
// float32[K] (priority**alpha of the sanitized priorities, prioritized
// sampler) or float32[0]; then the state (aliased, checked through the typed
// results, as kStateColumns in ffi_binding.h): occupied bool[C], item_info
// uint32[C, 4] (the keys checked, the priorities written), weight_tree
// float32[2P] or [0] (not prioritized), ledger uint32[L] (max_priority and the
// invalid_priorities counter), occ_tree int32[2P] (its node 0, the
// zero-weight count). Semantics: RunUpdatePriorities (priorities_core.h).
// XLA's "bad operands at" positions: 0-3 the rows, 4 the state operands,
// 5-9 the results, in the orders above.
constexpr const char* kUpdate = "funcreplay_update_priorities";
constexpr size_t kUpdateStateColumns = 5;  // the state operands above

ffi::Error UpdatePrioritiesImpl(S32_1 slots, U32_1 keys, F32_1 priorities, F32_1 weights,
                                ffi::RemainingArgs state_args, Out1<ffi::PRED> occupied,
                                OutInfo item_info, Out1<ffi::F32> weight_tree,
                                Out1<ffi::U32> ledger, Out1<ffi::S32> occ_tree, int64_t capacity,
                                ffi::Span<const int64_t> ledger_layout) {
  const int64_t k = static_cast<int64_t>(slots.element_count());
  const int64_t c = capacity;
  const int64_t n_tree = static_cast<int64_t>(weight_tree->element_count());
  const bool prioritized = n_tree > 0;
  if (state_args.size() != kUpdateStateColumns) {
    return BadOperand(kUpdate, "expected the five state columns after the weights");
  }
  std::string bad = FirstMismatch(
      {{"keys", keys.element_count(), k}, {"priorities", priorities.element_count(), k},
       {"weights", weights.element_count(), prioritized ? k : 0},
       {"occupied column", occupied->element_count(), c}});
  if (bad.empty()) bad = CheckItemInfo(*item_info, c);
  if (!bad.empty()) return BadOperand(kUpdate, bad);
  if (prioritized && (n_tree < 2 * c || n_tree % 2 != 0 ||
                      static_cast<int64_t>(occ_tree->element_count()) != n_tree)) {
    return BadOperand(kUpdate, "operand weight_tree has " + std::to_string(n_tree) +
                                   " elements (expected 2P >= 2C, as occ_tree's " +
                                   std::to_string(occ_tree->element_count()) + ")");
  }

  UpdateJob job;
  job.k = k;
  job.slots = slots.typed_data();
  job.keys = keys.typed_data();
  job.priorities = priorities.typed_data();
  job.weights = prioritized ? weights.typed_data() : nullptr;
  job.capacity = c;
  job.occupied = occupied->typed_data();
  job.info = ItemInfo(item_info->typed_data());
  job.wtree = prioritized ? weight_tree->typed_data() : nullptr;
  job.p = n_tree / 2;
  if (!job.ledger.Open(ledger->typed_data(), static_cast<int64_t>(ledger->element_count()),
                       ledger_layout.begin(), ledger_layout.size())) {
    return LedgerMismatch(kUpdate);
  }
  if (prioritized) job.zero_count = occ_tree->typed_data();
  RunUpdatePriorities(job);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FuncreplaySample, SampleImpl,
                              StateRets(ffi::Ffi::Bind()
                                            .Ctx<ffi::ThreadPool>()  // the row copies
                                            .Arg<U32_1>()     // key
                                            .Arg<S32_1>()     // params
                                            .Arg<Bool1>()     // where
                                            .RemainingArgs())  // the state (aliased)
                                  .RemainingRets()  // data leaves, the batch, n, eligible, key
                                  .Attr<int64_t>("batch_size")
                                  .Attr<int64_t>("capacity")
                                  .Attr<bool>("replace")
                                  .Attr<int64_t>("max_times_sampled")
                                  .Attr<bool>("has_version")
                                  .Attr<int64_t>("max_staleness")
                                  .Attr<bool>("split_key")
                                  .Attr<bool>("ring")
                                  .Attr<ffi::Span<const int64_t>>("packed")
                                  .Attr<ffi::Span<const int64_t>>("ledger")
                                  .Attr<ffi::Span<const int64_t>>("fields"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FuncreplayFifoInsert, FifoInsertImpl,
                              StateRets(ffi::Ffi::Bind()
                                            .Arg<Bool1>()     // mask
                                            .Arg<S32_1>()     // version
                                            .Arg<F32_1>()     // priority
                                            .Arg<F32_1>()     // weight
                                            .Arg<U32_0>()     // n_bad
                                            .RemainingArgs())  // tail rows, the state (aliased)
                                  .RemainingRets()  // metadata columns, data leaves
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("n_meta")
                                  .Attr<int64_t>("n_data")
                                  .Attr<ffi::Span<const int64_t>>("ledger"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FuncreplayUpdatePriorities, UpdatePrioritiesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<S32_1>()     // slots
                                  .Arg<U32_1>()     // keys
                                  .Arg<F32_1>()     // priorities
                                  .Arg<F32_1>()     // weights
                                  .RemainingArgs()  // the state (aliased)
                                  .Ret<Bool1>()     // occupied
                                  .Ret<U32_2>()     // item_info
                                  .Ret<F32_1>()     // weight_tree
                                  .Ret<U32_1>()     // ledger
                                  .Ret<S32_1>()     // occ_tree
                                  .Attr<int64_t>("capacity")
                                  .Attr<ffi::Span<const int64_t>>("ledger"));
