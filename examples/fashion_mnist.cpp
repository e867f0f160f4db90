// Trains the zoo's small CNN on Fashion-MNIST twice from the same seed through memsave::Trainer: once plain
// (fp32 state, the whole batch) and once with the recipe given on the command line (default: 8-bit state),
// with AdamW, SGD with momentum or Lion, and prints both test accuracies, the optimizer state, the step peak
// (the meter) and the time. Exit 0 when the recipe's accuracy is within the tolerance of the plain run's, 1
// when not, 2 on bad input.
//
// `--compare bf16-weights` instead trains the model with bf16 weights and no fp32 copy (weights, gradients
// and activations in bf16, outside the Trainer) with AdamW8bit, rounding each new weight to nearest and then
// stochastically (AdamW8bitOptions::bf16_stochastic_round), against fp32 weights with LibTorch's AdamW; the
// tolerance applies to the stochastic run.
//
//   build/examples/fashion_mnist [--epochs N] [--data DIR] [--optimizer adamw|sgd|lion] [--micro-batch 32]
//                                [--amp bf16] [--checkpoint every|N] [--state-bits 8] [--max-grad-norm 1.0]
//                                [--limit IMAGES] [--compare 8bit|bf16|bf16-weights]
//   (DIR: Debian's dataset-fashion-mnist by default)
#include <memsave/memsave.h>

#include "zoo/zoo.h"

#include <torch/torch.h>
#include <zlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

