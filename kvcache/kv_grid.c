/*
 * kv_grid.c - the CPU grid emulator (kv_grid_hd.h): a CUDA kernel body run
 * over every (block, thread) of a launch.
 *
 * Blocks run one after another. In a block without barriers each thread
 * runs to its end in turn. In a block with barriers each thread is a fiber
 * (ucontext, its own stack) that runs until it reaches a synchronizing
 * operation or ends; the scheduler then resolves what all have reached:
 *
 *   a warp whose 32 lanes all wait at a warp sum   the butterfly, released
 *     (or all at a warp max)                       (fmaxf), released
 *   a warp whose 32 lanes all wait at a syncwarp   released
 *   a warp whose 32 lanes all wait at a shuffle    values exchanged, released
 *   some lanes of a warp at a warp operation and   fault (divergent warp op)
 *     the others elsewhere (another op, a block
 *     barrier, ended)
 *   no warp operation pending, every thread at     released
 *     the block barrier, all at the same call
 *   every thread at a block barrier, not all at    fault (different barriers)
 *     the same call (file:line of kv_grid_sync)
 *   some at the block barrier, some ended          fault (a barrier skipped)
 *
 * The same threads always run in the same order (thread 0 first), so a
 * result never depends on the host's scheduling.
 *
 * Shared memory: shared_bytes per block, filled with 0xFF bytes (a NaN as
 * float: a body reading what it never wrote shows) between two guards of
 * GUARD_BYTES checked after the block (a write past the end or before the
 * start is a fault); NULL where shared_bytes is 0, as the wrappers pass it.
 *
 * Atomics (kv_grid_error_record) have no context: kv__grid_fault_here
 * faults the thread that runs (cur, in both modes).
 */
#include <stdio.h>
#include <string.h>
#include <ucontext.h>

#include "kv_grid_hd.h"
#include "kv_lib.h"
#include "kv_mem.h"

/* Under AddressSanitizer each switch is announced (the fiber's stack
 * bounds), so ASan's stack bookkeeping follows the fibers. */
#if defined(__SANITIZE_ADDRESS__)
#define KV__GRID_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KV__GRID_ASAN 1
#endif
#endif
#ifdef KV__GRID_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#define GUARD_BYTES 256
#define GUARD_BYTE 0xA5
#define FIBER_STACK (256 << 10)

enum th_state { TH_RUN, TH_SYNC, TH_WSYNC, TH_WSUM, TH_WMAX, TH_WSHFL, TH_DONE };

struct th {
    ucontext_t uc;
    enum th_state state;
    float val;
    int mask;         /* a shuffle's lane mask */
    const char *site; /* the barrier it waits at (file:line) */
    struct kv_grid_ctx ctx;
    void *fake; /* ASan's fake stack of the fiber while it is switched out */
};

struct emu {
    const char *fn;
    const struct kv_grid_launch *l;
    void (*body)(const struct kv_grid_ctx *, const void *);
    const void *arg;
    bool fibers;
    struct th *th; /* [block] */
    char *stacks;  /* [block][FIBER_STACK] */
    ucontext_t main;
    const void *main_bottom; /* the scheduler's stack (ASan) */
    void *main_fake;
    size_t main_size;
    uint32_t cur;
    int faulted;
    char msg[256];
};

/* makecontext passes ints only: the running emulator, per host thread. */
static _Thread_local struct emu *g_emu;

void kv__grid_fault(const struct kv_grid_ctx *c, const char *what, uint64_t a, uint64_t b)
{
    struct emu *e = c->emu;
    if (e->faulted++)
        return;
    snprintf(e->msg, sizeof(e->msg), "%s (%llu, %llu) in block %u thread %u", what,
             (unsigned long long)a, (unsigned long long)b, c->block, c->thread);
}

/* Leave the fiber of the calling thread in state st. After the switch back,
 * the state is found again through g_emu (no local lives across a
 * swapcontext: it returns twice, and -Wclobbered rightly says so). */
