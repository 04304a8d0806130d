// The rows of a sample: copying items into the batch, and binding a packed
// output buffer (funcreplay/core/packing.py's layout). Shared by the FFI
// handler (kernels.cc) and the direct host path (direct.cc).
#ifndef FUNCREPLAY_NATIVE_ROWS_H_
#define FUNCREPLAY_NATIVE_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace funcreplay {

// memcpy of one row; the common scalar sizes inline as one load and store
// instead of a library call each.
inline void CopyRow(char* dst, const char* src, size_t n) {
  switch (n) {
    case 4: std::memcpy(dst, src, 4); break;
    case 8: std::memcpy(dst, src, 8); break;
    case 1: *dst = *src; break;
    case 2: std::memcpy(dst, src, 2); break;
    default: std::memcpy(dst, src, n);
  }
}

// Prefetch distances (candidates, rows): far enough ahead to keep many cache
// misses in flight, near enough that the lines are still cached when used (a
// whole large batch's rows would not fit in L2).
constexpr size_t kMetaAhead = 64;
constexpr int64_t kRowsAhead = 32;

// Points ``rows`` (one per data leaf) and ``columns`` (valid, slot, key,
// probability, priority, times_sampled, version, num_eligible) into a packed
// buffer of ``nbytes`` at the byte offsets ``packed`` (n_data + 9 of them:
// the leaves, the 8 columns, then the total size; funcreplay/packing.py's
// layout) and zeroes the alignment gaps (the buffer may come uninitialised).
// False if the offsets do not describe such a buffer.
inline bool BindPacked(char* base, int64_t nbytes, const int64_t* packed, size_t n_packed,
                       int64_t b, const std::vector<size_t>& row_bytes,
                       std::vector<char*>* rows, char* columns[8]) {
  const size_t n_data = row_bytes.size();
  bool ok = n_packed == n_data + 9 && packed[0] >= 0 && packed[n_data + 8] == nbytes;
  for (size_t j = 1; ok && j < n_packed; ++j) ok = packed[j] >= packed[j - 1];
  if (!ok) return false;
  std::vector<std::pair<int64_t, int64_t>> spans;
  rows->resize(n_data);
  for (size_t d = 0; d < n_data; ++d) {
    (*rows)[d] = base + packed[d];
    spans.emplace_back(packed[d], packed[d] + static_cast<int64_t>(b * row_bytes[d]));
  }
  for (size_t j = 0; j < 8; ++j) {  // sizes: B (valid), 4 * B, and 4 (num_eligible)
    columns[j] = base + packed[n_data + j];
    const int64_t size = j == 0 ? b : (j == 7 ? 4 : 4 * b);
    spans.emplace_back(packed[n_data + j], packed[n_data + j] + size);
  }
  int64_t end = 0;
  for (const auto& [lo, hi] : spans) {  // fields are laid out in order
    if (lo > end) std::memset(base + end, 0, static_cast<size_t>(lo - end));
    end = std::max(end, hi);
  }
  if (nbytes > end) std::memset(base + end, 0, static_cast<size_t>(nbytes - end));
  return end <= nbytes;
}

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_ROWS_H_