namespace {

/// Reads a gzipped IDX file (images: uint8 [n, rows, cols]; labels: uint8 [n]).
torch::Tensor read_idx(const std::string& path) {
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw std::runtime_error("cannot open " + path);
  auto read_u32 = [&] {
    unsigned char b[4];
    if (gzread(file, b, 4) != 4) throw std::runtime_error("truncated header in " + path);
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
  };
  const uint32_t magic = read_u32();
  const int dims = static_cast<int>(magic & 0xff);
  if ((magic >> 8) != 0x08 || dims < 1 || dims > 3) throw std::runtime_error("not a uint8 IDX file: " + path);
  std::vector<int64_t> shape;
  for (int d = 0; d < dims; ++d) shape.push_back(read_u32());
  torch::Tensor data = torch::empty(shape, torch::kUInt8);
  const int64_t bytes = data.numel();
  if (gzread(file, data.data_ptr(), static_cast<unsigned>(bytes)) != bytes) {
    throw std::runtime_error("truncated data in " + path);
  }
  gzclose(file);
  return data;
}

struct Split {
  torch::Tensor images;  // float [n, 1, 28, 28], normalized
  torch::Tensor labels;  // int64 [n]
};

Split load(const std::string& dir, const std::string& prefix) {
  const auto images = read_idx(dir + "/" + prefix + "-images-idx3-ubyte.gz").to(torch::kFloat).div_(255);
  const auto labels = read_idx(dir + "/" + prefix + "-labels-idx1-ubyte.gz").to(torch::kLong);
  return {images.sub_(0.2860).div_(0.3530).unsqueeze(1), labels};
}

double accuracy(torch::nn::Sequential& net, const Split& test) {
  torch::NoGradGuard no_grad;
  net->eval();
  const auto dtype = net->parameters().front().scalar_type();
  int64_t correct = 0;
  for (int64_t i = 0; i < test.images.size(0); i += 1000) {
    const auto logits =
        net->forward(test.images.narrow(0, i, std::min<int64_t>(1000, test.images.size(0) - i)).to(dtype));
    correct += logits.argmax(1).eq(test.labels.narrow(0, i, logits.size(0))).sum().item<int64_t>();
  }
  net->train();
  return 100.0 * static_cast<double>(correct) / static_cast<double>(test.images.size(0));
}

struct Outcome {
  double accuracy = 0;
  int64_t state_bytes = 0;  ///< the optimizer's state tensors (memsave::optimizer_state_tensors)
  int64_t peak_bytes = 0;   ///< the highest step peak (memsave's meter)
  int64_t model_bytes = 0;  ///< --compare bf16-weights: weights, gradients and state at that peak (the meter)
  double seconds = 0;       ///< training time
};

constexpr int64_t kBatch = 128;

/// The optimizer of a run and its peak learning rate.
struct Optimizer {
  std::string name;     ///< adamw, sgd or lion
  std::string printed;  ///< "AdamW lr 1e-3"
  double lr = 0;
  memsave::OptimizerFactory factory;
};

/// Lion through the Trainer: LibTorch has none, so its fp32 state is Lion8bit's for tensors under its size
/// threshold (here: all of them); 8-bit state is Lion8bit's. Lion has no 4-bit or offloaded state: the
/// Trainer refuses such a recipe with it (memsave::builds_state).
memsave::OptimizerFactory lion(double lr, double weight_decay) {
  return [=](const std::vector<torch::Tensor>& parameters,
             const memsave::Recipe& recipe) -> std::unique_ptr<torch::optim::Optimizer> {
    namespace o = memsave::optim;
    const int64_t min_8bit =
        recipe.state_bits() == 8 ? o::Lion8bitOptions().min_8bit_size() : std::numeric_limits<int64_t>::max();
    return std::make_unique<o::Lion8bit>(
        parameters, o::Lion8bitOptions(lr).weight_decay(weight_decay).min_8bit_size(min_8bit));
  };
}

/// AdamW: lr 1e-3, weight decay 0.01; SGD: lr 0.05, momentum 0.9; Lion: lr 1e-4, weight decay 0.1 (the Lion
/// paper's advice: a rate 3-10x below AdamW's, a decay as much above).
std::optional<Optimizer> optimizer_named(const std::string& name) {
  if (name == "adamw") return Optimizer{name, "AdamW lr 1e-3", 1e-3, memsave::adamw(1e-3, 1e-2)};
  if (name == "sgd") return Optimizer{name, "SGD lr 0.05", 5e-2, memsave::sgd(5e-2, 0.9)};
  if (name == "lion") return Optimizer{name, "Lion lr 1e-4", 1e-4, lion(1e-4, 0.1)};
  return std::nullopt;
}

/// What one step reports to train_loop.
struct StepReport {
  int64_t peak_bytes = 0;
  int64_t model_bytes = 0;  ///< weights, gradients and optimizer state at that peak; 0 when not counted
  double seconds = 0;
};

/// `epochs` passes over the training set in batches of kBatch in a random order, `step(images, labels)`
/// taking each; prints each epoch's test accuracy under `label`. The learning rate falls linearly from
/// `peak_lr` to zero over the run: the accuracy compared is then that of a model that has settled, not a
/// snapshot of one still moving (after one epoch at a constant rate, the snapshots of two equally good runs
/// differ by a point or more, depending on where the epoch ends).
template <typename Step>
Outcome train_loop(torch::nn::Sequential& net, torch::optim::Optimizer& optimizer, double peak_lr,
                   const std::string& label, const Split& train_set, const Split& test, int epochs,
                   Step&& step) {
  const int64_t n = train_set.images.size(0);
  const int64_t steps = epochs * (n / kBatch);
  int64_t done = 0;
  Outcome outcome;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    const auto order = torch::randperm(n, torch::kLong);
    for (int64_t i = 0; i + kBatch <= n; i += kBatch, ++done) {
      for (auto& group : optimizer.param_groups())
        group.options().set_lr(peak_lr * static_cast<double>(steps - done) / static_cast<double>(steps));
      const auto index = order.narrow(0, i, kBatch);
      const StepReport report =
          step(train_set.images.index_select(0, index), train_set.labels.index_select(0, index));
      if (report.peak_bytes > outcome.peak_bytes) {
        outcome.peak_bytes = report.peak_bytes;
        outcome.model_bytes = report.model_bytes;
      }
      outcome.seconds += report.seconds;
    }
    std::printf("  %-40s epoch %d: test accuracy %.2f%%\n", label.c_str(), epoch + 1, accuracy(net, test));
    std::fflush(stdout);
  }
  for (const auto& t : memsave::optimizer_state_tensors(optimizer))
    outcome.state_bytes += t.numel() * t.element_size();
  outcome.accuracy = accuracy(net, test);
  return outcome;
}

Outcome train(const Optimizer& optimizer, const memsave::Recipe& recipe, const Split& train_set,
              const Split& test, int epochs) {
  torch::manual_seed(0);
  auto net = memsave::zoo::fashion_cnn();
  memsave::Trainer trainer(net, optimizer.factory, recipe);
  auto loss = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
  return train_loop(net, trainer.optimizer(), optimizer.lr, recipe.label(), train_set, test, epochs,
                    [&](const torch::Tensor& images, const torch::Tensor& labels) {
                      const memsave::StepStats stats = trainer.step(images, labels, loss);
                      return StepReport{stats.peak_bytes, 0, stats.seconds};
                    });
}

