// Room for a LibTorch optimizer's step, made before it changes anything.
#pragma once

#include <torch/optim/optimizer.h>

namespace memsave::detail {

/// LibTorch's Adam, AdamW and SGD allocate while they step, between their in-place updates: each parameter's
/// state at its first step, and temporaries of a parameter's size at every step (Adam's denominator: two; a
/// weight decay's sum in Adam and SGD, and Nesterov's: one each). An out-of-memory there would leave the
/// parameters before it stepped and the rest not. This allocates, and lets go, what the optimizer's step will
/// hold at its highest: the state made up to the parameter whose temporaries reach the most, those
/// temporaries, and on the CPU 64 bytes for the step's scalars. An out-of-memory then comes before anything
/// changed, and the step reuses the room (on the CPU exactly; on CUDA from the caching allocator's cache,
/// which keeps the blocks). Other optimizers are left to themselves: memsave's own allocate before they
/// change anything. The GradScaler's step, the GradientAccumulator's (so the Trainer's) and the
/// OffloadOptimizer's on-device AdamW call it before they step, and the rescue's memory model before the
/// step it profiles, so that predictions include it.
void make_room_for_step(const torch::optim::Optimizer& optimizer);

}  // namespace memsave::detail
