// Binding helpers of the FFI handlers (kernels.cc): the typed buffers of the
// calling layout, the ten state columns as typed operands and results, and
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

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace funcreplay {

using Bool1 = ffi::Buffer<ffi::PRED, 1>;
using U32_0 = ffi::Buffer<ffi::U32, 0>;
using U32_1 = ffi::Buffer<ffi::U32, 1>;
using S32_1 = ffi::Buffer<ffi::S32, 1>;
using F32_1 = ffi::Buffer<ffi::F32, 1>;
template <ffi::DataType T>
using Out1 = ffi::ResultBuffer<T, 1>;

// The ten state columns of the sample and insert kernels, in TableState's
// order (native/sample.py, native/insert.py): occupied bool[C], key uint32[C],
// version int32[C], times_sampled int32[C], priority float32[C],
// occ_tree int32[2P], weight_tree float32[2P] or [0] (not prioritized),
// ledger uint32[L], version_hist int32[V], version_bounds int32[3] (V > 0)
// or [0]. Each is an operand aliased to the result of the same column; the
// kernels read and write through the results, so the handlers leave the
// operands unnamed (their types are still checked).
template <typename B>
inline auto StateArgs(B&& binding) {
  return std::move(binding).template Arg<Bool1>().template Arg<U32_1>().template Arg<S32_1>()
      .template Arg<S32_1>().template Arg<F32_1>().template Arg<S32_1>().template Arg<F32_1>()
      .template Arg<U32_1>().template Arg<S32_1>().template Arg<S32_1>();
}
template <typename B>
inline auto StateRets(B&& binding) {
  return std::move(binding).template Ret<Bool1>().template Ret<U32_1>().template Ret<S32_1>()
      .template Ret<S32_1>().template Ret<F32_1>().template Ret<S32_1>().template Ret<F32_1>()
      .template Ret<U32_1>().template Ret<S32_1>().template Ret<S32_1>();
}

inline ffi::Error BadOperand(const char* kernel, const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(kernel) + ": " + what);
}

inline ffi::Error LedgerMismatch(const char* kernel) {
  return BadOperand(kernel, "the ledger layout does not fit the ledger operand "
                            "(native.ledger_attr and kernels.cc disagree; rebuild the native "
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

// A variable-length tail entry: ``row`` (B rows, an operand) and ``col`` (the
// table's C rows, a result) of one metadata column or item leaf hold one dtype
// (int32 for metadata: the kernel copies int32 words), B and C leading and the
// same trailing dimensions. The error names the entry; "" if they fit.
inline std::string CheckTail(const std::string& name, const ffi::AnyBuffer& row,
                      const ffi::AnyBuffer& col, int64_t b, int64_t c, bool metadata) {
  const auto r = row.dimensions(), t = col.dimensions();
  bool ok = row.element_type() == col.element_type() && r.size() == t.size() && r.size() > 0 &&
            r[0] == b && t[0] == c &&
            (!metadata || (r.size() == 1 && row.element_type() == ffi::S32));
  for (size_t i = 1; ok && i < r.size(); ++i) ok = r[i] == t[i];
  if (ok) return "";
  return name + ": rows " + Describe(row) + " do not fit the table's " + Describe(col) +
         " (expected " + (metadata ? "S32[B] and S32[C]" : "one dtype, [B, ...] and [C, ...]") +
         " with B = " + std::to_string(b) + ", C = " + std::to_string(c) + ")";
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_FFI_BINDING_H_