/// `--compare bf16-weights`: a plain LibTorch loop over the model in `dtype`, with AdamW (lr 1e-3, weight
/// decay 0.01): LibTorch's for fp32 weights, AdamW8bit for bf16 ones, rounding new weights to nearest or
/// stochastically. The logits are cast to fp32 for the loss. Peak: the meter's, with its breakdown.
Outcome train_weights(torch::ScalarType dtype, bool stochastic, const std::string& label,
                      const Split& train_set, const Split& test, int epochs) {
  torch::manual_seed(0);
  auto net = memsave::zoo::fashion_cnn();
  net->to(dtype);
  const double peak_lr = 1e-3;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (dtype == torch::kFloat) {
    optimizer = std::make_unique<torch::optim::AdamW>(net->parameters(),
                                                      torch::optim::AdamWOptions(peak_lr).weight_decay(1e-2));
  } else {
    optimizer = std::make_unique<memsave::optim::AdamW8bit>(
        net->parameters(),
        memsave::optim::AdamW8bitOptions(peak_lr).weight_decay(1e-2).bf16_stochastic_round(stochastic));
  }
  return train_loop(
      net, *optimizer, peak_lr, label, train_set, test, epochs,
      [&](const torch::Tensor& images, const torch::Tensor& labels) {
        const auto start = std::chrono::steady_clock::now();
        memsave::PeakScope scope(torch::kCPU);
        optimizer->zero_grad();
        torch::nn::functional::cross_entropy(net->forward(images.to(dtype)).to(torch::kFloat), labels)
            .backward();
        optimizer->step();
        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        const int64_t peak = scope.peak();
        const memsave::MemoryBreakdown parts =  // counted after the clock stops and the peak is read
            memsave::breakdown(peak, net->parameters(), optimizer.get(), torch::kCPU);
        return StepReport{peak, parts.parameters + parts.gradients + parts.optimizer_state, seconds};
      });
}

/// Prints the three runs of `--compare bf16-weights`; 0 when the stochastic run is within `tolerance` of
/// fp32.
int compare_bf16_weights(const Split& train_set, const Split& test, int epochs, double tolerance) {
  const Outcome base = train_weights(torch::kFloat, false, "fp32 weights, AdamW", train_set, test, epochs);
  const Outcome nearest =
      train_weights(torch::kBFloat16, false, "bf16 weights, AdamW8bit, nearest", train_set, test, epochs);
  const Outcome stochastic =
      train_weights(torch::kBFloat16, true, "bf16 weights, AdamW8bit, stochastic", train_set, test, epochs);
  std::printf(
      "test accuracy: fp32 weights %.2f%%; bf16 weights rounded to nearest %.2f%% (%+.2f points), "
      "stochastically %.2f%% (%+.2f points, tolerance %.2f)\n",
      base.accuracy, nearest.accuracy, nearest.accuracy - base.accuracy, stochastic.accuracy,
      stochastic.accuracy - base.accuracy, tolerance);
  std::printf("weights + gradients + optimizer state: %lld vs %lld bytes (%.2fx smaller)\n",
              static_cast<long long>(base.model_bytes), static_cast<long long>(stochastic.model_bytes),
              static_cast<double>(base.model_bytes) / static_cast<double>(stochastic.model_bytes));
  std::printf(
      "optimizer state: %lld vs %lld bytes; step peak: %s vs %s vs %s; time: %.1f vs %.1f vs %.1f s\n",
      static_cast<long long>(base.state_bytes), static_cast<long long>(stochastic.state_bytes),
      memsave::format_bytes(base.peak_bytes).c_str(), memsave::format_bytes(nearest.peak_bytes).c_str(),
      memsave::format_bytes(stochastic.peak_bytes).c_str(), base.seconds, nearest.seconds,
      stochastic.seconds);
  return std::abs(stochastic.accuracy - base.accuracy) <= tolerance ? 0 : 1;
}

