// What an optimizer's save writes, as bytes: equal bytes mean equal state and options (tests of calls that
// must change nothing).
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <sstream>
#include <string>

namespace memsave::testing {

inline std::string saved_bytes(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

}  // namespace memsave::testing
