// TableState.item_info as the kernels see it: uint32[C, 4], one row of four
// words per slot (key, version, times sampled, priority), each word the bit
// pattern of its field's dtype.
//
// The source of truth for the layout is funcreplay/core/item_info.py
// (COLUMNS, WIDTH). The constants below repeat it; funcreplay_item_info_layout
// (direct.cc) exports them and funcreplay/native/build.py refuses to use a
// library whose layout differs from item_info.COLUMNS (the portable path runs
// instead), so the two cannot drift silently; tests/native/test_item_info.py
// checks both sides.
#ifndef FUNCREPLAY_NATIVE_ITEM_INFO_H_
#define FUNCREPLAY_NATIVE_ITEM_INFO_H_

#include <cstdint>
#include <cstring>

namespace funcreplay {

// Columns of a row (item_info.COLUMNS) and the words a row (item_info.WIDTH).
constexpr int64_t kInfoKey = 0;           // uint32: the item's key
constexpr int64_t kInfoVersion = 1;       // int32 bits: the policy version
constexpr int64_t kInfoTimesSampled = 2;  // int32 bits: times sampled
constexpr int64_t kInfoPriority = 3;      // float32 bits: the priority
constexpr int64_t kInfoWidth = 4;

// Typed access to the rows of an item_info buffer (not owning). Every read
// and write goes through std::memcpy of one word, so reading a float or an
// int32 out of the uint32 words is not a strict-aliasing violation; the
// compiler turns each into a plain load or store.
class ItemInfo {
 public:
  ItemInfo() = default;
  explicit ItemInfo(uint32_t* words) : words_(words) {}

  uint32_t key(int64_t s) const { return Get<uint32_t>(s, kInfoKey); }
  int32_t version(int64_t s) const { return Get<int32_t>(s, kInfoVersion); }
  int32_t times_sampled(int64_t s) const { return Get<int32_t>(s, kInfoTimesSampled); }
  float priority(int64_t s) const { return Get<float>(s, kInfoPriority); }

  void set_times_sampled(int64_t s, int32_t n) { Set(s, kInfoTimesSampled, n); }
  void set_priority(int64_t s, float p) { Set(s, kInfoPriority, p); }
  // A freshly inserted item: all four words of its row.
  void set_row(int64_t s, uint32_t key, int32_t version, int32_t times_sampled,
               float priority) {
    Set(s, kInfoKey, key);
    Set(s, kInfoVersion, version);
    Set(s, kInfoTimesSampled, times_sampled);
    Set(s, kInfoPriority, priority);
  }

  // The row of slot ``s`` (16 bytes, inside one cache line), for prefetching.
  const uint32_t* row(int64_t s) const { return words_ + s * kInfoWidth; }

 private:
  template <typename T>
  T Get(int64_t s, int64_t column) const {
    static_assert(sizeof(T) == sizeof(uint32_t), "item_info fields are one word");
    T v;
    std::memcpy(&v, words_ + s * kInfoWidth + column, sizeof v);
    return v;
  }
  template <typename T>
  void Set(int64_t s, int64_t column, T v) {
    static_assert(sizeof(T) == sizeof(uint32_t), "item_info fields are one word");
    std::memcpy(words_ + s * kInfoWidth + column, &v, sizeof v);
  }

  uint32_t* words_ = nullptr;
};

}  // namespace funcreplay

#endif  // FUNCREPLAY_NATIVE_ITEM_INFO_H_
