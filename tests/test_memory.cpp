#include <memsave/memory.h>

#include "../src/memory_internal.h"
#include "intra_op_threads.h"

#include <ftw.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace memsave {
namespace {

const torch::Device kCPU(torch::kCPU);

int64_t in_use() { return memory_stats(kCPU).current; }

TEST(Meter, CountsExactlyTheBytesOfEachTensor) {
  install_meter();
  const int64_t before = in_use();
  const int64_t blocks = memory_stats(kCPU).blocks;
  {
    const torch::Tensor a = torch::empty({1000}, torch::kFloat);
    EXPECT_EQ(in_use() - before, 4000);
    const torch::Tensor b = torch::empty({3, 7}, torch::kDouble);
    const torch::Tensor c = torch::empty({5}, torch::kHalf);
    EXPECT_EQ(in_use() - before, 4000 + 21 * 8 + 5 * 2);
    EXPECT_EQ(memory_stats(kCPU).blocks - blocks, 3);
    const torch::Tensor view = a.view({10, 100});  // a view owns no storage
    EXPECT_EQ(in_use() - before, 4000 + 21 * 8 + 5 * 2);
    const torch::Tensor empty = torch::empty({0}, torch::kFloat);
    EXPECT_EQ(in_use() - before, 4000 + 21 * 8 + 5 * 2);
  }
  EXPECT_EQ(in_use(), before);
  EXPECT_EQ(memory_stats(kCPU).blocks, blocks);
}

TEST(Meter, CountsTheOutputsOfOperators) {
  const torch::Tensor x = torch::randn({256, 128});
  const int64_t before = in_use();
  const torch::Tensor y = torch::matmul(x, x.t());
  EXPECT_EQ(in_use() - before, 256 * 256 * 4);
}

TEST(Meter, CountsAllocationsFromParallelThreads) {
  const int64_t before = in_use();
  constexpr int kThreads = 8, kTensors = 200;
  std::vector<std::vector<torch::Tensor>> held(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&held, t] {
      for (int i = 0; i < kTensors; ++i) held[t].push_back(torch::empty({t * 100 + i + 1}, torch::kFloat));
    });
  }
  for (auto& t : threads) t.join();
  int64_t expected = 0;
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kTensors; ++i) expected += 4 * (t * 100 + i + 1);
  }
  EXPECT_EQ(in_use() - before, expected);
  threads.clear();
  for (int t = 0; t < kThreads; ++t) threads.emplace_back([&held, t] { held[t].clear(); });
  for (auto& t : threads) t.join();
  EXPECT_EQ(in_use(), before);
}

TEST(Meter, CountsLibTorchIntraOpThreads) {
  const memsave::testing::IntraOpThreads threads(4);
  const torch::Tensor x = torch::randn({1 << 20});
  const int64_t before = in_use();
  const torch::Tensor y = x.sum({0}, /*keepdim=*/false) + torch::softmax(x, 0).cumsum(0);
  EXPECT_EQ(in_use() - before, 4 << 20);
}

TEST(Meter, PeakResetsToTheCurrentBytes) {
  const int64_t before = in_use();
  { const torch::Tensor big = torch::empty({1 << 20}, torch::kFloat); }
  EXPECT_GE(memory_stats(kCPU).peak, before + (4 << 20));
  reset_peak(kCPU);
  EXPECT_EQ(memory_stats(kCPU).peak, in_use());
}

TEST(Budget, ThrowsOutOfMemoryWithTheNumbersAndChangesNothing) {
  const torch::Tensor keep = torch::ones({100});
  const int64_t before = in_use();
  const int64_t peak = memory_stats(kCPU).peak;
  const int64_t budget = before + 1000;
  ScopedBudget scoped(kCPU, budget);
  EXPECT_EQ(memory_stats(kCPU).budget, budget);
  try {
    const torch::Tensor big = torch::empty({1000}, torch::kFloat);
    FAIL() << "a 4000-byte tensor passed a budget with 1000 bytes free";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("tried to allocate 3.91 KiB (4000 bytes)"), std::string::npos) << message;
    EXPECT_NE(message.find("(" + std::to_string(before) + " bytes) in use"), std::string::npos) << message;
    EXPECT_NE(message.find("(" + std::to_string(budget) + " bytes)"), std::string::npos) << message;
  }
  EXPECT_EQ(in_use(), before);
  EXPECT_EQ(memory_stats(kCPU).peak, peak);
  const torch::Tensor fits = torch::empty({250}, torch::kFloat);  // exactly at the budget
  EXPECT_EQ(in_use(), budget);
}

