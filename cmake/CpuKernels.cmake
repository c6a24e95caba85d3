# jf2_add_cpu_kernels(<out_var>): compiles src/cpu/cpu_kernels.cc once per
# instruction set (baseline x86-64, AVX2+FMA, AVX-512), each into its own
# namespace, and sets <out_var> to the object files. flash_cpu.cc picks one at
# run time, so a wheel never depends on the build machine (no -march=native).
function(jf2_add_cpu_kernels out_var)
  set(flags_baseline "")
  set(flags_avx2 -mavx2 -mfma)
  set(flags_avx512 -mavx512f -mavx2 -mfma)
  set(objects "")
  foreach(isa baseline avx2 avx512)
    add_library(jf2_cpu_${isa} OBJECT ${PROJECT_SOURCE_DIR}/src/cpu/cpu_kernels.cc)
    target_compile_definitions(jf2_cpu_${isa} PRIVATE JF2_CPU_ISA=${isa})
    # fp-contract=fast: the micro-kernels' a * b + c become FMAs.
    target_compile_options(jf2_cpu_${isa} PRIVATE -O3 -ffp-contract=fast ${flags_${isa}})
    list(APPEND objects $<TARGET_OBJECTS:jf2_cpu_${isa}>)
  endforeach()
  set(${out_var} ${objects} PARENT_SCOPE)
endfunction()
