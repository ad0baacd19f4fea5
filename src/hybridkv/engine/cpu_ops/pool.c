/* A small pool of worker threads for the kernels that split their work (qmatmul.c).
 *
 * pool_run(fn, ctx, P) calls fn(ctx, p, P) for p = 0 .. P-1 (part p on thread p % (workers + 1),
 * the calling thread being 0) and returns when all are done. Workers are started on first use
 * (pool_set_threads: how many threads a job may use, the caller included); after a job they
 * spin for a while (a decode step calls one matmul right after another),
 * then sleep on a condition variable until the next. One job runs at a time: a second caller
 * waits for the first. A forked child starts with no workers (pthread_atfork).
 *
 * The handshake: the caller publishes the job, sets `pending` to the number of workers, then
 * bumps `gen` (sequentially consistent); a worker that sees a new `gen` runs its part and
 * decrements `pending`. A worker about to sleep counts itself in `sleepers` under `mu` and
 * re-reads `gen` before waiting; the caller reads `sleepers` after bumping `gen` and, when
 * anyone sleeps, broadcasts under `mu`: no wake-up is lost. */
#include "cpu_ops.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define MAX_WORKERS 63
#define SPIN 20000 /* polls before a worker sleeps */
#define YIELD_EVERY 8

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define relax() _mm_pause()
#else
#define relax() ((void)0)
#endif

static struct {
    pthread_mutex_t use; /* one job at a time */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_long gen;
    atomic_int pending, sleepers;
    part_fn fn;
    void *ctx;
    long parts;
    int workers;
    atomic_int threads;
    int atfork;
    long born; /* gen when the latest workers were started */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, NULL, NULL, 0, 0, 1, 0, 0};

static void *worker(void *arg) {
    long me = (long)arg;
    long seen = pool.born; /* the gen before this worker's first job (it may already be bumped) */
    for (;;) {
        long g;
        int spins = 0;
        while ((g = atomic_load(&pool.gen)) == seen) {
            if (++spins < SPIN) { /* a yield now and then: a runnable thread of torch's may want this core */
                if (spins % YIELD_EVERY == 0) sched_yield();
                else relax();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((g = atomic_load(&pool.gen)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
            break;
        }
        seen = g;
        for (long q = me; q < pool.parts; q += pool.workers + 1) pool.fn(pool.ctx, q, pool.parts);
        atomic_fetch_sub(&pool.pending, 1);
    }
    return NULL;
}

static void after_fork_child(void) {
    pthread_mutex_init(&pool.use, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    atomic_store(&pool.pending, 0);
    atomic_store(&pool.sleepers, 0);
    pool.workers = 0; /* the parent's workers do not exist here */
}

void pool_set_threads(int threads) {
    pthread_mutex_lock(&pool.use);
    atomic_store(&pool.threads, threads < 1 ? 1 : threads > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : threads);
    pthread_mutex_unlock(&pool.use);
}

long pool_threads(void) { return atomic_load(&pool.threads); }

/* start workers up to `want` (called holding `use`); fewer if the system refuses threads */
static void start_workers(int want) {
    if (!pool.atfork) {
        pthread_atfork(NULL, NULL, after_fork_child);
        pool.atfork = 1;
    }
    pool.born = atomic_load(&pool.gen);
    while (pool.workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, (void *)(long)(pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.workers++;
    }
}

void pool_run(part_fn fn, void *ctx, long parts) {
    if (parts <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.use);
    start_workers(atomic_load(&pool.threads) - 1);
    if (pool.workers == 0) { /* no thread could be started: every part here */
        pthread_mutex_unlock(&pool.use);
        for (long q = 0; q < parts; q++) fn(ctx, q, parts);
        return;
    }
    pool.fn = fn, pool.ctx = ctx, pool.parts = parts;
    atomic_store(&pool.pending, pool.workers); /* every worker checks in; those past `parts` idle */
    atomic_fetch_add(&pool.gen, 1);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    for (long q = 0; q < parts; q += pool.workers + 1) fn(ctx, q, parts);
    for (long spins = 1; atomic_load(&pool.pending) > 0; spins++) { /* a worker without a core: let it have ours */
        if (spins % YIELD_EVERY == 0) sched_yield();
        else relax();
    }
    pthread_mutex_unlock(&pool.use);
}
