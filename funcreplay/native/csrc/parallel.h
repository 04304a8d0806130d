// Splitting a batch's rows (their copies; draw.h: the weight and count descents) between
// the calling thread and XLA's intra-op thread pool. The sample's row copies
// are cache misses (a random row of a table much larger than the caches per
// sampled item): one thread keeps only so many in flight, and the XLA program
// around the kernel runs its own gathers on every thread of the pool (on the
// 2-core VM flashbax's gathers take both cores while the kernel took one).
// Which thread copies which row changes no result: every chunk writes its own
// rows and slots (sample_core.h says why the slots are distinct), and what
// sums over the rows (the staleness sum) runs on the calling thread after
// every chunk is done.
#ifndef FUNCREPLAY_NATIVE_PARALLEL_H_
#define FUNCREPLAY_NATIVE_PARALLEL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>

namespace funcreplay {

// Runs ``body(lo, hi)`` over chunks that cover ``[0, n)`` once each. This
// one runs ``body(0, n)`` on the calling thread (the direct host path, and
// a pool of one thread).
class RowPool {
 public:
  virtual ~RowPool() = default;
  // ``grain``: rows a chunk (> 0); a pool runs chunks on other threads only
  // when there are at least two.
  virtual void For(int64_t n, int64_t grain,
                   const std::function<void(int64_t, int64_t)>& body) const {
    (void)grain;
    if (n > 0) body(0, n);
  }
};

// The calling thread alone: the default of every caller without XLA's pool.
inline const RowPool kSerialRows{};

// The bytes a chunk of row copies holds at least: ~16 KB (32 rows of the
// benchmarks' 524-byte item), so that a chunk's copies outweigh handing it to
// another thread (a task's start: ~1-5 us), and a batch of 8 stays on one thread.
constexpr int64_t kMinChunkBytes = 16 << 10;

// The rows of ``row_bytes`` bytes each (all of a row's fields) a chunk holds.
inline int64_t RowsPerChunk(size_t row_bytes) {
  return std::max<int64_t>(kMinChunkBytes / static_cast<int64_t>(std::max<size_t>(row_bytes, 1)),
                           1);
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_PARALLEL_H_
