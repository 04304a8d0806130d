// The native executor of trajectory tables (funcreplay/native/trajectory.py):
// two XLA FFI kernels of ``sample``.
//
// funcreplay_window_gather: a trajectory sample draws B window ids (a few XLA
// operations, ~7 us per call here) and then gathers B * L step rows per
// storage leaf. XLA:CPU gathers element by element (~80 us for 64 windows of
// 32 steps of 76 bytes, 2,048 rows), while a window is L consecutive ring
// positions of one env: at most two contiguous runs of memory. This kernel
// copies each window with one or two memcpy per storage leaf straight into
// the output (~11 us). Rows that are not valid are zero bytes, as the
// portable ``jnp.where(valid, rows, 0)``: the same ids give the same bytes.
//
// funcreplay_window_draw (below): the closed-form uniform draw of the ids
// (tables without episode tracking, no masks), bit for bit the portable one.
// The other draws (episode index, prioritized, masked) stay in JAX.
//
// Gather operands: w int32[B] (window ids, each in [0, E * W)), valid bool[B], then
// the storage leaves, each [E, T, ...] (any whole-byte dtype).
// Results: per storage leaf, [B, L, ...] of its dtype.
// Attributes: num_envs E, time_capacity T, sequence_length L, period p
// (window w = env * W + j starts at ring position j * p, W = T / p).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "random.h"
#include "xla_row_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using S32_1 = ffi::Buffer<ffi::S32, 1>;
using U32_1 = ffi::Buffer<ffi::U32, 1>;
using Bool1 = ffi::Buffer<ffi::PRED, 1>;

// Python's (and jnp's) floor modulo for a divisor > 0.
inline int64_t FloorMod(int64_t a, int64_t m) { return ((a % m) + m) % m; }

// The lean uniform draw of a trajectory table without episode tracking
// (funcreplay/core/trajectory/sample.py ``_closed_form``, bit for bit): per env the
// stored windows lie at distances d0, d0 + p, ... up to ``filled`` behind the head
// (d0 = L + ((head - L) mod p)); positions x in [0, n) on stream 0 of the key
// (``uniform_lean.positions``: the C++ ``Positions`` of the item tables' kernels) map
// to (env, distance) through the prefix sum of the per-env counts.
// Operands: key uint32[2] (threefry key data), head int32[E], filled int32[E].
// Results: w int32[B] (window ids; 0 where not valid), valid bool[B], n int32[1]
// (the stored windows).
ffi::Error WindowDrawImpl(U32_1 key, S32_1 head, S32_1 filled, ffi::Result<S32_1> w_out,
                          ffi::Result<Bool1> valid_out, ffi::Result<S32_1> n_out,
                          int64_t time_capacity, int64_t sequence_length, int64_t period,
                          bool replace) {
  const int64_t e = static_cast<int64_t>(head.element_count());
  const int64_t b = static_cast<int64_t>(w_out->element_count());
  const int64_t t = time_capacity, ln = sequence_length, p = period;
  if (key.element_count() != 2 || e < 1 || filled.element_count() != head.element_count() ||
      valid_out->element_count() != static_cast<size_t>(b) || n_out->element_count() != 1 ||
      p < 1 || t % p != 0 || ln < 1 || ln > t) {
    return ffi::Error::InvalidArgument(
        "funcreplay_window_draw: operands do not match the call layout (key uint32[2], "
        "head int32[E], filled int32[E]; w int32[B], valid bool[B], n int32[1])");
  }
  const int32_t* hd = head.typed_data();
  const int32_t* fl = filled.typed_data();
  std::vector<int64_t> d0(e), cnt(e), cs(e);
  int64_t total = 0;
  for (int64_t i = 0; i < e; ++i) {
    d0[i] = ln + FloorMod(hd[i] - ln, p);
    cnt[i] = fl[i] >= d0[i] ? (fl[i] - d0[i]) / p + 1 : 0;
    total += cnt[i];
    cs[i] = total;
  }
  std::vector<int64_t> x(b, 0);
  const int64_t n_valid = funcreplay::Positions(key.typed_data()[0], key.typed_data()[1], 0,
                                                total, b, replace, b, x.data());
  int32_t* w = w_out->typed_data();
  bool* valid = valid_out->typed_data();
  const int64_t per_env = t / p;
  for (int64_t i = 0; i < b; ++i) {
    valid[i] = i < n_valid;
    if (!valid[i]) {
      w[i] = 0;
      continue;
    }
    // env = #{e : cs[e] <= x} (cs is non-decreasing), at most E - 1.
    const int64_t env = std::min<int64_t>(
        std::upper_bound(cs.begin(), cs.end(), x[i]) - cs.begin(), e - 1);
    const int64_t d = d0[env] + (x[i] - (cs[env] - cnt[env])) * p;
    const int64_t start = FloorMod(hd[env] - d, t);
    w[i] = static_cast<int32_t>(env * per_env + start / p);
  }
  n_out->typed_data()[0] = static_cast<int32_t>(total);
  return ffi::Error::Success();
}

