// One training step (forward, loss, backward, AdamW step) on the CPU, four ways, same model, batch and seed,
// one invocation: a plain LibTorch loop (zero_grad, forward, loss, backward, torch::optim::AdamW::step),
// memsave::Trainer over the full batch and over 4 micro-batches with the loss normalized over the window, and
// the Trainer over the full batch given the model as a module and a forward function (as a model of any shape
// comes). The LibTorch loop is the reference of every ratio: the Trainer's full-batch row is what its
// guarantees cost (a failed step changes nothing: room made for the optimizer's step, the buffers copied to
// the host arena), the micro-batch row what accumulation saves and costs, the last what the forward
// function's path costs beside the Sequential's. Models: gpt-12l and ResNet-50 on 16 rows, and the MLP on 4
// rows, whose peak is the optimizer's step (where the room the Trainer makes for the step is the peak).
//
// Memory: each loop alone, its second step's peak (the first creates the optimizer state). The activation
// peak is the step's peak minus parameters, optimizer state (memsave::breakdown) and one gradient per
// parameter (the Trainer frees gradients after each step, so they do not exist when the breakdown is taken,
// but they do at the step's peak). Time: the four loops side by side, their steps taken in turn (so that the
// machine's drift reaches all four alike), each round in its own order, each the whole call, median over the
// timed steps.
//   build/bench/memsave_bench_accumulate [--steps N]
#include <memsave/memory.h>
#include <memsave/trainer.h>

#include "args.h"
#include "timing.h"
#include "zoo/zoo.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

namespace {

constexpr double kLr = 1e-4;
constexpr double kWeightDecay = 1e-2;
/// The MLP's steps are short: it takes this many times the timed steps.
constexpr int kShortStepScale = 20;

/// A model, its optimizer and its batch, behind one training step.
struct Loop {
  std::function<int64_t()> step;                                ///< one step; returns its peak
  std::function<memsave::MemoryBreakdown(int64_t peak)> split;  ///< that peak's parts, after the step
};

/// The loop a LibTorch user writes (its output and loss live until the step is done).
Loop libtorch_loop(const memsave::zoo::Workload& w, int64_t batch) {
  torch::manual_seed(0);
  auto net = w.make_model();
  net->train();
  auto optimizer = std::make_shared<torch::optim::AdamW>(
      net->parameters(), torch::optim::AdamWOptions(kLr).weight_decay(kWeightDecay));
  auto data = std::make_shared<memsave::zoo::Batch>(w.make_batch(batch, torch::kCPU));
  return {[=]() mutable {
            memsave::PeakScope scope(torch::kCPU);
            optimizer->zero_grad();
            const torch::Tensor output = net->forward(data->input);
            const torch::Tensor loss = w.loss(output, data->target);
            loss.backward();
            optimizer->step();
            return scope.peak();
          },
          [=](int64_t peak) {  // the gradients are live
            return memsave::breakdown(peak, net->parameters(), optimizer.get(), torch::kCPU);
          }};
}

/// With `through_forward`, the Trainer gets the model as one of any shape would come: the module and a
/// function that runs it (memsave::Forward), not the Sequential.
Loop trainer_loop(const memsave::zoo::Workload& w, int64_t batch, int64_t micro,
                  bool through_forward = false) {
  torch::manual_seed(0);
  auto net = w.make_model();
  const memsave::Recipe recipe = memsave::Recipe().micro_batch(micro);
  auto trainer =
      through_forward
          ? std::make_shared<memsave::Trainer>(
                net.ptr(),
                [net](const std::vector<torch::Tensor>& inputs) mutable { return net->forward(inputs[0]); },
                memsave::adamw(kLr, kWeightDecay), recipe)
          : std::make_shared<memsave::Trainer>(net, memsave::adamw(kLr, kWeightDecay), recipe);
  auto data = std::make_shared<memsave::zoo::Batch>(w.make_batch(batch, torch::kCPU));
  return {[=] { return trainer->step(data->input, data->target, w.loss).peak_bytes; },
          [=](int64_t peak) {
            memsave::MemoryBreakdown parts =
                memsave::breakdown(peak, net->parameters(), &trainer->optimizer(), torch::kCPU);
            parts.gradients = parts.parameters;  // fp32 gradients of fp32 parameters
            parts.other -= parts.gradients;
            return parts;
          }};
}

struct Result {
  memsave::MemoryBreakdown parts;
  int64_t host_bytes = 0;  ///< the host arena the loop holds after a step
  double seconds = 0;
};

Result measure_memory(const std::function<Loop()>& make) {
  const int64_t host_before = memsave::host_memory_stats().current;
  const Loop loop = make();
  loop.step();
  Result result;
  result.parts = loop.split(loop.step());
  result.host_bytes = memsave::host_memory_stats().current - host_before;
  return result;
}

double ratio(int64_t a, int64_t b) { return static_cast<double>(a) / static_cast<double>(b); }

}  // namespace

