/* The self-test as a program: every variant this CPU runs (or those named: selftest 0 2), at 1 and 3
   threads. For builds a Python process cannot load: under -fsanitize=address,undefined, and cross-built
   for another architecture (run under qemu). */
#include "spec_native.h"

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    char msg[512];
    int failed = 0, best = spec_native_isa();
    for (int isa = 0; isa <= best; isa++) {
        int asked = argc < 2;
        for (int i = 1; i < argc; i++) asked |= atoi(argv[i]) == isa;
        for (int threads = 1; asked && threads <= 3; threads += 2) {
            int rc = spec_selftest(isa, threads, msg, sizeof msg);
            printf("variant %d, %d thread%s: %s\n", isa, threads, threads > 1 ? "s" : "", rc ? msg : "ok");
            failed |= rc;
        }
    }
    return failed;
}