// Copies ahead of time the first cache lines of the window this many windows
// ahead: the windows are random places in arrays far larger than the caches.
constexpr int64_t kWindowsAhead = 4;
constexpr int64_t kLine = 64;

ffi::Error WindowGatherImpl(ffi::ThreadPool pool, S32_1 w, Bool1 valid,
                            ffi::RemainingArgs data, ffi::RemainingRets out, int64_t num_envs,
                            int64_t time_capacity, int64_t sequence_length, int64_t period) {
  const int64_t b = static_cast<int64_t>(w.element_count());
  const int64_t e = num_envs, t = time_capacity, ln = sequence_length, p = period;
  if (p < 1 || t % p != 0 || ln < 1 || ln > t || e < 1 ||
      valid.element_count() != static_cast<size_t>(b) || data.size() != out.size()) {
    return ffi::Error::InvalidArgument(
        "funcreplay_window_gather: operands do not match the call layout (w int32[B], "
        "valid bool[B], the storage leaves [E, T, ...], one result [B, L, ...] per leaf)");
  }
  const int64_t n_windows = e * (t / p), per_env = t / p;
  const int32_t* ids = w.typed_data();
  const bool* ok = valid.typed_data();
  for (int64_t i = 0; i < b; ++i) {
    if (ok[i] && (ids[i] < 0 || ids[i] >= n_windows)) {
      return ffi::Error::InvalidArgument(
          "funcreplay_window_gather: window id " + std::to_string(ids[i]) +
          " out of range [0, " + std::to_string(n_windows) + ")");
    }
  }
  struct Leaf {
    const char* src;
    char* dst;
    size_t row, window;  // bytes of one step, of one window (L steps)
  };
  std::vector<Leaf> leaves;
  size_t window_bytes = 0;  // all leaves
  for (size_t d = 0; d < data.size(); ++d) {
    auto src_buf = data.get<ffi::AnyBuffer>(d).value();
    auto dst_buf = out.get<ffi::AnyBuffer>(d).value();
    const size_t src_bytes = src_buf.size_bytes(), dst_bytes = dst_buf->size_bytes();
    if (src_bytes % static_cast<size_t>(e * t) != 0 ||
        dst_bytes != src_bytes / static_cast<size_t>(e * t) * static_cast<size_t>(b * ln)) {
      return ffi::Error::InvalidArgument(
          "funcreplay_window_gather: storage leaf " + std::to_string(d) +
          " and its result disagree on the step's size");
    }
    const size_t row = src_bytes / static_cast<size_t>(e * t);
    leaves.push_back({static_cast<const char*>(src_buf.untyped_data()),
                      static_cast<char*>(dst_buf->untyped_data()), row,
                      row * static_cast<size_t>(ln)});
    window_bytes += row * static_cast<size_t>(ln);
  }
  // Windows lo..hi of every leaf: chunks of windows on this thread and XLA's pool
  // (xla_row_pool.h); each chunk writes its own windows.
  auto copy = [&](int64_t lo, int64_t hi) {
    for (const Leaf& f : leaves) {
      auto first_row = [&](int64_t i) {
        const int64_t env = ids[i] / per_env, start = (ids[i] % per_env) * p;
        return f.src + static_cast<size_t>(env * t + start) * f.row;
      };
      for (int64_t i = lo; i < std::min<int64_t>(lo + kWindowsAhead, hi); ++i) {
        if (ok[i]) __builtin_prefetch(first_row(i));
      }
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t ahead = i + kWindowsAhead;
        if (ahead < hi && ok[ahead]) {
          const char* q = first_row(ahead);
          for (size_t at = 0; at < std::min<size_t>(f.window, 4 * kLine); at += kLine) {
            __builtin_prefetch(q + at);
          }
        }
        char* to = f.dst + static_cast<size_t>(i) * f.window;
        if (!ok[i]) {
          std::memset(to, 0, f.window);
          continue;
        }
        const int64_t env = ids[i] / per_env, start = (ids[i] % per_env) * p;
        const int64_t run = std::min(ln, t - start);  // steps before the ring wraps
        const char* base = f.src + static_cast<size_t>(env * t) * f.row;
        std::memcpy(to, base + static_cast<size_t>(start) * f.row,
                    static_cast<size_t>(run) * f.row);
        if (run < ln) std::memcpy(to + run * f.row, base, static_cast<size_t>(ln - run) * f.row);
      }
    }
  };
  funcreplay::XlaRowPool(pool).For(b, funcreplay::RowsPerChunk(window_bytes), copy);
  return ffi::Error::Success();
}