int main(int argc, char** argv) {
  memsave::install_meter();
  memsave::bench::Args args(argc, argv);
  const int steps = static_cast<int>(args.integer("--steps", 5, /*min=*/1));
  args.finish();
  std::printf(
      "threads %d; time: median of %d timed steps per loop (mlp: %d) after one untimed, "
      "the loops in turn, each round shuffled\n\n",
      at::get_num_threads(), steps, steps * kShortStepScale);
  std::printf(
      "| model | loop | micro-batch | peak | activations and other | host arena | items/s "
      "| peak − LibTorch's | peak vs LibTorch | activations vs LibTorch | throughput vs LibTorch |\n"
      "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  // The MLP on 4 rows is a step whose peak is the optimizer's (large weights, small activations), where the
  // room made for the step is the peak.
  struct Case {
    const char* model;
    int64_t batch;
    int step_scale;
  };
  const Case cases[] = {{"gpt-12l", 16, 1}, {"resnet50", 16, 1}, {"mlp", 4, kShortStepScale}};
  for (const auto& [model, batch, step_scale] : cases) {
    const memsave::zoo::Workload w = memsave::zoo::workload(model);
    const int64_t micro = batch / 4;
    const std::vector<std::function<Loop()>> makers{
        [&] { return libtorch_loop(w, batch); }, [&] { return trainer_loop(w, batch, 0); },
        [&] { return trainer_loop(w, batch, micro); }, [&] { return trainer_loop(w, batch, 0, true); }};
    std::vector<Result> results;
    for (const auto& make : makers) results.push_back(measure_memory(make));

    std::vector<Loop> loops;
    for (const auto& make : makers) loops.push_back(make());
    std::vector<std::vector<double>> times(loops.size());
    // Each round in its own order (shuffled, seeded), so that no loop always steps after the same other:
    // what a step leaves behind (the allocator's state, say) then reaches every loop alike.
    std::mt19937 rng(0);
    std::vector<size_t> order(loops.size());
    std::iota(order.begin(), order.end(), 0);
    for (int s = 0; s <= steps * step_scale; ++s) {  // step 0 creates the optimizer state and is not timed
      std::shuffle(order.begin(), order.end(), rng);
      for (const size_t i : order) {
        const auto start = std::chrono::steady_clock::now();
        loops[i].step();
        if (s > 0) times[i].push_back(memsave::bench::seconds_since(start));
      }
    }
    for (size_t i = 0; i < loops.size(); ++i) results[i].seconds = memsave::bench::median(times[i]);

    const char* const names[] = {"LibTorch", "Trainer", "Trainer", "Trainer, forward function"};
    const Result& stock = results[0];
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::printf("| %s | %s | %lld | %s | %s | %s | %.1f | %lld B | %.4f× | %.2f× | %.2f× |\n", model,
                  names[i], static_cast<long long>(i == 2 ? micro : batch),
                  memsave::format_bytes(r.parts.total).c_str(), memsave::format_bytes(r.parts.other).c_str(),
                  memsave::format_bytes(r.host_bytes).c_str(), static_cast<double>(batch) / r.seconds,
                  static_cast<long long>(r.parts.total - stock.parts.total),
                  ratio(r.parts.total, stock.parts.total), ratio(r.parts.other, stock.parts.other),
                  stock.seconds / r.seconds);
      std::fflush(stdout);
    }
  }
  return 0;
}
