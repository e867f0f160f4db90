// An existing LibTorch training loop, before and after memsave: the same model, data and seed, first as
// written, then with every technique — micro-batches with the loss normalized over the window, bf16 autocast,
// checkpointing, 8-bit optimizer state, gradient clipping — first with the individual wrappers, then through
// the Trainer in a few lines, which it then saves and resumes, as it was and under 4-bit state (the file's
// 8-bit state converted). Prints each loop's losses and step peak (memsave's meter).
//
//   build/examples/wrap_training_loop [--steps N]
#include <memsave/memsave.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

namespace {

namespace F = torch::nn::functional;

/// The user's model: any Sequential of layers.
torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(256, 512), torch::nn::GELU(), torch::nn::Linear(512, 512),
                               torch::nn::GELU(), torch::nn::Linear(512, 512), torch::nn::GELU(),
                               torch::nn::Linear(512, 10));
}

struct Data {
  torch::Tensor x, y;
};

Data batch(int step) {
  torch::manual_seed(100 + step);
  auto x = torch::randn({64, 256});
  return {x, x.narrow(1, 0, 10).argmax(1)};  // a learnable rule: the largest of the first ten features
}

void report(const char* name, int step, double loss, int64_t peak) {
  std::printf("  %-34s step %2d  loss %.4f  peak %s\n", name, step, loss,
              memsave::format_bytes(peak).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  memsave::install_meter();
  int steps = 10;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::atoi(argv[i + 1]);
  if (steps < 1) {
    std::fprintf(stderr, "usage: wrap_training_loop [--steps N >= 1]\n");
    return 2;
  }

  // ---- before: the loop as written -----------------------------------------------------------------
  {
    auto net = make_model();
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-3));
    for (int step = 0; step < steps; ++step) {
      const Data d = batch(step);
      memsave::PeakScope peak(torch::kCPU);
      opt.zero_grad();
      auto loss = F::cross_entropy(net->forward(d.x), d.y);
      loss.backward();
      opt.step();
      report("plain LibTorch", step, loss.item<double>(), peak.peak());
    }
  }

  // ---- after, with the individual wrappers -----------------------------------------------------------
  {
    auto layers = make_model();
    auto net = memsave::nn::checkpoint_sequential(layers, /*segments=*/2);  // recompute instead of store
    memsave::optim::AdamW8bit opt(net->parameters(), memsave::optim::AdamW8bitOptions(1e-3));  // 8-bit state
    memsave::GradientAccumulator acc(opt, memsave::AccumulateOptions().window(4).max_grad_norm(1.0));
    for (int step = 0; step < steps; ++step) {
      const Data d = batch(step);
      memsave::PeakScope peak(torch::kCPU);
      std::optional<memsave::WindowStep> result;
      for (const auto& micro : memsave::split_micro_batches({d.x, d.y}, 16)) {  // 4 micro-batches of 16
        torch::Tensor loss;
        {
          memsave::amp::Autocast autocast(torch::kCPU, torch::kBFloat16);
          loss = F::cross_entropy(net->forward(micro[0]), micro[1]);
        }
        result = acc.backward(loss, micro[0].size(0));  // unscale, clip and step once, after the 4th
      }
      report("wrappers: micro+bf16+ckpt+8-bit", step, result->loss, peak.peak());
    }
  }

  // ---- after, with the Trainer ------------------------------------------------------------------------
  const memsave::Recipe recipe = memsave::Recipe()
                                     .micro_batch(16)
                                     .amp(torch::kBFloat16)
                                     .checkpoint(memsave::Checkpointing::segments(2))
                                     .state_bits(8)
                                     .max_grad_norm(1.0);
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) { return F::cross_entropy(out, y); };
  // Resuming: model, optimizer state (and a GradScaler's) go in one file; a Trainer over a fresh model that
  // loads it takes the steps the saving one would have taken.
  const std::string file = (std::filesystem::temp_directory_path() / "wrap_training_loop.pt").string();
  double next_loss = 0;
  {
    auto net = make_model();
    memsave::Trainer trainer(net, memsave::adamw(1e-3), recipe);
    for (int step = 0; step < steps; ++step) {
      const Data d = batch(step);
      const memsave::StepStats stats = trainer.step(d.x, d.y, loss_fn);
      report("Trainer: the same recipe", step, stats.loss, stats.peak_bytes);
    }
    trainer.save(file);
    for (int step = steps; step < steps + 2; ++step) {  // the second loss shows the first step's update
      const Data d = batch(step);
      next_loss = trainer.step(d.x, d.y, loss_fn).loss;
    }
  }
  {
    auto net = make_model();
    memsave::Trainer resumed(net, memsave::adamw(1e-3), recipe);
    resumed.load(file);
    memsave::StepStats stats;
    for (int step = steps; step < steps + 2; ++step) {
      const Data d = batch(step);
      stats = resumed.step(d.x, d.y, loss_fn);
      report("Trainer: resumed from its file", step, stats.loss, stats.peak_bytes);
    }
    if (stats.loss != next_loss) {
      std::fprintf(stderr, "the resumed Trainer's loss %.9g differs from the saving one's %.9g\n", stats.loss,
                   next_loss);
      return 1;
    }
  }
  {
    // A recipe with other optimizer state (here 4-bit, as memsave rescue might recommend after an
    // out-of-memory) resumes from the same file: the state is converted, moments and step counts kept, so the
    // run goes on near the saved one's course instead of restarting its moments.
    auto net = make_model();
    memsave::Trainer resumed(net, memsave::adamw(1e-3), memsave::Recipe(recipe).state_bits(4));
    resumed.load(file);
    std::filesystem::remove(file);
    memsave::StepStats stats;
    for (int step = steps; step < steps + 2; ++step) {
      const Data d = batch(step);
      stats = resumed.step(d.x, d.y, loss_fn);
      report("Trainer: resumed under 4-bit state", step, stats.loss, stats.peak_bytes);
    }
    if (!(std::abs(stats.loss - next_loss) <= 0.005 * next_loss)) {
      std::fprintf(stderr, "resumed under 4-bit state, the loss %.9g is not within 0.5%% of %.9g\n",
                   stats.loss, next_loss);
      return 1;
    }
  }
  return 0;
}
