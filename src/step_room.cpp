#include "step_room.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <unordered_set>
#include <vector>

namespace memsave::detail {

void make_room_for_step(const torch::optim::Optimizer& optimizer) {
  const bool adamw = dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr;
  const bool adam = dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr;
  const bool sgd = dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr;
  if (!adamw && !adam && !sgd) return;
  struct Stepped {
    torch::Tensor param;
    int new_state;    ///< state tensors its step makes (its first)
    int temporaries;  ///< tensors of its size its step allocates and lets go
  };
  std::vector<Stepped> order;  // as the step goes: groups, then their parameters
  std::unordered_set<const void*> created;
  for (const auto& group : optimizer.param_groups()) {
    int state = 0, temporaries = 0;
    if (adamw) {
      const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
      state = o.amsgrad() ? 3 : 2;
      temporaries = 2;
    } else if (adam) {
      const auto& o = static_cast<const torch::optim::AdamOptions&>(group.options());
      state = o.amsgrad() ? 3 : 2;
      temporaries = 2 + (o.weight_decay() != 0 ? 1 : 0);
    } else {
      const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
      state = o.momentum() != 0 ? 1 : 0;
      temporaries = (o.weight_decay() != 0 ? 1 : 0) + (o.momentum() != 0 && o.nesterov() ? 1 : 0);
    }
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      void* key = p.unsafeGetTensorImpl();
      const bool fresh = optimizer.state().count(key) == 0 && created.insert(key).second;
      order.push_back({p, fresh ? state : 0, temporaries});
    }
  }
  size_t worst = 0;
  int64_t made = 0, peak = -1;
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t bytes = static_cast<int64_t>(order[i].param.nbytes());
    made += order[i].new_state * bytes;
    if (made + order[i].temporaries * bytes > peak) {
      peak = made + order[i].temporaries * bytes;
      worst = i;
    }
  }
  // NOTE: a step that allocates no tensor (SGD's with its state made, without weight decay or Nesterov)
  // allocates its first scalar before its first update: it runs whole or not at all already.
  if (peak <= 0) return;
  std::vector<torch::Tensor> room;
  // NOTE: on the CPU the step's scalars (12 bytes in LibTorch 2.15's AdamW) come from the same pool.
  if (order[worst].param.is_cpu()) room.push_back(at::empty({64}, at::kByte));
  for (size_t i = 0; i <= worst; ++i)
    for (int k = 0; k < order[i].new_state; ++k) room.push_back(at::empty_like(order[i].param));
  for (int k = 0; k < order[worst].temporaries; ++k) room.push_back(at::empty_like(order[worst].param));
}

}  // namespace memsave::detail
