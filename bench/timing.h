// What the benchmark programs share to time steps: medians, since noisy machines call for them.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace memsave::bench {

/// The median of `values` (the upper one of an even count); 0 when empty.
inline double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace memsave::bench
