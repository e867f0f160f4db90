// What memsave reads of autograd graphs: a walk over the nodes behind some outputs, and the nodes memsave
// itself keeps alive (src/offload.cpp holds parameters' gradient accumulators; src/checkpoint.cpp subtracts
// those references when it counts who else uses a parameter).
#pragma once

#include "compat.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <cstdint>
#include <unordered_set>
#include <utility>
#include <vector>

namespace memsave::detail {

/// Calls `visit(node)` once for each node of the graph behind `outputs`, depth first; the walk goes on to
/// the nodes a node's edges lead to where `visit` returns true.
template <typename Visit>
void walk_graph(const std::vector<at::Tensor>& outputs, Visit&& visit) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const at::Tensor& out : outputs)
    if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second || !visit(*node)) continue;
    for (const torch::autograd::Edge& edge : node->next_edges())
      if (edge.function) stack.push_back(edge.function.get());
  }
}

/// A post hook on a parameter's gradient accumulator that does nothing when the accumulator runs without a
/// gradient, as it does in the outer backward after a checkpointed piece added the gradient in its own
/// backward (src/checkpoint.cpp recomputes a piece so only where every post hook on its parameters is one).
struct ToleratesNoGradient : torch::autograd::FunctionPostHook {};

/// How many HeldNode objects hold `node` now.
int64_t times_held(const torch::autograd::Node* node);

/// A reference to an autograd node that is counted by times_held while it lives.
class HeldNode {
 public:
  HeldNode() = default;
  explicit HeldNode(compat::NodeRef node);
  ~HeldNode();
  HeldNode(HeldNode&& other) noexcept : node_(std::exchange(other.node_, compat::NodeRef())) {}
  HeldNode& operator=(HeldNode&& other) noexcept;
  HeldNode(const HeldNode&) = delete;
  HeldNode& operator=(const HeldNode&) = delete;

  torch::autograd::Node* operator->() const { return node_.get(); }
  explicit operator bool() const { return static_cast<bool>(node_); }

 private:
  void release();
  compat::NodeRef node_;
};

}  // namespace memsave::detail
