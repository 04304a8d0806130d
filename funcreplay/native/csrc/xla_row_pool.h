// ``RowPool`` (parallel.h) on XLA's intra-op thread pool: what the FFI handlers
// whose work is many independent rows (the sample's copies and weight descents,
// the trajectory window gather) pass down to it.
#ifndef FUNCREPLAY_NATIVE_XLA_ROW_POOL_H_
#define FUNCREPLAY_NATIVE_XLA_ROW_POOL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace funcreplay {

// ``RowPool`` on XLA's intra-op thread pool (the handler's ``xla::ffi::ThreadPool``
// context): the calling thread and up to ``num_threads() - 1`` tasks claim
// chunks of ``grain`` rows from one counter until none is left; the caller
// then waits for the chunks the others claimed. Nothing waits for a task to
// start (XLA may run a task late, on a busy or one-thread pool): a task that
// starts after the last chunk was claimed finds none and touches nothing but
// the counters, which it co-owns.
class XlaRowPool final : public RowPool {
 public:
  explicit XlaRowPool(xla::ffi::ThreadPool& pool) : pool_(pool) {}

  void For(int64_t n, int64_t grain,
           const std::function<void(int64_t, int64_t)>& body) const override {
    const int64_t chunks = n > 0 ? (n + grain - 1) / grain : 0;
    const int64_t helpers = std::min<int64_t>(pool_.num_threads() - 1, chunks - 1);
    if (helpers <= 0) {
      RowPool::For(n, grain, body);
      return;
    }
    struct Claims {
      std::atomic<int64_t> next{0}, done{0};
      int64_t n = 0, grain = 0, chunks = 0;
      const std::function<void(int64_t, int64_t)>* body = nullptr;
      void Run() {
        for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
          (*body)(c * grain, std::min(n, (c + 1) * grain));
          done.fetch_add(1, std::memory_order_release);
        }
      }
    };
    auto claims = std::make_shared<Claims>();
    claims->n = n;
    claims->grain = grain;
    claims->chunks = chunks;
    claims->body = &body;
    for (int64_t h = 0; h < helpers; ++h) pool_.Schedule([claims] { claims->Run(); });
    claims->Run();
    // The chunks still running are on threads that are running them: a short wait.
    while (claims->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
  }

 private:
  xla::ffi::ThreadPool& pool_;
};

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_XLA_ROW_POOL_H_