int usage() {
  std::fprintf(
      stderr,
      "usage: fashion_mnist [--epochs N >= 1] [--data DIR] [--limit IMAGES] [--tolerance POINTS]\n"
      "                     [--optimizer adamw|sgd|lion] [--compare 8bit|bf16|bf16-weights]\n"
      "                     [--micro-batch N] [--amp bf16] [--checkpoint every|N] [--state-bits 32|8|4]\n"
      "                     [--max-grad-norm X]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  int epochs = 3;
  int64_t limit = 0;
  double tolerance = -1;
  std::string dir = "/usr/share/datasets/fashion-mnist";
  memsave::Recipe recipe;
  bool any_recipe = false;
  std::optional<Optimizer> optimizer = optimizer_named("adamw");
  bool bf16_weights = false;
  try {
    for (int i = 1; i < argc; i += 2) {
      if (i + 1 >= argc) return usage();
      const std::string flag = argv[i], value = argv[i + 1];
      if (flag == "--epochs") {
        epochs = std::stoi(value);
      } else if (flag == "--data") {
        dir = value;
      } else if (flag == "--limit") {
        limit = std::stoll(value);
      } else if (flag == "--tolerance") {
        tolerance = std::stod(value);
      } else if (flag == "--optimizer") {
        optimizer = optimizer_named(value);
        if (!optimizer) return usage();
      } else if (flag == "--compare" && value == "8bit") {
        recipe.state_bits(8);
      } else if (flag == "--compare" && value == "bf16") {
        recipe.amp(torch::kBFloat16);
      } else if (flag == "--compare" && value == "bf16-weights") {
        bf16_weights = true;
      } else if (flag == "--micro-batch") {
        recipe.micro_batch(std::stoll(value));
      } else if (flag == "--amp" && value == "bf16") {
        recipe.amp(torch::kBFloat16);
      } else if (flag == "--checkpoint") {
        recipe.checkpoint(value == "every" ? memsave::Checkpointing::every_layer()
                                           : memsave::Checkpointing::segments(std::stoll(value)));
      } else if (flag == "--state-bits") {
        recipe.state_bits(std::stoll(value));
      } else if (flag == "--max-grad-norm") {
        recipe.max_grad_norm(std::stod(value));
      } else {
        return usage();
      }
      any_recipe = any_recipe ||
                   (flag != "--epochs" && flag != "--data" && flag != "--limit" && flag != "--tolerance" &&
                    flag != "--optimizer" && !(flag == "--compare" && value == "bf16-weights"));
    }
  } catch (const std::exception&) {
    return usage();
  }
  if (epochs < 1 || limit < 0) return usage();
  if (bf16_weights && (any_recipe || optimizer->name != "adamw")) {
    std::fprintf(stderr, "fashion_mnist: --compare bf16-weights takes no recipe and trains with AdamW\n");
    return 2;
  }
  if (optimizer->name == "lion" && recipe.state_bits() == 4) {
    std::fprintf(stderr, "fashion_mnist: Lion has no 4-bit state (memsave/optim.h says why)\n");
    return 2;
  }
  if (!any_recipe) recipe.state_bits(8);  // the default comparison: fp32 state against 8-bit
  // Within 0.5 points for one technique, 1 point for a combination, unless --tolerance says otherwise.
  const int techniques = (recipe.micro_batch() > 0) + recipe.amp().has_value() +
                         (recipe.checkpoint().kind != memsave::Checkpointing::Kind::kNone) +
                         (recipe.state_bits() != 32) + (recipe.max_grad_norm() > 0);
  if (tolerance < 0) tolerance = techniques > 1 ? 1.0 : 0.5;
  try {
    Split train_set = load(dir, "train");
    const Split test = load(dir, "t10k");
    if (limit > 0 && limit < train_set.images.size(0))
      train_set = {train_set.images.narrow(0, 0, limit), train_set.labels.narrow(0, 0, limit)};
    std::printf(
        "Fashion-MNIST: %lld training and %lld test images, %d epochs, batch 128, %s falling linearly to 0\n",
        static_cast<long long>(train_set.images.size(0)), static_cast<long long>(test.images.size(0)), epochs,
        optimizer->printed.c_str());
    if (bf16_weights) return compare_bf16_weights(train_set, test, epochs, tolerance);
    std::printf("recipe: %s\n", recipe.to_cpp().c_str());
    const Outcome base = train(*optimizer, memsave::Recipe(), train_set, test, epochs);
    const Outcome other = train(*optimizer, recipe, train_set, test, epochs);
    const std::string name = optimizer->printed.substr(0, optimizer->printed.find(' '));
    std::printf("test accuracy: fp32 %s %.2f%%, %s %.2f%% (difference %+.2f points, tolerance %.2f)\n",
                name.c_str(), base.accuracy, recipe.label().c_str(), other.accuracy,
                other.accuracy - base.accuracy, tolerance);
    std::printf(
        "optimizer state: %lld vs %lld bytes (%.2fx smaller); step peak: %s vs %s; time: %.1f vs %.1f s\n",
        static_cast<long long>(base.state_bytes), static_cast<long long>(other.state_bytes),
        static_cast<double>(base.state_bytes) / static_cast<double>(other.state_bytes),
        memsave::format_bytes(base.peak_bytes).c_str(), memsave::format_bytes(other.peak_bytes).c_str(),
        base.seconds, other.seconds);
    return std::abs(other.accuracy - base.accuracy) <= tolerance ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 2;
  }
}
