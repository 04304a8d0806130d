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
// after computing the weights priority**alpha as the jitted program does: in
// integer arithmetic (powers.h, the steps of funcreplay/core/powers.py, with
// its tables), so for every exponent the bits are the program's.
// tests/host/test_direct.py compares the trees bit for bit over many priorities
// and exponents.
// funcreplay/native/direct.py is the Python side and says when this applies.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "common.h"
#include "item_info.h"
#include "powers.h"
#include "priorities_core.h"
#include "sample_core.h"

namespace funcreplay {
namespace {

// The calling layout, defined once: each entry point takes one struct, its
// fields listed here (type, name). funcreplay_direct_layout exports every
// field's name, offset and size and the struct's size, and the Python side
// (host/direct.py, a ctypes.Structure of the same fields) refuses to call
// unless they match: a reordered, retyped or missing field fails loudly at
// load instead of misreading memory.
#define FR_SAMPLE_FIELDS(X)                                                     \
  X(int64_t, abi)              /* kAbiVersion */                                \
  X(int64_t, batch)            /* B rows */                                     \
  X(int64_t, capacity)         /* C slots */                                    \
  X(int64_t, replace)          /* 0 / 1 */                                      \
  X(int64_t, max_times_sampled) /* 0: unlimited */                              \
  X(int64_t, n_data)           /* item fields (signature leaves) */             \
  X(int64_t, version)          /* the learner's policy version (int32) */       \
  X(int64_t, min_valid)        /* fail (ok = 0) below this many eligible */     \
  X(int64_t, max_staleness)    /* -1: no staleness limit */                     \
  X(int64_t, min_size)         /* rate limiter: min_size_to_sample */           \
  X(int64_t, has_min_diff)     /* rate limiter: 0 when min_diff is -inf */      \
  X(int64_t, q)                /* rate limiter: samples_per_insert = p / q */   \
  X(int64_t, q_min)            /* rate limiter: ceil(min_diff * q) */           \
  X(int64_t, tree_nodes)       /* 2P (count tree; weight tree if prioritized) */\
  X(int64_t, hist_size)        /* V (0 without staleness) */                    \
  X(int64_t, ledger_words)     /* words of the ledger */                        \
  X(int64_t, out_bytes)        /* bytes of the output buffer */                 \
  X(int64_t, ring)             /* 1: a table without holes (TableSpec.holes) */ \
  X(const int64_t*, row_bytes) /* [n_data] bytes of each item field */          \
  X(const int64_t*, src_stride) /* [n_data] bytes from slot to slot of each */   \
  X(const int64_t*, packed)    /* [n_data + 9] packed offsets */                \
  X(const int64_t*, ledger_layout) /* [kLNumEntries + 3] */                     \
  X(uint32_t*, key)            /* uint32[2] threefry key, advanced in place */  \
  X(bool*, occupied)           /* bool[C] */                                    \
  X(uint32_t*, item_info)      /* uint32[C, 4] (item_info.h) */                 \
  X(int32_t*, occ_tree)        /* int32[2P] */                                  \
  X(float*, weight_tree)       /* float32[2P] or null (uniform) */              \
  X(uint32_t*, ledger)         /* uint32[L] */                                  \
  X(int32_t*, hist)            /* int32[V] or null */                           \
  X(int32_t*, bounds)          /* int32[3] or null */                           \
  X(int32_t*, pindex)          /* int32[2, C + 1] or null (position_index.h) */ \
  X(char*, out)                /* uint8[out_bytes] */                           \
  X(const char* const*, data)  /* n_data pointers: each field of slot 0 */     \
  X(int32_t*, flags)           /* int32[3] out: ok, limiter ok, eligible count */

#define FR_UPDATE_FIELDS(X)                                                     \
  X(int64_t, abi)              /* kAbiVersion */                                \
  X(int64_t, capacity)         /* C slots */                                    \
  X(int64_t, tree_nodes)       /* 2P nodes of the weight tree (0: uniform) */   \
  X(int64_t, alpha_bits)       /* float32 bits of the priority exponent */      \
  X(const uint32_t*, pow_words) /* uint32[kPowWords]: powers.constants() */     \
  X(int64_t, ledger_words)     /* words of the ledger */                        \
  X(const int64_t*, ledger_layout) /* [kLNumEntries + 3] */                     \
  X(int64_t, k)                /* rows */                                       \
  X(const int32_t*, slots)     /* int32[K] */                                   \
  X(const uint32_t*, row_keys) /* uint32[K] */                                  \
  X(const float*, priorities)  /* float32[K], as given */                       \
  X(const bool*, occupied)     /* the state: bool[C] */                         \
  X(uint32_t*, item_info)      /* uint32[C, 4] (item_info.h) */                 \
  X(float*, weight_tree)       /* float32[2P] or null */                        \
  X(int32_t*, occ_tree)        /* int32[2P] (node 0: zero-weight count) */      \
  X(uint32_t*, ledger)         /* uint32[L] */

#define FR_DECLARE(type, name) type name;
struct DirectSample { FR_SAMPLE_FIELDS(FR_DECLARE) };
struct DirectUpdate { FR_UPDATE_FIELDS(FR_DECLARE) };
#undef FR_DECLARE

// 7: the four per-slot columns became one item_info pointer (funcreplay/core/item_info.py).
// 9: the position index (TableSpec.position_index).
constexpr int64_t kAbiVersion = 9;

// "name:offset:size;..." then "sizeof:N".
#define FR_DESCRIBE(type, name)                                                  \
  out += std::string(#name) + ":" + std::to_string(offsetof(Struct, name)) + ":" + \
         std::to_string(sizeof(type)) + ";";
template <typename Struct>
std::string Describe();
template <>
std::string Describe<DirectSample>() {
  using Struct = DirectSample;
  std::string out;
  FR_SAMPLE_FIELDS(FR_DESCRIBE)
  return out + "sizeof:" + std::to_string(sizeof(Struct)) + ";abi:" + std::to_string(kAbiVersion);
}
template <>
std::string Describe<DirectUpdate>() {
  using Struct = DirectUpdate;
  std::string out;
  FR_UPDATE_FIELDS(FR_DESCRIBE)
  return out + "sizeof:" + std::to_string(sizeof(Struct)) + ";abi:" + std::to_string(kAbiVersion);
}
#undef FR_DESCRIBE

// XLA:CPU runs its programs (the FFI kernels included) with denormals flushed
// to zero (FTZ/DAZ); the direct path sets the same mode for its float work
// (tree descents, probabilities) so that both give the same bits.
class ScopedFlushDenormal {
 public:
#if defined(__SSE__)
  ScopedFlushDenormal() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~ScopedFlushDenormal() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

}  // namespace
}  // namespace funcreplay

using namespace funcreplay;  // NOLINT

// The calling layouts: which = 0 (sample) or 1 (priority update).
extern "C" const char* funcreplay_direct_layout(int which) {
  static const std::string sample = Describe<DirectSample>();
  static const std::string update = Describe<DirectUpdate>();
  return which == 0 ? sample.c_str() : update.c_str();
}

// Samples cfg.batch rows into cfg.out (packed layout) and updates the state in
// place, exactly as the jitted Table sample with the native kernel; cfg.flags
// gets ok, rate limiter ok, eligible count, as that program returns them.
// Not ok (the limiter or min_valid refused): cfg.out, the key and the state are
// left untouched.
// Returns 0, or 1 (ABI mismatch), 2 (ledger layout), 3 (packed layout): the
// state is untouched in those cases.
extern "C" int funcreplay_direct_sample(const DirectSample* cfg_ptr) {
  const DirectSample& cfg = *cfg_ptr;
  if (cfg.abi != kAbiVersion) return 1;
  ScopedFlushDenormal flush;
  const int64_t b = cfg.batch, c = cfg.capacity;
  const size_t n_data = static_cast<size_t>(cfg.n_data);

  SampleJob job;
  job.batch = b;
  job.capacity = c;
  job.replace = cfg.replace != 0;
  job.max_times_sampled = cfg.max_times_sampled;
  job.max_staleness = cfg.max_staleness;
  job.ring = cfg.ring != 0;
  job.has_version = true;  // a Table always samples at a version
  job.split_key = true;    // and keeps a key sequence
  job.key = cfg.key;
  job.version = static_cast<int32_t>(cfg.version);
  job.occupied = cfg.occupied;
  job.info = ItemInfo(cfg.item_info);
  job.tree = cfg.occ_tree;
  job.p = cfg.tree_nodes / 2;
  job.wtree = cfg.weight_tree;
  if (!job.ledger.Open(cfg.ledger, cfg.ledger_words, cfg.ledger_layout, kLNumEntries + 3)) {
    return 2;
  }
  job.index.v = cfg.hist_size;
  job.index.hist = cfg.hist;
  job.index.bounds = cfg.bounds;
  job.pindex.Bind(cfg.pindex, c);
  job.src.resize(n_data);
  job.src_stride.resize(n_data);
  job.row_bytes.resize(n_data);
  for (size_t d = 0; d < n_data; ++d) {
    job.src[d] = cfg.data[d];
    job.src_stride[d] = static_cast<size_t>(cfg.src_stride[d]);
    job.row_bytes[d] = static_cast<size_t>(cfg.row_bytes[d]);
  }
  char* columns[8] = {};
  if (!BindPacked(cfg.out, cfg.out_bytes, cfg.packed, n_data + 9, b, job.row_bytes, &job.rows,
                  columns)) {
    return 3;
  }
  job.BindColumns(columns);

  // The jitted Table program's gate (host/programs.py): the eligible count
  // from the shared prologue, then the rate limiter (exact integers,
  // rate_limiters.can_sample) and min_valid.
  SamplePrologue(job);
  const int32_t cnt = job.num_eligible;
  const int64_t n_valid = job.replace ? (cnt > 0 ? b : 0) : std::min<int64_t>(cnt, b);
  bool limiter_ok = job.tree[1] >= cfg.min_size;
  if (cfg.has_min_diff != 0) {
    const int64_t diff = job.ledger.GetInt(kLLimiterDiff);
    limiter_ok = limiter_ok && diff - cfg.q * n_valid >= cfg.q_min;
  }
  const bool ok = limiter_ok && cnt >= cfg.min_valid;
  // Refused, nothing runs: the caller's buffer (``out``, which may hold the batch of an
  // earlier call) and the key stay as they were; the jitted path copies a batch into
  // ``out`` only on success too (host/table_sampling.py).
  if (ok) {
    job.enabled = true;
    RunSample(job);  // the prologue already ran: its results are kept
    std::memcpy(columns[7], &cnt, sizeof cnt);
    cfg.key[0] = job.next_key[0];
    cfg.key[1] = job.next_key[1];
  }
  cfg.flags[0] = ok ? 1 : 0;
  cfg.flags[1] = limiter_ok ? 1 : 0;
  cfg.flags[2] = cnt;
  return 0;
}

// Applies cfg.k priority updates to the state in place, exactly as the jitted
// Table.update_priorities with the native kernel. Returns 0, or 1 (ABI
// mismatch), 2 (ledger layout): the state is untouched in those cases.
extern "C" int funcreplay_direct_update_priorities(const DirectUpdate* cfg_ptr) {
  const DirectUpdate& cfg = *cfg_ptr;
  if (cfg.abi != kAbiVersion) return 1;
  UpdateJob job;
  if (!job.ledger.Open(cfg.ledger, cfg.ledger_words, cfg.ledger_layout, kLNumEntries + 3)) {
    return 2;
  }
  const int64_t k = cfg.k;
  job.k = k;
  job.slots = cfg.slots;
  job.keys = cfg.row_keys;
  job.priorities = cfg.priorities;
  job.capacity = cfg.capacity;
  job.occupied = cfg.occupied;
  job.info = ItemInfo(cfg.item_info);
  std::vector<float> weights;
  if (cfg.tree_nodes > 0) {
    // The jitted update's weights (native/priorities.py): the sanitized
    // priority, then indexes.sample_weight (powers.power). Table still sends
    // calls with a denormal priority to the jitted update (direct.py).
    float alpha;
    const uint32_t bits = static_cast<uint32_t>(cfg.alpha_bits);
    std::memcpy(&alpha, &bits, sizeof alpha);
    const PowParams pow = MakePowParams(cfg.pow_words, alpha);
    weights.resize(static_cast<size_t>(k));
    for (int64_t i = 0; i < k; ++i) {
      const float x = job.priorities[i];
      weights[i] = PowerWeight(BadPriority(x) ? 0.0f : x, pow);
    }
    job.weights = weights.data();
    job.wtree = static_cast<float*>(cfg.weight_tree);
    job.p = cfg.tree_nodes / 2;
    job.zero_count = static_cast<int32_t*>(cfg.occ_tree);
  }
  RunUpdatePriorities(job);
  return 0;
}

// item_info.h's layout, "key:0;version:1;times_sampled:2;priority:3;width:4":
// funcreplay/native/build.py compares it with funcreplay/core/item_info.py's
// COLUMNS and WIDTH before registering the kernels (no drift between the two).
extern "C" const char* funcreplay_item_info_layout() {
  static const std::string layout =
      "key:" + std::to_string(kInfoKey) + ";version:" + std::to_string(kInfoVersion) +
      ";times_sampled:" + std::to_string(kInfoTimesSampled) +
      ";priority:" + std::to_string(kInfoPriority) + ";width:" + std::to_string(kInfoWidth);
  return layout.c_str();
}

// Test hooks (tests/native/test_native_identity.py): the kernels' random bits, to check them
// against jax.random.bits / jax.random.split and the portable recipe.
extern "C" void funcreplay_stream_words(uint32_t k0, uint32_t k1, uint32_t stream, int64_t n,
                                        uint32_t* hi, uint32_t* lo) {
  StreamWords(k0, k1, stream, n, n, hi, lo);
}

// Test hooks (tests/native/test_native_identity.py): the integer p**alpha and division,
// to check them against core.powers / core.fixedpoint over many inputs.
extern "C" void funcreplay_power_weights(const uint32_t* pow_words, float alpha, int64_t n,
                                         const float* in, float* out) {
  const PowParams pow = MakePowParams(pow_words, alpha);
  for (int64_t i = 0; i < n; ++i) out[i] = PowerWeight(in[i], pow);
}

extern "C" void funcreplay_divide_exact(int64_t n, const float* num, const float* den,
                                        float* out, int32_t long_division) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = long_division ? DivideLong(num[i], den[i]) : DivideExact(num[i], den[i]);
  }
}

extern "C" void funcreplay_split_key(uint32_t k0, uint32_t k1, uint32_t* out) {
  SplitKey(k0, k1, 0, &out[0], &out[1]);
  SplitKey(k0, k1, 1, &out[2], &out[3]);
}

extern "C" int64_t funcreplay_positions(uint32_t k0, uint32_t k1, uint32_t stream, int64_t n,
                                        int64_t b, int replace, int64_t* out) {
  return Positions(k0, k1, stream, n, b, replace != 0, b, out);
}
