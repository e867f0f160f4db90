// The meter for Python peers: loaded with ctypes into a Python process that imported the same LibTorch, it
// installs memsave's counting CPU allocator there, so the peers' bytes are counted exactly as memsave's.
#include <memsave/memory.h>

#include <cstdint>

extern "C" {
void memsave_install_meter() { memsave::install_meter(); }
int64_t memsave_cpu_current() { return memsave::memory_stats(c10::kCPU).current; }
int64_t memsave_cpu_peak() { return memsave::memory_stats(c10::kCPU).peak; }
void memsave_cpu_reset_peak() { memsave::reset_peak(c10::kCPU); }
}