// The lean uniform draw of a table that tracks episodes
// (funcreplay/core/trajectory/sample.py, ``index.kth``, bit for bit): positions x in
// [0, n) on stream 0 of the key, n = ok_tree[1]; the x-th set bit of ``ok_bits``: a
// descent of the count tree over its 32-bit words (binary here; the portable
// ``kth_with_rank`` takes 3 levels per step, the same word and rank: the first
// child whose running count exceeds the rank, else the last), then the rank-th set
// bit of the word by five popcount halvings; at most N - 1.
// Operands: key uint32[2], ok_bits uint32[words], ok_tree int32[2P].
// Results: w int32[B] (0 where not valid), valid bool[B], n int32[1].
ffi::Error WindowIndexDrawImpl(U32_1 key, U32_1 ok_bits, S32_1 ok_tree,
                               ffi::Result<S32_1> w_out, ffi::Result<Bool1> valid_out,
                               ffi::Result<S32_1> n_out, int64_t num_windows, bool replace) {
  const int64_t b = static_cast<int64_t>(w_out->element_count());
  const int64_t words = static_cast<int64_t>(ok_bits.element_count());
  const int64_t p = static_cast<int64_t>(ok_tree.element_count()) / 2;
  if (key.element_count() != 2 || words < 1 || p < words || (p & (p - 1)) != 0 ||
      valid_out->element_count() != static_cast<size_t>(b) || n_out->element_count() != 1 ||
      num_windows < 1) {
    return ffi::Error::InvalidArgument(
        "funcreplay_window_index_draw: operands do not match the call layout (key "
        "uint32[2], ok_bits uint32[words], ok_tree int32[2P], P >= words a power of two)");
  }
  const uint32_t* bits = ok_bits.typed_data();
  const int32_t* tree = ok_tree.typed_data();
  const int64_t n = tree[1];
  std::vector<int64_t> x(b, 0);
  const int64_t n_valid = funcreplay::Positions(key.typed_data()[0], key.typed_data()[1], 0,
                                                n, b, replace, b, x.data());
  int32_t* w = w_out->typed_data();
  bool* valid = valid_out->typed_data();
  for (int64_t i = 0; i < b; ++i) {
    valid[i] = i < n_valid;
    if (!valid[i]) {
      w[i] = 0;
      continue;
    }
    int64_t k = x[i], node = 1;
    while (node < p) {
      const int64_t left = tree[2 * node];
      if (k < left) {
        node = 2 * node;
      } else {
        k -= left;
        node = 2 * node + 1;
      }
    }
    const int64_t word = node - p;
    const uint32_t v = bits[std::min(word, words - 1)];
    int64_t pos = 0;
    for (int width = 16; width >= 1; width /= 2) {
      const uint32_t low = (v >> pos) & ((1u << width) - 1u);
      const int64_t c = __builtin_popcount(low);
      if (k >= c) {
        k -= c;
        pos += width;
      }
    }
    w[i] = static_cast<int32_t>(std::min(word * 32 + pos, num_windows - 1));
  }
  n_out->typed_data()[0] = static_cast<int32_t>(n);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FuncreplayWindowGather, WindowGatherImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()  // the window copies
                                  .Arg<S32_1>()  // w
                                  .Arg<Bool1>()  // valid
                                  .RemainingArgs()  // storage leaves [E, T, ...]
                                  .RemainingRets()  // [B, L, ...] per leaf
                                  .Attr<int64_t>("num_envs")
                                  .Attr<int64_t>("time_capacity")
                                  .Attr<int64_t>("sequence_length")
                                  .Attr<int64_t>("period"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FuncreplayWindowDraw, WindowDrawImpl,
                              ffi::Ffi::Bind()
                                  .Arg<U32_1>()  // key
                                  .Arg<S32_1>()  // head
                                  .Arg<S32_1>()  // filled
                                  .Ret<S32_1>()  // w
                                  .Ret<Bool1>()  // valid
                                  .Ret<S32_1>()  // n
                                  .Attr<int64_t>("time_capacity")
                                  .Attr<int64_t>("sequence_length")
                                  .Attr<int64_t>("period")
                                  .Attr<bool>("replace"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FuncreplayWindowIndexDraw, WindowIndexDrawImpl,
                              ffi::Ffi::Bind()
                                  .Arg<U32_1>()  // key
                                  .Arg<U32_1>()  // ok_bits
                                  .Arg<S32_1>()  // ok_tree
                                  .Ret<S32_1>()  // w
                                  .Ret<Bool1>()  // valid
                                  .Ret<S32_1>()  // n
                                  .Attr<int64_t>("num_windows")
                                  .Attr<bool>("replace"));