TEST(Budget, ScopedBudgetRestoresThePreviousOne) {
  EXPECT_FALSE(get_budget(kCPU).has_value());
  {
    ScopedBudget outer(kCPU, int64_t{1} << 40);
    {
      ScopedBudget inner(kCPU, int64_t{1} << 30);
      EXPECT_EQ(get_budget(kCPU), int64_t{1} << 30);
    }
    EXPECT_EQ(get_budget(kCPU), int64_t{1} << 40);
  }
  EXPECT_FALSE(get_budget(kCPU).has_value());
  EXPECT_NO_THROW(torch::empty({1 << 20}));
  EXPECT_THROW(set_budget(kCPU, -1), c10::Error);
}

TEST(HostMemory, AvailableIsPositiveAndAtMostThePhysicalMemory) {
  const int64_t physical = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  const int64_t available = host_memory_available();
  EXPECT_GT(available, 0);
  EXPECT_LE(available, physical);
}

/// Removes the tree at `root`, if any. NOTE: not std::filesystem::remove_all: LibTorch 2.11's libtorch.so
/// exports its own copy of that function (from the libstdc++ it links statically, pytorch/pytorch#133437),
/// the program binds to it, and it crashes there (a jump to address 0).
void remove_tree(const std::string& root) {
  nftw(
      root.c_str(), [](const char* path, const struct stat*, int, struct FTW*) { return std::remove(path); },
      16, FTW_DEPTH | FTW_PHYS);
}

/// A file tree standing for a machine's /proc and /sys/fs/cgroup.
class FakeHost {
 public:
  FakeHost() : root_(::testing::TempDir() + "memsave_fake_host_" + std::to_string(getpid())) {
    remove_tree(root_);
    write("/proc/meminfo",
          "MemTotal:       33554432 kB\nMemFree:         1048576 kB\n"
          "MemAvailable:    8388608 kB\nBuffers:          131072 kB\n");  // 8 GiB available
  }
  ~FakeHost() { remove_tree(root_); }
  void write(const std::string& path, const std::string& text) const {
    std::filesystem::create_directories(std::filesystem::path(root_ + path).parent_path());
    std::ofstream(root_ + path) << text;
  }
  int64_t available() const { return detail::host_memory_available(root_); }

 private:
  std::string root_;
};

constexpr int64_t kGiB = int64_t{1} << 30;

TEST(HostMemory, IsMemAvailableWithoutACgroupLimit) {
  FakeHost host;
  EXPECT_EQ(host.available(), 8 * kGiB);
  // cgroup v1 without a limit (the kernel's largest page count) and cgroup v2's "max"
  host.write("/proc/self/cgroup", "5:devices:/\n4:memory:/user.slice\n0::/\n");
  host.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  host.write("/sys/fs/cgroup/memory/memory.usage_in_bytes", "1073741824\n");
  EXPECT_EQ(host.available(), 8 * kGiB);
  host.write("/proc/self/cgroup", "4:memory:no-slash\n");  // malformed: no such cgroup, and the walk ends
  host.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", std::to_string(kGiB) + "\n");
  host.write("/sys/fs/cgroup/memory/memory.usage_in_bytes", "0\n");
  EXPECT_EQ(host.available(), 8 * kGiB);
}