static void wait_in(const struct kv_grid_ctx *c, enum th_state st)
{
    struct emu *e = c->emu;
    if (!e->fibers) {
        kv__grid_fault(c, "a barrier in a kernel launched as barrier-free (state, 0)", (uint64_t)st,
                       0);
        return;
    }
    struct th *t = &e->th[c->thread];
    t->state = st;
#ifdef KV__GRID_ASAN
    __sanitizer_start_switch_fiber(&t->fake, e->main_bottom, e->main_size);
#endif
    swapcontext(&t->uc, &e->main);
#ifdef KV__GRID_ASAN
    e = g_emu;
    __sanitizer_finish_switch_fiber(e->th[e->cur].fake, &e->main_bottom, &e->main_size);
#endif
}

/* Run thread i's fiber until it waits or ends. */
static __attribute__((noinline)) void resume(struct emu *e, uint32_t i)
{
    e->cur = i;
#ifdef KV__GRID_ASAN
    e->main_fake = NULL;
    __sanitizer_start_switch_fiber(&e->main_fake, e->stacks + (size_t)i * FIBER_STACK, FIBER_STACK);
#endif
    swapcontext(&e->main, &e->th[i].uc);
#ifdef KV__GRID_ASAN
    e = g_emu;
    __sanitizer_finish_switch_fiber(e->main_fake, NULL, NULL);
#endif
}

void kv__grid_sync(const struct kv_grid_ctx *c, const char *site)
{
    struct emu *e = c->emu;
    if (e->fibers)
        e->th[c->thread].site = site;
    wait_in(c, TH_SYNC);
}

void kv__grid_fault_here(const char *what, uint64_t a, uint64_t b)
{
    struct emu *e = g_emu;
    if (e && e->th)
        kv__grid_fault(&e->th[e->cur].ctx, what, a, b);
}

void kv__grid_syncwarp(const struct kv_grid_ctx *c)
{
    wait_in(c, TH_WSYNC);
}

float kv__grid_warp_sum(const struct kv_grid_ctx *c, float x)
{
    struct emu *e = c->emu;
    if (!e->fibers) {
        kv__grid_fault(c, "a warp sum in a kernel launched as barrier-free (0, 0)", 0, 0);
        return x;
    }
    e->th[c->thread].val = x;
    wait_in(c, TH_WSUM);
    return e->th[c->thread].val;
}

float kv__grid_warp_max(const struct kv_grid_ctx *c, float x)
{
    struct emu *e = c->emu;
    if (!e->fibers) {
        kv__grid_fault(c, "a warp max in a kernel launched as barrier-free (0, 0)", 0, 0);
        return x;
    }
    e->th[c->thread].val = x;
    wait_in(c, TH_WMAX);
    return e->th[c->thread].val;
}

float kv__grid_shfl_xor(const struct kv_grid_ctx *c, float x, int mask)
{
    struct emu *e = c->emu;
    if (!e->fibers) {
        kv__grid_fault(c, "a shuffle in a kernel launched as barrier-free (0, 0)", 0, 0);
        return x;
    }
    if (mask < 1 || mask >= (int)KV_GRID_WARP) {
        kv__grid_fault(c, "shuffle lane mask outside 1..31 (mask, warp)", (uint64_t)(int64_t)mask,
                       KV_GRID_WARP);
        return x;
    }
    e->th[c->thread].val = x;
    e->th[c->thread].mask = mask;
    wait_in(c, TH_WSHFL);
    return e->th[c->thread].val;
}

static void fiber_main(void)
{
    struct emu *e = g_emu;
    struct th *t = &e->th[e->cur];
#ifdef KV__GRID_ASAN
    __sanitizer_finish_switch_fiber(NULL, &e->main_bottom, &e->main_size);
#endif
    e->body(&t->ctx, e->arg);
    t->state = TH_DONE;
#ifdef KV__GRID_ASAN
    __sanitizer_start_switch_fiber(NULL, e->main_bottom, e->main_size); /* the fiber ends */
#endif
    /* uc_link returns to the scheduler */
}

/* Resolve the warp operations every lane has reached; 1 if any was
 * released, 0 if none pending, -1 on a fault. */
