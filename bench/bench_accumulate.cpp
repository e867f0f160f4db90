// Gradient accumulation on the CPU: the peak of a training step (forward, backward, AdamW step) over the full
// batch against the same batch in 4 micro-batches, through memsave::Trainer, same model, batch and seed, one
// invocation. The activation peak is the step's peak minus parameters, optimizer state (memsave::breakdown)
// and one gradient per parameter (the Trainer frees gradients after each step, so they do not exist when the
// breakdown is taken, but they do at the step's peak); throughput is items per second, median over the timed
// steps.
//   build/bench/memsave_bench_accumulate [--steps N]
#include <memsave/memory.h>
#include <memsave/trainer.h>

#include "args.h"
#include "timing.h"
#include "zoo/zoo.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cstdio>
#include <vector>

namespace {

struct Result {
  memsave::MemoryBreakdown parts;
  double seconds = 0;
};

Result run(const std::string& model, int64_t batch, int64_t micro, int steps) {
  torch::manual_seed(0);
  const memsave::zoo::Workload w = memsave::zoo::workload(model);
  auto net = w.make_model();
  memsave::Trainer trainer(net, memsave::adamw(1e-4), memsave::Recipe().micro_batch(micro));
  const auto data = w.make_batch(batch, torch::kCPU);
  std::vector<double> times;
  Result result;
  for (int s = 0; s <= steps; ++s) {  // step 0 creates the optimizer state and is not timed
    const memsave::StepStats stats = trainer.step(data.input, data.target, w.loss);
    if (s > 0) times.push_back(stats.seconds);
    result.parts = memsave::breakdown(stats.peak_bytes, net->parameters(), &trainer.optimizer(), torch::kCPU);
    result.parts.gradients = result.parts.parameters;  // fp32 gradients of fp32 parameters
    result.parts.other -= result.parts.gradients;
  }
  result.seconds = memsave::bench::median(times);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  memsave::install_meter();
  memsave::bench::Args args(argc, argv);
  const int steps = static_cast<int>(args.integer("--steps", 3, /*min=*/1));
  args.finish();
  std::printf("threads %d, median of %d timed steps after one untimed\n\n", at::get_num_threads(), steps);
  std::printf(
      "| model | batch | micro-batch | peak | activations and other | items/s | activations vs full | "
      "throughput vs full |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  const std::pair<const char*, int64_t> cases[] = {{"gpt-12l", 16}, {"resnet50", 16}};
  for (const auto& [model, batch] : cases) {
    const Result full = run(model, batch, 0, steps);
    const Result micro = run(model, batch, batch / 4, steps);
    for (const auto* r : {&full, &micro}) {
      std::printf("| %s | %lld | %lld | %s | %s | %.1f | %.2f× | %.2f× |\n", model,
                  static_cast<long long>(batch), static_cast<long long>(r == &full ? batch : batch / 4),
                  memsave::format_bytes(r->parts.total).c_str(),
                  memsave::format_bytes(r->parts.other).c_str(), static_cast<double>(batch) / r->seconds,
                  static_cast<double>(r->parts.other) / static_cast<double>(full.parts.other),
                  full.seconds / r->seconds);
      std::fflush(stdout);
    }
  }
  return 0;
}
