// The runs whose files tests/data/archives holds: written by an earlier build (write_archives.cpp), read by
// tests/test_archives.cpp. Public API only, so that the writer builds against older sources too.
#pragma once

#include <memsave/offload.h>
#include <memsave/optim.h>
#include <memsave/trainer.h>

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace memsave::archives {

using Params = std::vector<torch::Tensor>;

/// `count` values in [-scale, scale) from `seed`, the same on every machine and LibTorch version (LibTorch's
/// generators promise no such thing): splitmix64, its top 24 bits as a fraction.
inline torch::Tensor values(c10::IntArrayRef shape, std::uint64_t seed, double scale) {
  torch::Tensor out = torch::empty(shape);
  float* data = out.data_ptr<float>();
  std::uint64_t state = seed;
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    state += 0x9e3779b97f4a7c15ULL;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    const double unit = static_cast<double>(z >> 40) / 16777216.0;  // [0, 1), 24 bits
    data[i] = static_cast<float>((2 * unit - 1) * scale);
  }
  return out;
}

/// A 4-D weight and a matrix with quantized state, a vector and a bias below the size thresholds (fp32
/// state).
inline Params parameters() {
  Params p;
  std::uint64_t seed = 2026;
  for (const auto& shape : {std::vector<int64_t>{64, 32, 3, 3}, std::vector<int64_t>{50, 100},
                            std::vector<int64_t>{3000}, std::vector<int64_t>{7}})
    p.push_back(values(shape, seed++, 1.0).requires_grad_());
  return p;
}

/// The gradient of parameter i at step t: of scale 1 + i, and a thousandth of it in one element in 97, so
/// that blocks span several decades.
inline torch::Tensor gradient(const torch::Tensor& p, size_t i, int t) {
  torch::Tensor g = values(p.sizes(), 1000 * static_cast<std::uint64_t>(t) + i, 1.0 + static_cast<double>(i));
  g.view({-1}).slice(0, 0, g.numel(), 97).mul_(1e-3);
  return g;
}

/// Steps first … last (from 1) of the run.
inline void train(torch::optim::Optimizer& opt, const Params& params, int first, int last) {
  for (int t = first; t <= last; ++t) {
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = gradient(params[i], i, t);
    opt.step();
  }
}

/// The steps each file's state has taken.
constexpr int kSteps = 3;

struct Case {
  std::string name;  ///< the file is tests/data/archives/<name>.pt
  std::function<std::unique_ptr<torch::optim::Optimizer>(const Params&)> make;
};

/// How a test names a case (GoogleTest finds it beside Case).
inline void PrintTo(const Case& c, std::ostream* out) { *out << c.name; }

inline std::vector<Case> cases() {
  using namespace memsave::optim;
  return {
      {"adamw8bit", [](const Params& p) { return std::make_unique<AdamW8bit>(p, AdamW8bitOptions(1e-2)); }},
      {"adam8bit_block1024",
       [](const Params& p) {
         return std::make_unique<Adam8bit>(p, Adam8bitOptions(1e-2).block_size(1024).weight_decay(0.1));
       }},
      {"adamw8bit_forced_32bit",
       [](const Params& p) {
         auto opt = std::make_unique<AdamW8bit>(p, AdamW8bitOptions(1e-2));
         opt->force_32bit(p[1]);
         return opt;
       }},
      {"adamw4bit", [](const Params& p) { return std::make_unique<AdamW4bit>(p, AdamW4bitOptions(1e-2)); }},
      {"sgd8bit",
       [](const Params& p) { return std::make_unique<SGD8bit>(p, SGD8bitOptions(1e-2).momentum(0.9)); }},
      {"sgd4bit",
       [](const Params& p) {
         return std::make_unique<SGD4bit>(p, SGD4bitOptions(1e-2).momentum(0.9).nesterov(true));
       }},
      {"lion8bit", [](const Params& p) { return std::make_unique<Lion8bit>(p, Lion8bitOptions(1e-4)); }},
      {"offload_8bit",
       [](const Params& p) {
         return std::make_unique<OffloadOptimizer>(
             p, OffloadOptimizerOptions(1e-2).state_bits(8).min_offload_size(100));
       }},
      {"offload_32bit",
       [](const Params& p) {
         return std::make_unique<OffloadOptimizer>(p, OffloadOptimizerOptions(1e-2).min_offload_size(100));
       }},
  };
}

// ---- the Trainer's files: model, buffers, optimizer state, scaler and recipe

/// A Linear of 8192 weights (quantized state) behind a BatchNorm, whose running statistics the file holds
/// too.
inline torch::nn::Sequential trainer_model() {
  torch::manual_seed(2026);
  namespace tnn = torch::nn;
  return tnn::Sequential(tnn::Linear(6, 128), tnn::BatchNorm1d(128), tnn::Tanh(), tnn::Linear(128, 64));
}

/// Batch t: 16 rows.
inline std::pair<torch::Tensor, torch::Tensor> batch(int t) {
  const torch::Tensor target =
      (values({16}, 6000 + static_cast<std::uint64_t>(t), 1.0) + 1).mul(32).to(torch::kLong);
  return {values({16, 6}, 5000 + static_cast<std::uint64_t>(t), 2.0), target.clamp(0, 63)};
}

inline torch::Tensor trainer_loss(const torch::Tensor& output, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(output, target);
}

/// Steps first … last (from 1) of a Trainer's run.
inline void train(Trainer& trainer, int first, int last) {
  for (int t = first; t <= last; ++t) {
    const auto [input, target] = batch(t);
    trainer.step(input, target, trainer_loss);
  }
}

struct TrainerCase {
  std::string name;  ///< the file is tests/data/archives/<name>.pt
  Recipe recipe;     ///< with memsave::adamw(1e-2)
};

inline void PrintTo(const TrainerCase& c, std::ostream* out) { *out << c.name; }

inline std::vector<TrainerCase> trainer_cases() {
  return {
      {"trainer_fp32", Recipe()},
      {"trainer_8bit_accumulated_clipped", Recipe().state_bits(8).micro_batch(4).max_grad_norm(0.5)},
      {"trainer_4bit", Recipe().state_bits(4)},
      {"trainer_offload_8bit_scaled",
       Recipe().offload(Offload::kOptimizerState).state_bits(8).grad_scaling(GradScaling::kOn)},
  };
}

}  // namespace memsave::archives