static int resolve_warps(struct emu *e, uint32_t n)
{
    int released = 0;
    for (uint32_t w0 = 0; w0 < n; w0 += KV_GRID_WARP) {
        const uint32_t w1 = w0 + KV_GRID_WARP < n ? w0 + KV_GRID_WARP : n;
        enum th_state op = TH_RUN;
        for (uint32_t i = w0; i < w1; i++)
            if (e->th[i].state == TH_WSUM || e->th[i].state == TH_WSYNC ||
                e->th[i].state == TH_WMAX || e->th[i].state == TH_WSHFL)
                op = e->th[i].state;
        if (op == TH_RUN)
            continue;
        for (uint32_t i = w0; i < w1; i++)
            if (e->th[i].state != op) {
                kv__grid_fault(&e->th[i].ctx,
                               "divergent warp operation: lane not at the warp's op (lane state, "
                               "op)",
                               (uint64_t)e->th[i].state, (uint64_t)op);
                return -1;
            }
        if (w1 - w0 != KV_GRID_WARP) {
            kv__grid_fault(&e->th[w0].ctx, "warp operation in a partial warp (lanes, needed)",
                           w1 - w0, KV_GRID_WARP);
            return -1;
        }
        if (op == TH_WSUM || op == TH_WMAX) {
            float v[KV_GRID_WARP], nv[KV_GRID_WARP];
            for (uint32_t i = 0; i < KV_GRID_WARP; i++)
                v[i] = e->th[w0 + i].val;
            for (uint32_t o = 16; o > 0; o >>= 1) {
                for (uint32_t i = 0; i < KV_GRID_WARP; i++)
                    nv[i] = op == TH_WSUM ? v[i] + v[i ^ o] : fmaxf(v[i], v[i ^ o]);
                memcpy(v, nv, sizeof(v));
            }
            for (uint32_t i = 0; i < KV_GRID_WARP; i++)
                e->th[w0 + i].val = v[i];
        } else if (op == TH_WSHFL) {
            float v[KV_GRID_WARP];
            for (uint32_t i = 0; i < KV_GRID_WARP; i++)
                v[i] = e->th[w0 + i].val;
            for (uint32_t i = 0; i < KV_GRID_WARP; i++)
                e->th[w0 + i].val = v[i ^ (uint32_t)e->th[w0 + i].mask];
        }
        for (uint32_t i = w0; i < w1; i++)
            e->th[i].state = TH_RUN;
        released = 1;
    }
    return released;
}

/* Thread i's fiber, ready to start. getcontext is returns_twice for the
 * compiler (it never returns twice here: makecontext rewrites the context),
 * so the locals after it are volatile, in a function of their own. */
static __attribute__((noinline)) void make_fiber(struct emu *e, uint32_t i)
{
    struct th *volatile t = &e->th[i];
    char *volatile stack = e->stacks + (size_t)i * FIBER_STACK;
    ucontext_t *volatile link = &e->main;
    getcontext(&t->uc);
    t->uc.uc_stack.ss_sp = stack;
    t->uc.uc_stack.ss_size = FIBER_STACK;
    t->uc.uc_link = link;
    makecontext(&t->uc, fiber_main, 0);
    t->state = TH_RUN;
}

static void run_block_fibers(struct emu *e, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        make_fiber(e, i);
    for (;;) {
        for (uint32_t i = 0; i < n && !e->faulted; i++) {
            if (e->th[i].state != TH_RUN)
                continue;
            resume(e, i);
        }
        if (e->faulted)
            return;
        const int w = resolve_warps(e, n);
        if (w < 0)
            return;
        if (w > 0)
            continue;
        uint32_t at_sync = 0, done = 0;
        for (uint32_t i = 0; i < n; i++) {
            at_sync += e->th[i].state == TH_SYNC;
            done += e->th[i].state == TH_DONE;
        }
        if (done == n)
            return;
        if (at_sync == n) {
            for (uint32_t i = 1; i < n; i++)
                if (strcmp(e->th[i].site, e->th[0].site) != 0) {
                    if (!e->faulted++)
                        snprintf(e->msg, sizeof(e->msg),
                                 "__syncthreads: threads at different barriers (%s in thread %u, "
                                 "%s in thread 0) in block %u",
                                 e->th[i].site, i, e->th[0].site, e->th[i].ctx.block);
                    return;
                }
        }
        if (at_sync + done != n || done != 0) {
            for (uint32_t i = 0; i < n; i++)
                if (e->th[i].state != TH_SYNC) {
                    kv__grid_fault(&e->th[i].ctx,
                                   "__syncthreads not reached by every thread (threads at it, "
                                   "threads ended)",
                                   at_sync, done);
                    return;
                }
        }
        for (uint32_t i = 0; i < n; i++)
            e->th[i].state = TH_RUN;
    }
}

