#include "byte_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

namespace memsave::kernels {
namespace {

TEST(BytePool, CountsReservationsAndPeakExactly) {
  BytePool pool;
  EXPECT_TRUE(pool.reserve(100));
  EXPECT_TRUE(pool.reserve(28));
  EXPECT_EQ(pool.current(), 128);
  EXPECT_EQ(pool.blocks(), 2);
  pool.release(100);
  EXPECT_EQ(pool.current(), 28);
  EXPECT_EQ(pool.peak(), 128);
  pool.reset_peak();
  EXPECT_EQ(pool.peak(), 28);
  pool.release(28);
  EXPECT_EQ(pool.current(), 0);
  EXPECT_EQ(pool.blocks(), 0);
}

TEST(BytePool, BudgetRefusesWithoutChangingAnything) {
  BytePool pool;
  pool.set_budget(1000);
  EXPECT_TRUE(pool.reserve(600));
  EXPECT_FALSE(pool.reserve(401));
  EXPECT_EQ(pool.current(), 600);
  EXPECT_EQ(pool.peak(), 600);
  EXPECT_EQ(pool.blocks(), 1);
  EXPECT_TRUE(pool.reserve(400));  // exactly at the budget is allowed
  EXPECT_EQ(pool.current(), 1000);
  pool.set_budget(BytePool::kUnbounded);
  EXPECT_TRUE(pool.reserve(INT64_C(1) << 40));
}

TEST(BytePool, RefusesOverflowInsteadOfWrapping) {
  BytePool pool;
  EXPECT_TRUE(pool.reserve(INT64_MAX - 10));
  EXPECT_FALSE(pool.reserve(11));
  EXPECT_EQ(pool.current(), INT64_MAX - 10);
}

TEST(BytePool, ParallelReservationsAreExactAndNeverPassTheBudget) {
  BytePool pool;
  constexpr std::int64_t kBudget = 1 << 18;  // below what one thread can hold, so refusals happen
  pool.set_budget(kBudget);
  std::atomic<std::int64_t> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::uniform_int_distribution<std::int64_t> size(1, 1 << 16);
      std::vector<std::int64_t> held;
      for (int i = 0; i < 20000; ++i) {
        const std::int64_t bytes = size(rng);
        if (pool.reserve(bytes)) {
          held.push_back(bytes);
        } else {
          refused.fetch_add(1);
        }
        if (held.size() > 4 || (!held.empty() && i % 3 == 0)) {
          pool.release(held.back());
          held.pop_back();
        }
      }
      for (std::int64_t bytes : held) pool.release(bytes);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(pool.current(), 0);
  EXPECT_EQ(pool.blocks(), 0);
  EXPECT_LE(pool.peak(), kBudget);
  EXPECT_GT(pool.peak(), 0);
  EXPECT_GT(refused.load(), 0) << "the test must reach the budget to test it";
}

void* refuse(std::size_t) { return nullptr; }
void never_called(void*) { ADD_FAILURE() << "released a block that was never allocated"; }

TEST(Block, CarriesItsSizeAndAlignment) {
  BytePool pool;
  for (std::size_t bytes :
       {std::size_t{1}, std::size_t{63}, std::size_t{64}, std::size_t{4097}, std::size_t{1} << 22}) {
    const Block block = allocate_block(pool, bytes, aligned_host_memory());
    ASSERT_EQ(block.status, BlockStatus::kOk);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(block.data) % kBlockAlignment, 0u);
    EXPECT_EQ(block_size(block.data), bytes);
    EXPECT_EQ(pool.current(), static_cast<std::int64_t>(bytes));
    static_cast<unsigned char*>(block.data)[bytes - 1] = 0xab;  // the whole block is writable
    free_block(block.data);
    EXPECT_EQ(pool.current(), 0);
  }
  EXPECT_EQ(pool.blocks(), 0);
  free_block(nullptr);
}

TEST(Block, OverBudgetNeverTouchesRawMemory) {
  BytePool pool;
  pool.set_budget(100);
  const Block block = allocate_block(pool, 101, RawMemory{&refuse, &never_called});
  EXPECT_EQ(block.status, BlockStatus::kOverBudget);
  EXPECT_EQ(block.data, nullptr);
  EXPECT_EQ(pool.current(), 0);
  EXPECT_EQ(pool.peak(), 0);
}

TEST(Block, FailedRawAllocationLeavesThePoolUnchanged) {
  BytePool pool;
  const Block block = allocate_block(pool, 4096, RawMemory{&refuse, &never_called});
  EXPECT_EQ(block.status, BlockStatus::kOutOfMemory);
  EXPECT_EQ(pool.current(), 0);
  EXPECT_EQ(pool.blocks(), 0);
  const Block huge = allocate_block(pool, SIZE_MAX - 8, aligned_host_memory());
  EXPECT_EQ(huge.status, BlockStatus::kOutOfMemory);
  EXPECT_EQ(pool.current(), 0);
}

TEST(Block, ReturnsToThePoolItCameFrom) {
  BytePool a, b;
  const Block x = allocate_block(a, 10, aligned_host_memory());
  const Block y = allocate_block(b, 20, aligned_host_memory());
  EXPECT_EQ(block_pool(x.data), &a);
  EXPECT_EQ(block_pool(y.data), &b);
  free_block(y.data);
  EXPECT_EQ(a.current(), 10);
  EXPECT_EQ(b.current(), 0);
  free_block(x.data);
  EXPECT_EQ(a.current(), 0);
}

}  // namespace
}  // namespace memsave::kernels
