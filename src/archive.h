// Reading and writing scalar fields of LibTorch archives (optimizer options and state), shared by src/.
#pragma once

#include "memsave/optim.h"

#include <torch/serialize/archive.h>

#include <cstdint>
#include <vector>

namespace memsave::detail {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

inline double read_double(InputArchive& archive, const char* key) {
  c10::IValue value;
  archive.read(key, value);
  return value.to<double>();
}

inline int64_t read_int(InputArchive& archive, const char* key) {
  c10::IValue value;
  archive.read(key, value);
  return value.to<int64_t>();
}

inline bool read_bool(InputArchive& archive, const char* key) {
  c10::IValue value;
  archive.read(key, value);
  return value.to<bool>();
}

/// A field that older files may lack: `absent` when they do.
inline bool read_bool_or(InputArchive& archive, const char* key, bool absent) {
  c10::IValue value;
  return archive.try_read(key, value) ? value.to<bool>() : absent;
}

/// A list of integers saved as a 1-D int64 buffer (OffloadOptimizer's offload/group_sizes); empty when the
/// file has none. `who` names the reader in the error for a field of another kind.
inline std::vector<int64_t> read_int_list(InputArchive& archive, const char* key, const char* who) {
  torch::Tensor saved;
  if (!archive.try_read(key, saved, /*is_buffer=*/true)) return {};
  TORCH_CHECK(saved.dim() == 1 && saved.scalar_type() == torch::kLong, who, ": the file's ", key,
              " is not a list of integers");
  const torch::Tensor values = saved.to(torch::kCPU).contiguous();
  return {values.data_ptr<int64_t>(), values.data_ptr<int64_t>() + values.numel()};
}

inline void write_betas(OutputArchive& archive, const optim::betas_t& betas) {
  archive.write("beta1", std::get<0>(betas));
  archive.write("beta2", std::get<1>(betas));
}

inline optim::betas_t read_betas(InputArchive& archive) {
  return {read_double(archive, "beta1"), read_double(archive, "beta2")};
}

}  // namespace memsave::detail
