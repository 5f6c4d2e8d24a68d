/* The one dispatch: which variant this CPU runs. Each variant's code carries its own target attribute,
   so the library, built without -march, loads on any CPU of its architecture and runs what it has. */
#include "spec_native.h"

int spec_native_isa(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
            __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
            return SPEC_ISA_VNNI;
        return SPEC_ISA_AVX512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SPEC_ISA_AVX2;
#endif
    return SPEC_ISA_C;
}

int spec_pick_isa(int isa) {
    static int best = -1;
    if (best < 0) best = spec_native_isa();
    return isa < 0 || isa > best ? best : isa;
}
