// LibTorch's intra-op threads for a scope. ctest runs every test on one (tests/CMakeLists.txt); a test of
// what happens on several asks for them here.
#pragma once

#include <ATen/Parallel.h>

namespace memsave::testing {

class IntraOpThreads {
 public:
  explicit IntraOpThreads(int threads) : before_(at::get_num_threads()) { at::set_num_threads(threads); }
  ~IntraOpThreads() { at::set_num_threads(before_); }
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;

 private:
  int before_;
};

}  // namespace memsave::testing
