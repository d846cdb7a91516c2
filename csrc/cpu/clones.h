// KDA_CLONES: function multi-versioning for the elementwise loops outside the per-ISA kernel files
// (the chunk code's decay products and pair loops, the backward's chain rule): each function is
// compiled for AVX-512 (x86-64-v4) and AVX2+FMA (x86-64-v3) besides the baseline, and the loader
// picks one clone per machine (GCC's target_clones). One machine always runs the same clone, so
// results stay bitwise reproducible there; TORCH_KDA_ISA does not change the choice. Clang (14)
// does not multi-version templates: built with Clang, these loops take the baseline only.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__APPLE__)
#define KDA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KDA_CLONES
#endif