TEST(HostMemory, AContainersCgroupV2LimitLessItsUsageButTheInactiveFileCache) {
  FakeHost host;
  host.write("/proc/self/cgroup", "0::/pod/container\n");
  host.write("/sys/fs/cgroup/cgroup.controllers", "cpu memory\n");
  host.write("/sys/fs/cgroup/pod/container/memory.max", "max\n");
  host.write("/sys/fs/cgroup/pod/container/memory.current", "104857600\n");
  // the pod's limit binds: 2 GiB, 1.5 GiB used of which 0.5 GiB is inactive file cache
  host.write("/sys/fs/cgroup/pod/memory.max", std::to_string(2 * kGiB) + "\n");
  host.write("/sys/fs/cgroup/pod/memory.current", std::to_string(3 * kGiB / 2) + "\n");
  host.write("/sys/fs/cgroup/pod/memory.stat",
             "anon 1073741824\nfile 536870912\nactive_file 0\ninactive_file 536870912\n");
  EXPECT_EQ(host.available(), kGiB);
  // a usage past the limit leaves nothing
  host.write("/sys/fs/cgroup/pod/memory.stat", "inactive_file 0\n");
  host.write("/sys/fs/cgroup/pod/memory.current", std::to_string(3 * kGiB) + "\n");
  EXPECT_EQ(host.available(), 0);
}

TEST(HostMemory, ACgroupV1LimitSeenFromInsideItsContainer) {
  FakeHost host;
  // The path is the host's; the container sees its own cgroup at the mount's root.
  host.write("/proc/self/cgroup", "4:memory:/docker/0123abcd\n0::/\n");
  host.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", std::to_string(3 * kGiB) + "\n");
  host.write("/sys/fs/cgroup/memory/memory.usage_in_bytes", std::to_string(kGiB + kGiB / 4) + "\n");
  host.write("/sys/fs/cgroup/memory/memory.stat", "cache 268435456\ntotal_inactive_file 268435456\n");
  EXPECT_EQ(host.available(), 2 * kGiB);
  // a limit above MemAvailable does not raise it
  host.write("/sys/fs/cgroup/memory/memory.limit_in_bytes", std::to_string(64 * kGiB) + "\n");
  EXPECT_EQ(host.available(), 8 * kGiB);
}

TEST(Budget, AnOutOfMemoryInsideAStepLeavesTheModelAsItWas) {
  torch::nn::Linear model(64, 64);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  const torch::Tensor before = model->weight.clone();
  {
    ScopedBudget scoped(kCPU, in_use() + 1024);
    EXPECT_THROW(
        {
          const torch::Tensor loss = model(torch::randn({128, 64})).sum();
          loss.backward();
          optimizer.step();
        },
        c10::OutOfMemoryError);
  }
  EXPECT_TRUE(torch::equal(model->weight, before));
}

// On a machine without a GPU, asking the meter about CUDA says so in memsave's words, whichever device is
// named (the CUDA runtime's own error about an insufficient driver is no help).
TEST(Meter, CudaWithoutADeviceIsAClearError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a CUDA device is present";
  const std::vector<std::function<void()>> calls = {
      [] { memory_stats(torch::kCUDA); }, [] { PeakScope scope(torch::kCUDA); },
      [] { reset_peak(torch::Device(torch::kCUDA, 0)); }, [] { ScopedBudget budget(torch::kCUDA, 1 << 20); }};
  for (const auto& call : calls) {
    try {
      call();
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.rfind("memsave: no CUDA device", 0) == 0 ||
                  what.rfind("memsave: this build has no CUDA", 0) == 0)
          << what.substr(0, 200);
    }
  }
}

TEST(PeakScope, MeasuresFromItsStartAndNests) {
  const int64_t start = in_use();
  PeakScope outer(kCPU);
  EXPECT_EQ(outer.start(), start);
  EXPECT_EQ(outer.peak(), start);
  { const torch::Tensor a = torch::empty({2 << 20}, torch::kByte); }
  EXPECT_EQ(outer.peak(), start + (2 << 20));
  {
    PeakScope inner(kCPU);
    EXPECT_EQ(inner.peak(), start);
    { const torch::Tensor b = torch::empty({1 << 20}, torch::kByte); }
    EXPECT_EQ(inner.peak(), start + (1 << 20));
  }
  EXPECT_EQ(outer.peak(), start + (2 << 20));
  {
    PeakScope inner(kCPU);
    { const torch::Tensor c = torch::empty({3 << 20}, torch::kByte); }
  }
  EXPECT_EQ(outer.peak(), start + (3 << 20));
  EXPECT_GE(memory_stats(kCPU).peak, start + (3 << 20));
}

