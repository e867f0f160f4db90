// bf16 autocast against fp32 on the CPU: peak memory (the meter, split by memsave::breakdown) and step time
// of a training step (forward under autocast, backward, AdamW step), same model, batch and seed, one
// invocation. "held" is what the graph holds when the forward and the loss end (the tensors saved for the
// backward, autocast's weight copies among them). Measured again at twice the batch, it splits into what
// grows with the batch (the activations: held(2B) - held(B) per B) and what does not (held(B) less that:
// under autocast, the bf16 copies of the weights, which depend on the parameters alone).
//   build/bench/memsave_bench_amp [--steps N]
#include <memsave/amp.h>
#include <memsave/memory.h>

#include "args.h"
#include "timing.h"
#include "zoo/zoo.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <vector>

namespace {

struct Result {
  memsave::MemoryBreakdown parts;
  int64_t held = 0;  ///< what the graph holds when the forward (loss included) ends
  double seconds = 0;
};

Result run(const std::string& model, int64_t batch, bool bf16, int steps) {
  torch::manual_seed(0);
  const memsave::zoo::Workload w = memsave::zoo::workload(model);
  auto net = w.make_model();
  const auto data = w.make_batch(batch, torch::kCPU);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-4));
  std::vector<double> times;
  Result result;
  for (int s = 0; s <= steps; ++s) {  // step 0 creates the optimizer state and is not timed
    memsave::PeakScope scope(torch::kCPU);
    const auto start = std::chrono::steady_clock::now();
    opt.zero_grad();
    torch::Tensor loss;
    const int64_t before_forward = memsave::memory_stats(torch::kCPU).current;
    {
      memsave::amp::Autocast autocast(torch::kCPU, torch::kBFloat16, /*enabled=*/bf16);
      loss = w.loss(net->forward(data.input), data.target);
    }
    result.held = memsave::memory_stats(torch::kCPU).current - before_forward;
    loss.backward();
    opt.step();
    const double seconds = memsave::bench::seconds_since(start);
    if (s > 0) times.push_back(seconds);
    result.parts = memsave::breakdown(scope.peak(), net->parameters(), &opt, torch::kCPU);
  }
  result.seconds = memsave::bench::median(times);
  return result;
}

/// The graph's held bytes at a batch, split by a second measurement at twice the batch.
struct Split {
  int64_t activations = 0;  ///< grows with the batch: held(2B) - held(B)
  int64_t fixed = 0;        ///< does not: held(B) - activations
};

Split split(const std::string& model, int64_t batch, bool bf16, const Result& at_batch) {
  const Result twice = run(model, 2 * batch, bf16, /*steps=*/0);
  const int64_t activations = twice.held - at_batch.held;
  return {activations, at_batch.held - activations};
}

}  // namespace

int main(int argc, char** argv) {
  memsave::bench::Args args(argc, argv);
  const int steps = static_cast<int>(args.integer("--steps", 3, /*min=*/1));
  args.finish();
  std::printf("threads %d, median of %d timed steps after one untimed\n\n", at::get_num_threads(), steps);
  std::printf(
      "| model | batch | precision | peak | held after forward | activations (grow with batch) | "
      "activations vs fp32 | fixed (weight copies) | step time | time vs fp32 |\n"
      "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  const std::pair<const char*, int64_t> cases[] = {{"gpt-tiny", 32}, {"gpt-12l", 8}, {"resnet50", 8}};
  for (const auto& [model, batch] : cases) {
    const Result fp32 = run(model, batch, false, steps);
    const Result bf16 = run(model, batch, true, steps);
    const Split fp32_split = split(model, batch, false, fp32);
    const Split bf16_split = split(model, batch, true, bf16);
    for (const auto* r : {&fp32, &bf16}) {
      const Split& parts = r == &fp32 ? fp32_split : bf16_split;
      std::printf("| %s | %lld | %s | %s | %s | %s | %.3f× | %s | %.3f s | %.2f× |\n", model,
                  static_cast<long long>(batch), r == &fp32 ? "fp32" : "bf16 autocast",
                  memsave::format_bytes(r->parts.total).c_str(), memsave::format_bytes(r->held).c_str(),
                  memsave::format_bytes(parts.activations).c_str(),
                  static_cast<double>(parts.activations) / static_cast<double>(fp32_split.activations),
                  memsave::format_bytes(parts.fixed).c_str(), r->seconds, r->seconds / fp32.seconds);
    }
  }
  return 0;
}
