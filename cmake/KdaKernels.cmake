# The recurrence kernels (csrc/cpu/kernels/*.cpp) use no torch headers and are compiled once per
# instruction set; csrc/cpu/isa_dispatch.cpp picks one at run time (__builtin_cpu_supports), so
# the library runs on any x86-64 CPU and uses AVX-512 where present.
set(KDA_KERNEL_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/../csrc/cpu/kernels/recurrent_kernels.cpp
  ${CMAKE_CURRENT_LIST_DIR}/../csrc/cpu/kernels/serving_kernels.cpp)

set(KDA_KERNEL_OBJECTS "")
set(KDA_KERNEL_DEFINITIONS "")
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64" AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  set(_kda_isas avx512 avx2 generic)
  set(_kda_flags_avx512 -mavx512f -mavx512vl -mavx512bw -mavx512dq -mavx2 -mfma -mf16c -mprefer-vector-width=512)
  set(_kda_flags_avx2 -mavx2 -mfma -mf16c)
  set(_kda_flags_generic "")
  list(APPEND KDA_KERNEL_DEFINITIONS KDA_HAVE_X86_ISAS=1)
else()
  set(_kda_isas generic)
  set(_kda_flags_generic "")
endif()
foreach(_isa IN LISTS _kda_isas)
  add_library(kda_kernels_${_isa} OBJECT ${KDA_KERNEL_SOURCES})
  target_compile_definitions(kda_kernels_${_isa} PRIVATE KDA_ISA=${_isa})
  target_include_directories(kda_kernels_${_isa} PRIVATE ${CMAKE_CURRENT_LIST_DIR}/../csrc)
  target_compile_options(kda_kernels_${_isa} PRIVATE -O3 -ffp-contract=fast -Wno-psabi ${_kda_flags_${_isa}})
  list(APPEND KDA_KERNEL_OBJECTS $<TARGET_OBJECTS:kda_kernels_${_isa}>)
endforeach()
