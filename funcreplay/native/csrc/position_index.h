// The position index of a table (TableSpec.position_index) over raw pointers:
// funcreplay/core/position_index.py's operations, bit for bit (that module's
// docstring states the layout, the invariants and the rule; tests compare the
// kernels' states with the portable ones).
#ifndef FUNCREPLAY_NATIVE_POSITION_INDEX_H_
#define FUNCREPLAY_NATIVE_POSITION_INDEX_H_

#include <cstdint>
#include <vector>

namespace funcreplay {

// int32[2, C + 1]: order = row 0 (position -> slot; order[C] = N, the count),
// where = row 1 (slot -> position, -1 free). Off (a spec without the index):
// order null.
struct PositionIndex {
  int32_t* order = nullptr;
  int32_t* where = nullptr;
  int64_t c = 0;

  bool on() const { return order != nullptr; }
  // ``data``: the int32[2, C + 1] buffer, or null.
  void Bind(int32_t* data, int64_t capacity) {
    c = capacity;
    order = data;
    where = data == nullptr ? nullptr : data + capacity + 1;
  }
  int32_t& Size() { return order[c]; }

  // position_index.add for one row: ``slot`` (not indexed) takes position N.
  void Append(int32_t slot) {
    const int32_t n = Size();
    order[n] = slot;
    where[slot] = n;
    Size() = n + 1;
  }

  // position_index.drop: the rows ``i < b`` with ``gone[i]`` free their slots
  // (distinct, each indexed). The r-th freed position below N' = N - K (row
  // order) takes the slot of the r-th kept position in [N', N) (position order).
  void Drop(const int32_t* slots, const uint8_t* gone, int64_t b) {
    const int32_t n = Size();
    int32_t k = 0;
    for (int64_t i = 0; i < b; ++i) k += gone[i] ? 1 : 0;
    if (k == 0) return;
    const int32_t n_after = n - k;
    std::vector<uint8_t> freed_tail(k, 0);  // positions n_after + t freed
    std::vector<int32_t> pos(b, -1);
    for (int64_t i = 0; i < b; ++i) {
      if (!gone[i]) continue;
      pos[i] = where[slots[i]];
      if (pos[i] >= n_after) freed_tail[pos[i] - n_after] = 1;
    }
    int32_t t = 0;  // the next filler: the lowest kept position in [N', N)
    for (int64_t i = 0; i < b; ++i) {
      if (!gone[i] || pos[i] >= n_after) continue;
      while (freed_tail[t]) ++t;
      const int32_t moved = order[n_after + t];
      ++t;
      order[pos[i]] = moved;
      where[moved] = pos[i];
    }
    for (int64_t i = 0; i < b; ++i) {
      if (gone[i]) where[slots[i]] = -1;
    }
    Size() = n_after;
  }
};

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_POSITION_INDEX_H_