kv_status kv__grid_run(const char *fn, const struct kv_grid_launch *l,
                       void (*body)(const struct kv_grid_ctx *c, const void *arg), const void *arg)
{
    if (l->block == 0 || l->block > KV_GRID_MAX_BLOCK)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: emulated launch of %llu threads per block (1 to %u)", fn,
                         (unsigned long long)l->block, KV_GRID_MAX_BLOCK);
    if (l->grid == 0 || l->grid > KV_GRID_MAX_GRID)
        return kv__error(KV_ERR_INVALID_ARG, "%s: emulated launch of %llu blocks (1 to %u)", fn,
                         (unsigned long long)l->grid, KV_GRID_MAX_GRID);
    if (l->shared_bytes > KV_GRID_MAX_SHARED)
        return kv__error(KV_ERR_INVALID_ARG,
                         "%s: emulated launch with %zu bytes of dynamic shared memory (at most "
                         "%zu without opt-in)",
                         fn, l->shared_bytes, KV_GRID_MAX_SHARED);
    const uint32_t n = (uint32_t)l->block;
    struct emu e;
    memset(&e, 0, sizeof(e));
    e.fn = fn;
    e.l = l;
    e.body = body;
    e.arg = arg;
    e.fibers = l->barriers;
    e.th = kv__mem_calloc(n, sizeof(*e.th));
    /* [guard][shared_bytes][guard]; GUARD_BYTES keeps the memory 64-aligned */
    unsigned char *const mem = kv__mem_alloc_aligned(64, l->shared_bytes + 2 * GUARD_BYTES);
    unsigned char *const shared = mem ? mem + GUARD_BYTES : NULL;
    if (e.fibers)
        e.stacks = kv__mem_alloc_aligned(64, (size_t)n * FIBER_STACK);
    kv_status st = KV_OK;
    if (!e.th || !mem || (e.fibers && !e.stacks)) {
        st = kv__error(KV_ERR_NO_MEMORY, "%s: emulator for %u threads", fn, n);
        goto out;
    }
    struct emu *saved = g_emu;
    g_emu = &e;
    for (uint64_t b = 0; b < l->grid && !e.faulted; b++) {
        memset(mem, GUARD_BYTE, GUARD_BYTES);
        memset(shared, 0xFF, l->shared_bytes);
        memset(shared + l->shared_bytes, GUARD_BYTE, GUARD_BYTES);
        /* no shared memory: NULL, as the wrappers pass it (kv__ctx(NULL)) */
        void *const sh = l->shared_bytes ? shared : NULL;
        for (uint32_t i = 0; i < n; i++)
            e.th[i].ctx = (struct kv_grid_ctx){(uint32_t)b, i, n, (uint32_t)l->grid, sh, &e};
        if (e.fibers) {
            run_block_fibers(&e, n);
        } else {
            for (uint32_t i = 0; i < n && !e.faulted; i++) {
                e.cur = i;
                body(&e.th[i].ctx, arg);
            }
        }
        for (size_t i = 0; i < GUARD_BYTES && !e.faulted; i++)
            if (mem[i] != GUARD_BYTE)
                kv__grid_fault(&e.th[0].ctx,
                               "write before the block's dynamic shared memory (bytes before, "
                               "size)",
                               GUARD_BYTES - i, l->shared_bytes);
        for (size_t i = 0; i < GUARD_BYTES && !e.faulted; i++)
            if (shared[l->shared_bytes + i] != GUARD_BYTE)
                kv__grid_fault(&e.th[0].ctx,
                               "write past the block's dynamic shared memory (byte, size)",
                               l->shared_bytes + i, l->shared_bytes);
    }
    g_emu = saved;
    if (e.faulted)
        st = kv__error(KV_ERR_DEVICE, "%s: emulated kernel fault: %s", fn, e.msg);
out:
    kv__mem_free(e.stacks);
    kv__mem_free(mem);
    kv__mem_free(e.th);
    return st;
}
