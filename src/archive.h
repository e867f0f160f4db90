// Reading and writing scalar fields of LibTorch archives (optimizer options and state), shared by src/.
#pragma once

#include "memsave/optim.h"

#include <torch/serialize/archive.h>

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

inline void write_betas(OutputArchive& archive, const optim::betas_t& betas) {
  archive.write("beta1", std::get<0>(betas));
  archive.write("beta2", std::get<1>(betas));
}

inline optim::betas_t read_betas(InputArchive& archive) {
  return {read_double(archive, "beta1"), read_double(archive, "beta2")};
}

}  // namespace memsave::detail
