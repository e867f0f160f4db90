// What an optimizer's save writes, as bytes: equal bytes mean equal state and options (tests of calls that
// must change nothing); an Adam-rule optimizer's moments, as fp32 tensors.
#pragma once

#include <memsave/optim.h>

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <sstream>
#include <string>
#include <vector>

namespace memsave::testing {

inline std::string saved_bytes(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

/// The moments and step count of each parameter of `o` (an Adam-rule optimizer: LibTorch's, memsave's of any
/// bits, offloaded or not), in the order of its groups, read out through copy_state into LibTorch's AdamW.
/// Two optimizers built alike compare this way whatever their files hold (LibTorch keys its file by
/// addresses).
inline std::vector<torch::Tensor> adam_moments(torch::optim::Optimizer& o) {
  std::vector<torch::Tensor> params;
  for (const auto& group : o.param_groups())
    for (const auto& p : group.params()) params.push_back(torch::empty_like(p).requires_grad_());
  torch::optim::AdamW out(params);
  optim::copy_state(o, out);
  std::vector<torch::Tensor> m;
  for (const auto& p : params) {
    const auto& s =
        static_cast<const torch::optim::AdamWParamState&>(*out.state().at(p.unsafeGetTensorImpl()));
    m.push_back(s.exp_avg());
    m.push_back(s.exp_avg_sq());
    m.push_back(torch::tensor(s.step()));
  }
  return m;
}

}  // namespace memsave::testing
