// One CPU tier's kernels: kernels.h on the vector header this tier names, built into its own
// library with its own flags (kernels/__init__.py): -DSPECEE_TIER=avx2
// -DSPECEE_VEC_HEADER='"vec_avx2.h"' -mavx2 -mfma -ffp-contract=off, say. No torch headers: the
// NEON tier builds with a cross compiler and runs its checks under qemu.
#include SPECEE_VEC_HEADER
#include "kernels.h"

#define SPECEE_PASTE(a, b) a##b
#define SPECEE_TABLE(tier) SPECEE_PASTE(specee_kernel_table_, tier)
#define SPECEE_STRING(x) #x
#define SPECEE_NAME(x) SPECEE_STRING(x)

extern "C" __attribute__((visibility("default"))) const specee::KernelTable* SPECEE_TABLE(SPECEE_TIER)() {
  return specee::kernels::table(SPECEE_NAME(SPECEE_TIER));
}
