#include "autograd_graph.h"

#include <mutex>
#include <unordered_map>

namespace memsave::detail {
namespace {

std::mutex& held_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<const torch::autograd::Node*, int64_t>& held() {
  static auto* counts = new std::unordered_map<const torch::autograd::Node*, int64_t>();  // never destroyed
  return *counts;
}

}  // namespace

int64_t times_held(const torch::autograd::Node* node) {
  std::lock_guard<std::mutex> lock(held_mutex());
  const auto it = held().find(node);
  return it == held().end() ? 0 : it->second;
}

HeldNode::HeldNode(compat::NodeRef node) : node_(std::move(node)) {
  if (!node_) return;
  std::lock_guard<std::mutex> lock(held_mutex());
  ++held()[node_.get()];
}

HeldNode::~HeldNode() { release(); }

HeldNode& HeldNode::operator=(HeldNode&& other) noexcept {
  if (this != &other) {
    release();
    node_ = std::exchange(other.node_, compat::NodeRef());
  }
  return *this;
}

void HeldNode::release() {
  if (!node_) return;
  {
    std::lock_guard<std::mutex> lock(held_mutex());
    const auto it = held().find(node_.get());
    if (--it->second == 0) held().erase(it);
  }
  node_ = compat::NodeRef();
}

}  // namespace memsave::detail