TEST(HostArena, IsCountedApartFromTheDevicePool) {
  const int64_t device_before = in_use();
  const int64_t host_before = host_memory_stats().current;
  {
    const torch::Tensor h = host_empty({1024}, torch::kFloat);
    EXPECT_EQ(h.device(), kCPU);
    EXPECT_EQ(h.numel(), 1024);
    EXPECT_EQ(host_memory_stats().current - host_before, 4096);
    EXPECT_EQ(in_use(), device_before);
    h.fill_(2.5);
    EXPECT_EQ(h.sum().item<double>(), 2560.0);
    EXPECT_EQ(host_memory_stats().current - host_before, 4096);
  }
  EXPECT_EQ(host_memory_stats().current, host_before);
  EXPECT_GE(host_memory_stats().peak, host_before + 4096);
  EXPECT_EQ(host_memory_is_pinned(), torch::cuda::is_available());
}

int64_t bytes_of(const std::vector<torch::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.numel() * t.element_size();
  return bytes;
}

TEST(Breakdown, SplitsATrainingStepAndSumsToTheTotal) {
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 10));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  const torch::Tensor x = torch::randn({16, 32});
  PeakScope scope(kCPU);
  optimizer.zero_grad();
  model->forward(x).square().mean().backward();
  optimizer.step();
  const MemoryBreakdown parts = breakdown(scope.peak(), model->parameters(), &optimizer, kCPU);
  for (const auto& t : optimizer_state_tensors(optimizer)) EXPECT_TRUE(t.defined());  // no max_exp_avg_sq
  EXPECT_EQ(optimizer_state_tensors(optimizer).size(), 2 * model->parameters().size());
  const int64_t param_bytes = bytes_of(model->parameters());
  EXPECT_EQ(param_bytes, 4 * (32 * 64 + 64 + 64 * 10 + 10));
  EXPECT_EQ(parts.parameters, param_bytes);
  EXPECT_EQ(parts.gradients, param_bytes);
  EXPECT_EQ(parts.optimizer_state, 2 * param_bytes);
  EXPECT_EQ(parts.total, scope.peak());
  EXPECT_EQ(parts.parameters + parts.gradients + parts.optimizer_state + parts.other, parts.total);
  EXPECT_GT(parts.other, 0);
}

TEST(Breakdown, CountsSgdMomentumAndRejectsAnImpossiblePeak) {
  torch::nn::Linear model(10, 10);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  model(torch::randn({4, 10})).sum().backward();
  optimizer.step();
  const std::vector<torch::Tensor> state = optimizer_state_tensors(optimizer);
  EXPECT_EQ(bytes_of(state), 4 * 110);
  EXPECT_THROW(breakdown(100, model->parameters(), &optimizer, kCPU), c10::Error);
  const MemoryBreakdown without = breakdown(10000, model->parameters(), nullptr, kCPU);
  EXPECT_EQ(without.optimizer_state, 0);
  EXPECT_EQ(without.other, 10000 - 2 * 4 * 110);
}

struct CustomState : torch::optim::OptimizerCloneableParamState<CustomState> {};

struct CustomOptimizer : torch::optim::Optimizer {
  explicit CustomOptimizer(std::vector<torch::Tensor> params)
      : Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                  std::make_unique<torch::optim::SGDOptions>(0.1)) {
    state_[param_groups_[0].params()[0].unsafeGetTensorImpl()] = std::make_unique<CustomState>();
  }
  torch::Tensor step(LossClosure = nullptr) override { return {}; }
};

TEST(Breakdown, RefusesToGuessAnUnknownStateType) {
  torch::nn::Linear model(2, 2);
  CustomOptimizer optimizer(model->parameters());
  try {
    optimizer_state_tensors(optimizer);
    FAIL() << "an unknown state type was counted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("StateTensors"), std::string::npos);
  }
}

}  // namespace
}  // namespace memsave
