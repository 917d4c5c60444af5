// The oneDNN library's per-thread scratch (onednn_linear.cpp, onednn_attention.cpp): each keeps its
// buffers in thread_local vectors, grown and never shrunk, so a call allocates nothing once its
// thread has served its largest shape.
#pragma once
#include <cstdint>
#include <vector>

namespace ps_onednn {

// buf's data, grown to at least count elements (never shrunk)
template <typename T>
T* grown(std::vector<T>& buf, int64_t count) {
  if (static_cast<int64_t>(buf.size()) < count) buf.resize(count);
  return buf.data();
}

}  // namespace ps_onednn
