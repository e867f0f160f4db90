#include "byte_pool.h"

#include <cstdlib>
#include <limits>
#include <new>

namespace memsave::kernels {

bool BytePool::reserve(std::int64_t bytes) noexcept {
  std::int64_t now = current_.load(std::memory_order_relaxed);
  std::int64_t next = 0;
  do {
    const std::int64_t limit = budget();
    if (bytes > std::numeric_limits<std::int64_t>::max() - now) return false;
    next = now + bytes;
    if (limit != kUnbounded && next > limit) return false;
  } while (!current_.compare_exchange_weak(now, next, std::memory_order_relaxed));
  blocks_.fetch_add(1, std::memory_order_relaxed);
  std::int64_t seen = peak_.load(std::memory_order_relaxed);
  while (next > seen && !peak_.compare_exchange_weak(seen, next, std::memory_order_relaxed)) {
  }
  return true;
}

void BytePool::release(std::int64_t bytes) noexcept {
  current_.fetch_sub(bytes, std::memory_order_relaxed);
  blocks_.fetch_sub(1, std::memory_order_relaxed);
}

namespace {

struct alignas(kBlockAlignment) BlockHeader {
  std::size_t bytes;
  BytePool* pool;
  void (*release)(void*);
};
static_assert(sizeof(BlockHeader) == kBlockAlignment, "the header must keep the data aligned");

BlockHeader* header_of(const void* data) {
  return reinterpret_cast<BlockHeader*>(const_cast<char*>(static_cast<const char*>(data)) -
                                        sizeof(BlockHeader));
}

void* aligned_allocate(std::size_t bytes) {
  void* ptr = nullptr;
  return posix_memalign(&ptr, kBlockAlignment, bytes) == 0 ? ptr : nullptr;
}

}  // namespace

RawMemory aligned_host_memory() noexcept { return RawMemory{&aligned_allocate, &std::free}; }

Block allocate_block(BytePool& pool, std::size_t bytes, RawMemory raw) noexcept {
  if (bytes > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()) - sizeof(BlockHeader)) {
    return {nullptr, BlockStatus::kOutOfMemory};
  }
  const auto accounted = static_cast<std::int64_t>(bytes);
  if (!pool.reserve(accounted)) return {nullptr, BlockStatus::kOverBudget};
  void* base = raw.allocate(bytes + sizeof(BlockHeader));
  if (base == nullptr) {
    pool.release(accounted);
    return {nullptr, BlockStatus::kOutOfMemory};
  }
  auto* header = new (base) BlockHeader{bytes, &pool, raw.release};
  return {header + 1, BlockStatus::kOk};
}

void free_block(void* data) noexcept {
  if (data == nullptr) return;
  BlockHeader* header = header_of(data);
  const BlockHeader copy = *header;
  copy.pool->release(static_cast<std::int64_t>(copy.bytes));
  copy.release(header);
}

std::size_t block_size(const void* data) noexcept { return header_of(data)->bytes; }

const BytePool* block_pool(const void* data) noexcept { return header_of(data)->pool; }

}  // namespace memsave::kernels
