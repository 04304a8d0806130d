// Binding helpers of the FFI handlers (kernels.cc): the typed buffers of the
// calling layout, the eight state columns as typed results, and
// the checks of what XLA's binding cannot type (element counts, the
// variable-length tails), each naming the operand that does not fit.
#ifndef FUNCREPLAY_NATIVE_FFI_BINDING_H_
#define FUNCREPLAY_NATIVE_FFI_BINDING_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

#include "item_info.h"
#include "xla_row_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace funcreplay {

using Bool1 = ffi::Buffer<ffi::PRED, 1>;
using U32_0 = ffi::Buffer<ffi::U32, 0>;
using U32_1 = ffi::Buffer<ffi::U32, 1>;
using U32_2 = ffi::Buffer<ffi::U32, 2>;  // item_info
using S32_1 = ffi::Buffer<ffi::S32, 1>;
using S32_2 = ffi::Buffer<ffi::S32, 2>;  // position_index
using F32_1 = ffi::Buffer<ffi::F32, 1>;
template <ffi::DataType T>
using Out1 = ffi::ResultBuffer<T, 1>;
using OutInfo = ffi::ResultBuffer<ffi::U32, 2>;  // item_info uint32[C, 4]
using OutIndex = ffi::ResultBuffer<ffi::S32, 2>;  // position_index int32[2, C + 1] or [2, 0]

// The eight state columns of the sample and insert kernels, in TableState's
// order (native/sample.py, native/insert.py): occupied bool[C], item_info
// uint32[C, 4] (key, version, times sampled and priority of each slot:
// item_info.h), occ_tree int32[2P], weight_tree float32[2P] or [0] (not
// prioritized), ledger uint32[L], version_hist int32[V], version_bounds
// int32[3] (V > 0) or [0], position_index int32[2, C + 1] or [2, 0]
// (position_index.h); typed results. Each is also an operand, aliased to
// its result (the kernels write through the results), but for an empty one
// (native.state_aliases: XLA would copy the constant it folds it into), whose
// result is an empty buffer nothing reads or writes. Those operands stay in
// the handlers' RemainingArgs: jax.ffi.ffi_call refuses an alias whose operand
// and result differ in shape or dtype when the call is traced, so the typed
// result checks its operand too, and typing the operand again would only add
// XLA's decoding to every call (~10 ns an operand, measured: an insert of one
// row costs ~0.5 us in all).
constexpr size_t kStateColumns = 8;
template <typename B>
inline auto StateRets(B&& binding) {
  return std::move(binding).template Ret<Bool1>().template Ret<U32_2>().template Ret<S32_1>()
      .template Ret<F32_1>().template Ret<U32_1>().template Ret<S32_1>().template Ret<S32_1>()
      .template Ret<S32_2>();
}

// "" if ``info`` is item_info's uint32[C, kInfoWidth] (the binding checked the
// dtype and the rank), else what is wrong with it, named.
inline std::string CheckItemInfo(const U32_2& info, int64_t c) {
  const auto dims = info.dimensions();
  const int64_t n = static_cast<int64_t>(info.element_count());
  if (n == kInfoWidth * c && dims[1] == kInfoWidth) return "";
  return "operand item_info has " + std::to_string(n) + " elements (shape [" +
         std::to_string(dims[0]) + "," + std::to_string(dims[1]) + "]), expected " +
         std::to_string(kInfoWidth) + " * C = " + std::to_string(kInfoWidth * c) +
         " (uint32[C, " + std::to_string(kInfoWidth) + "], C = " + std::to_string(c) +
         "; funcreplay/core/item_info.py)";
}

inline ffi::Error BadOperand(const char* kernel, const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(kernel) + ": " + what);
}

inline ffi::Error LedgerMismatch(const char* kernel) {
  return BadOperand(kernel, "the ledger layout does not fit the ledger operand "
                            "(native.ledger_attr and common.h disagree; rebuild the native "
                            "kernels)");
}

// One operand's element count and the count the call layout gives it.
struct Count {
  const char* name;
  size_t got;
  int64_t want;
};

// The first operand whose element count differs from the layout's, named; "" if none.
inline std::string FirstMismatch(std::initializer_list<Count> counts) {
  for (const Count& n : counts) {
    if (static_cast<int64_t>(n.got) != n.want) {
      return "operand " + std::string(n.name) + " has " + std::to_string(n.got) +
             " elements, expected " + std::to_string(n.want);
    }
  }
  return "";
}

inline std::string Describe(const ffi::AnyBuffer& buf) {  // e.g. "F32[4,2]"
  std::ostringstream s;
  s << buf.element_type() << "[";
  const auto dims = buf.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? "," : "") << dims[i];
  s << "]";
  return s.str();
}

// Entry ``i`` of the insert's variable-length tail (the first ``n_meta`` are
// metadata columns, the rest item leaves): ``row`` (B rows, an operand) and
// ``col`` (the table's C rows, a result) hold one dtype (int32 for metadata:
// the kernel copies int32 words), B and C leading and the same trailing
// dimensions. The error names the entry; "" if they fit (no string is built
// then: this runs on every call).
inline std::string CheckTail(size_t i, int64_t n_meta, const ffi::AnyBuffer& row,
                             const ffi::AnyBuffer& col, int64_t b, int64_t c) {
  const bool metadata = static_cast<int64_t>(i) < n_meta;
  const auto r = row.dimensions(), t = col.dimensions();
  bool ok = row.element_type() == col.element_type() && r.size() == t.size() && r.size() > 0 &&
            r[0] == b && t[0] == c &&
            (!metadata || (r.size() == 1 && row.element_type() == ffi::S32));
  for (size_t d = 1; ok && d < r.size(); ++d) ok = r[d] == t[d];
  if (ok) return "";
  const std::string name = metadata ? "metadata column " + std::to_string(i)
                                    : "item leaf " + std::to_string(i - n_meta);
  return name + ": rows " + Describe(row) + " do not fit the table's " + Describe(col) +
         " (expected " + (metadata ? "S32[B] and S32[C]" : "one dtype, [B, ...] and [C, ...]") +
         " with B = " + std::to_string(b) + ", C = " + std::to_string(c) + ")";
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_FFI_BINDING_H_
