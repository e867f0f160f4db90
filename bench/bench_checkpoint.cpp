// Activation checkpointing on the CPU: peak activation memory (the meter) and time of a training step
// (forward, loss, backward) for no checkpointing, every element (through checkpoint_sequential, and through
// memsave::nn::Checkpoint wrappers in a module of one's own), √n segments and a per-layer keep policy, and
// under bf16 autocast for no checkpointing and every element; same model, batch and seed, one invocation.
// Prints one JSON object per line (bench/run_checkpoint_bench.sh turns them, and the Python peers', into the
// table in bench/RESULTS-checkpoint.md).
//   build/bench/memsave_bench_checkpoint [--steps N]
#include <memsave/amp.h>
#include <memsave/checkpoint.h>
#include <memsave/memory.h>

#include "args.h"
#include "timing.h"
#include "zoo/zoo.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

namespace tnn = torch::nn;

/// The per-layer policy of each model: recompute the elements with the most activation per unit of compute.
/// gpt: the MLP halves (4× width inside) are recomputed one by one, the attention halves kept.
/// resnet50: the blocks of the first two stages (highest resolution) are recomputed one by one, the rest
/// kept.
memsave::nn::KeepPolicy policy_for(const std::string& model) {
  if (model.rfind("gpt", 0) == 0)
    return [](const std::string& name, const tnn::Module&) { return name.rfind("mlp", 0) != 0; };
  return [](const std::string& name, const tnn::Module&) {
    return name.rfind("layer1", 0) != 0 && name.rfind("layer2", 0) != 0;
  };
}

struct Result {
  int64_t activations = 0;
  double seconds = 0;          ///< forward, loss and backward
  double forward_seconds = 0;  ///< forward and loss
};

Result run(const std::string& model, int64_t batch, const std::string& setting, int steps) {
  torch::manual_seed(0);
  const memsave::zoo::Workload w = memsave::zoo::workload(model);
  tnn::Sequential net = w.make_model();
  const auto n = static_cast<int64_t>(net->size());
  std::function<torch::Tensor(const torch::Tensor&)> forward = [net](const torch::Tensor& x) mutable {
    return net->forward(x);
  };
  memsave::nn::CheckpointSequential wrapped{nullptr};
  const bool bf16 = setting.rfind("bf16", 0) == 0;
  if (setting == "every layer" || setting == "bf16, every layer")
    wrapped = memsave::nn::checkpoint_sequential(net, n);
  if (setting == "sqrt(n) segments")
    wrapped = memsave::nn::checkpoint_sequential(net, std::lround(std::sqrt(static_cast<double>(n))));
  if (setting == "per-layer policy") {
    wrapped = memsave::nn::checkpoint_sequential(net, policy_for(model), /*max_run=*/1);
  }
  if (wrapped) forward = [wrapped](const torch::Tensor& x) mutable { return wrapped->forward(x); };
  if (setting == "module's Checkpoint blocks") {
    // The model as a module of one's own would hold it: every element but the last in a
    // memsave::nn::Checkpoint (on), run one after the other by its forward. The plan of "every layer",
    // reached the way a Trainer's recipe checkpoints a model it cannot cut.
    auto blocks = std::make_shared<tnn::Module>();
    std::vector<memsave::nn::Checkpoint> wrappers;
    for (int64_t i = 0; i + 1 < n; ++i) {
      tnn::Sequential one;
      one->push_back(net->begin()[i]);
      wrappers.push_back(blocks->register_module("block" + std::to_string(i), memsave::nn::Checkpoint(one)));
    }
    forward = [blocks, wrappers, net](const torch::Tensor& input) mutable {
      torch::Tensor x = input;
      for (auto& w : wrappers) x = w->forward(x);
      return net->begin()[net->size() - 1].forward(x);
    };
  }

  const auto data = w.make_batch(batch, torch::kCPU);
  for (auto& p : net->parameters()) p.mutable_grad() = torch::zeros_like(p);  // gradients outside the peak
  std::vector<double> times, forward_times;
  Result result;
  for (int s = 0; s <= steps; ++s) {  // step 0 is not timed
    for (auto& p : net->parameters()) p.mutable_grad().zero_();
    memsave::PeakScope scope(torch::kCPU);
    const auto start = std::chrono::steady_clock::now();
    torch::Tensor loss;
    {
      memsave::amp::Autocast autocast(torch::kCPU, torch::kBFloat16, /*enabled=*/bf16);
      loss = w.loss(forward(data.input), data.target);
    }
    const auto forward_end = std::chrono::steady_clock::now();
    loss.backward();
    const auto end = std::chrono::steady_clock::now();
    if (s > 0) {
      times.push_back(std::chrono::duration<double>(end - start).count());
      forward_times.push_back(std::chrono::duration<double>(forward_end - start).count());
    }
    result.activations = scope.peak() - scope.start();
  }
  result.seconds = memsave::bench::median(times);
  result.forward_seconds = memsave::bench::median(forward_times);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  memsave::install_meter();
  memsave::bench::Args args(argc, argv);
  const int steps = static_cast<int>(args.integer("--steps", 3, /*min=*/1));
  args.finish();
  const std::pair<const char*, int64_t> cases[] = {{"gpt-12l", 8}, {"resnet50", 8}};
  for (const auto& [model, batch] : cases) {
    for (const char* setting : {"none", "every layer", "module's Checkpoint blocks", "sqrt(n) segments",
                                "per-layer policy", "bf16", "bf16, every layer"}) {
      const Result r = run(model, batch, setting, steps);
      std::printf(
          "{\"impl\": \"memsave\", \"model\": \"%s\", \"batch\": %lld, \"setting\": \"%s\", \"activations\": "
          "%lld, "
          "\"seconds\": %.6f, \"forward_seconds\": %.6f, \"threads\": %d}\n",
          model, static_cast<long long>(batch), setting, static_cast<long long>(r.activations), r.seconds,
          r.forward_seconds, at::get_num_threads());
      std::fflush(stdout);
    }
  }
  return 0;
}
