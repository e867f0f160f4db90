// What memsave reads of autograd graphs: the graph a piece of a forward built, and the nodes memsave
// itself keeps alive (src/offload.cpp holds parameters' gradient accumulators; src/checkpoint.cpp subtracts
// those references when it counts who else uses a parameter).
#pragma once

#include "compat.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace memsave::detail {

/// The graph behind `outputs` from its nodes made from `first_node` on (what one piece of a forward built):
/// the leaves it reaches (the variables of gradient accumulators, each once, in the order found), how many of
/// its nodes' edges lead into each accumulator, and the first node made before `first_node` that it reaches
/// (nullptr: none), where the walk stops. The walk also stops, without counting them as outside, at the nodes
/// in `stops` (where a recomputation's graph joins the caller's through its inputs).
struct GraphSince {
  std::vector<at::Tensor> leaves;
  std::unordered_map<const torch::autograd::Node*, int64_t> edges_into;
  const torch::autograd::Node* outside = nullptr;
};
GraphSince graph_since(const std::vector<at::Tensor>& outputs, uint64_t first_node,
                       const std::unordered_set<const torch::autograd::Node*>& stops = {});

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
