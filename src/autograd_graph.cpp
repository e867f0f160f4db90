#include "autograd_graph.h"

#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <mutex>
#include <unordered_map>
#include <unordered_set>

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

GraphSince graph_since(const std::vector<at::Tensor>& outputs, uint64_t first_node,
                       const std::unordered_set<const torch::autograd::Node*>& stops) {
  GraphSince graph;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<const torch::autograd::Node*> stack;
  for (const at::Tensor& out : outputs)
    if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  while (!stack.empty()) {
    const torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (const auto* leaf = dynamic_cast<const torch::autograd::AccumulateGrad*>(node)) {
      graph.leaves.push_back(leaf->variable);
      continue;
    }
    if (stops.count(node)) continue;
    if (node->sequence_nr() < first_node) {
      if (graph.outside == nullptr) graph.outside = node;
      continue;
    }
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (!edge.function) continue;
      if (dynamic_cast<const torch::autograd::AccumulateGrad*>(edge.function.get()))
        ++graph.edges_into[edge.function.get()];
      stack.push_back(edge.function.get());
    }
  }
  return graph;
}

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
