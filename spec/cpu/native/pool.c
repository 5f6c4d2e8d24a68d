/* A pool of worker threads for the library's products: pool_run(fn, arg, parts, threads) runs
   fn(arg, i, parts) for i < parts, part 0 on the calling thread and the others on workers made at the
   first use. A worker that finishes spins (yielding the core to any other runnable thread) for SPIN_NS,
   so the next product of the same pass finds it awake, then sleeps on a condition variable; a fork
   leaves the child with no workers (made again there when asked). */
#include "spec_native.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define POOL_MAX 64
#define SPIN_NS 300000
static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pool_fn fn;
    void *arg;
    int parts, workers;
    atomic_uint gen;
    atomic_int left, sleepers;
    atomic_long worked;         /* parts run on workers so far (spec_pool_worked) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0, 0};
static int pool_forked_hook = 0;
static unsigned pool_born[POOL_MAX];
static atomic_flag pool_busy = ATOMIC_FLAG_INIT;   /* a caller is running parts on the pool */

static uint64_t pool_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void *pool_worker(void *p) {
    int id = (int)(intptr_t)p;
    unsigned seen = pool_born[id];      /* the generation before the first job it is to take */
    for (;;) {
        uint64_t t0 = pool_ns();
        for (unsigned spin = 1; atomic_load_explicit(&pool.gen, memory_order_acquire) == seen; spin++) {
            if (!(spin & 15) && pool_ns() - t0 > SPIN_NS) {
                pthread_mutex_lock(&pool.mu);
                atomic_fetch_add(&pool.sleepers, 1);
                while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
                atomic_fetch_sub(&pool.sleepers, 1);
                pthread_mutex_unlock(&pool.mu);
                break;
            }
            sched_yield();
        }
        seen = atomic_load(&pool.gen);
        if (id < pool.parts) {
            pool.fn(pool.arg, id, pool.parts);
            atomic_fetch_add(&pool.worked, 1);
        }
        atomic_fetch_sub_explicit(&pool.left, 1, memory_order_release);
    }
    return NULL;
}

static void pool_child(void) {     /* after fork: the workers stayed in the parent */
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    pool.mu = mu;
    pool.cv = cv;
    pool.workers = 0;
    atomic_store(&pool.sleepers, 0);
    atomic_flag_clear(&pool_busy);
}

long spec_pool_worked(void) { return atomic_load(&pool.worked); }

static void pool_run_locked(pool_fn fn, void *arg, int parts) {
    if (!pool_forked_hook) { pthread_atfork(NULL, NULL, pool_child); pool_forked_hook = 1; }
    while (pool.workers < parts - 1) {
        pthread_t t;
        pool_born[pool.workers + 1] = atomic_load(&pool.gen);
        if (pthread_create(&t, NULL, pool_worker, (void *)(intptr_t)(pool.workers + 1)) != 0) break;
        pthread_detach(t);
        pool.workers++;
    }
    if (parts > pool.workers + 1) parts = pool.workers + 1;
    if (parts <= 1) { fn(arg, 0, 1); return; }
    pool.fn = fn;
    pool.arg = arg;
    pool.parts = parts;
    atomic_store(&pool.left, pool.workers);
    atomic_fetch_add(&pool.gen, 1);                 /* seq_cst: then the sleepers count is read */
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    fn(arg, 0, parts);
    while (atomic_load_explicit(&pool.left, memory_order_acquire) > 0) sched_yield();
}

void pool_run(pool_fn fn, void *arg, int parts, int threads) {
    if (threads > POOL_MAX) threads = POOL_MAX;
    if (parts > threads) parts = threads;
    if (parts <= 1 || atomic_flag_test_and_set(&pool_busy)) { fn(arg, 0, 1); return; }
    pool_run_locked(fn, arg, parts);
    atomic_flag_clear(&pool_busy);
}
