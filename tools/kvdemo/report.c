/*
 * report.c - what a run counts, and how the counts reach the table.
 *
 * Every part counts into this process's g_rep: bytes and time per stage
 * (stage_add), checks (check: a failing one is printed and the first kept
 * with the role's name), library calls that must succeed (ok_call) and
 * other failures (fail_msg). A role process writes g_rep as lines of text
 * on the pipe its parent gave it (--report-fd, report_write); the parent
 * merges both reports (report_read) and prints the table (print_table).
 * --local, and a role started by hand, print their own table.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "kvdemo.h"

struct report g_rep;
bool g_tty;
const char *g_role = "kvdemo";

static const char *const stage_name[ST_COUNT] = {
    "write kernel (prefill)", "offload store", "offload load",
    "transfer (plan)",        "decode verify", "decode attention",
};

/* ---- counting -------------------------------------------------------------------------------- */

/* A monotonic clock, in ns. */
uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Stage s moved bytes in the time since t0. */
void stage_add(enum stage s, uint64_t bytes, uint64_t t0)
{
    g_rep.bytes[s] += bytes;
    g_rep.ns[s] += now_ns() - t0;
    g_rep.calls[s]++;
}

/* A transfer of n_tokens into decode group g since t0: by layout and as a stage. */
void xfer_add(uint32_t g, uint32_t n_tokens, uint64_t t0)
{
    g_rep.xg_bytes[g] += (uint64_t)n_tokens * TOKEN_BYTES;
    g_rep.xg_ns[g] += now_ns() - t0;
    stage_add(ST_XFER, (uint64_t)n_tokens * TOKEN_BYTES, t0);
}

/* Count a check; a failing one is named (the first is kept). */
bool check(bool ok, const char *fmt, ...)
{
    g_rep.checks++;
    if (ok) {
        g_rep.passed++;
        return true;
    }
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s%s: CHECK FAILED: %s\n", g_tty ? "\n" : "", g_role, msg);
    if (!g_rep.first_fail[0])
        snprintf(g_rep.first_fail, sizeof(g_rep.first_fail), "%s: %s", g_role, msg);
    return false;
}

/* A library call that must succeed: its status and words, then false. */
bool ok_call(kv_status st, const char *what)
{
    if (st == KV_OK)
        return true;
    fprintf(stderr, "%s: %s: %s: %s\n", g_role, what, kv_status_name(st), kv_last_error());
    if (!g_rep.first_fail[0])
        snprintf(g_rep.first_fail, sizeof(g_rep.first_fail), "%s: %s refused: %s: %s", g_role, what,
                 kv_status_name(st), kv_last_error());
    return false;
}

/* A failure that is not a check (a peer gone, memory): named, the first kept. */
bool fail_msg(const char *fmt, ...)
{
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s\n", g_role, msg);
    if (!g_rep.first_fail[0])
        snprintf(g_rep.first_fail, sizeof(g_rep.first_fail), "%s: %s", g_role, msg);
    return false;
}

/* Decode's progress: one line, rewritten, on a terminal; every fourth request otherwise. */
void progress(uint32_t done, uint32_t total, uint64_t t_start)
{
    const double s = (double)(now_ns() - t_start) / 1e9;
    if (g_tty) {
        printf("\r  decode: %u/%u requests verified  %.1f s", done, total, s);
        if (done == total)
            printf("\n");
        fflush(stdout);
    } else if (done % 4 == 0 || done == total) {
        printf("  decode: %u/%u requests verified (%.1f s)\n", done, total, s);
        fflush(stdout);
    }
}

/* ---- the report pipe: one "key values..." line per count ------------------------------------- */

/* r as text lines on fd (a pipe to the parent; closed here); false, with
 * errno, when they were not all written (the reader then has no verdict). */
bool report_write(int fd, const struct report *r)
{
    FILE *f = fdopen(fd, "w");
    if (!f)
        return false;
    for (int s = 0; s < ST_COUNT; s++)
        fprintf(f, "stage %d %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", s, r->bytes[s], r->ns[s],
                r->calls[s]);
    fprintf(f, "checks %" PRIu64 " %" PRIu64 "\n", r->checks, r->passed);
    fprintf(f, "requests %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", r->requests,
            r->requests_ok, r->tokens, r->xfer_bytes);
    fprintf(f, "attn %.9g\n", r->attn_max_err);
    fprintf(f, "ids %u %u\n", r->id_min, r->id_max);
    for (int g = 0; g < N_GROUPS; g++)
        fprintf(f, "xgroup %d %" PRIu64 " %" PRIu64 "\n", g, r->xg_bytes[g], r->xg_ns[g]);
    fprintf(f,
            "mla %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64
            " %" PRIu64 " %.9g\n",
            r->mla_requests, r->mla_ok, r->mla_xfers, r->mla_xfer_bytes, r->mla_xfer_ns,
            r->mla_attn_bytes, r->mla_attn_ns, r->mla_wall_ns, r->mla_attn_err);
    fprintf(f, "layerwise %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", r->lw_bytes,
            r->lw_c_ns, r->lw_whole_ns, r->lw_layers_ns);
    if (r->first_fail[0])
        fprintf(f, "fail %s\n", r->first_fail);
    const bool ok = fflush(f) == 0 && !ferror(f);
    const int err = errno;
    if (fclose(f) != 0 || !ok) {
        if (!ok)
            errno = err;
        return false;
    }
    return true;
}

/* Merge a child's report into *r; false when it was cut short. */
bool report_read(int fd, struct report *r, bool take_requests)
{
    FILE *f = fdopen(fd, "r");
    if (!f)
        return false;
    char line[600];
    bool seen = false;
    while (fgets(line, sizeof(line), f)) {
        int s;
        uint64_t a, b, c, e;
        double x;
        if (sscanf(line, "stage %d %" SCNu64 " %" SCNu64 " %" SCNu64, &s, &a, &b, &c) == 4 &&
            s >= 0 && s < ST_COUNT) {
            r->bytes[s] += a;
            r->ns[s] += b;
            r->calls[s] += c;
        } else if (sscanf(line, "checks %" SCNu64 " %" SCNu64, &a, &b) == 2) {
            r->checks += a;
            r->passed += b;
            seen = true;
        } else if (sscanf(line, "requests %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &a, &b, &c,
                          &e) == 4) {
            if (take_requests) { /* decode's: a request is ok once it is verified there */
                r->requests = a;
                r->requests_ok = b;
                r->tokens = c;
                r->xfer_bytes = e;
            }
        } else if (!strncmp(line, "mla ", 4)) {
            uint64_t m[8];
            if (sscanf(line,
                       "mla %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64
                       " %" SCNu64 " %" SCNu64 " %lf",
                       &m[0], &m[1], &m[2], &m[3], &m[4], &m[5], &m[6], &m[7], &x) == 9) {
                /* each side counts its own: decode the requests and MLA decode, prefill
                 * the transfers */
                r->mla_requests += m[0];
                r->mla_ok += m[1];
                r->mla_xfers += m[2];
                r->mla_xfer_bytes += m[3];
                r->mla_xfer_ns += m[4];
                r->mla_attn_bytes += m[5];
                r->mla_attn_ns += m[6];
                r->mla_wall_ns += m[7];
                if (x > r->mla_attn_err)
                    r->mla_attn_err = x;
            }
        } else if (sscanf(line, "layerwise %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &a, &b,
                          &c, &e) == 4) {
            if (a) { /* prefill's: the only one that measures it */
                r->lw_bytes = a;
                r->lw_c_ns = b;
                r->lw_whole_ns = c;
                r->lw_layers_ns = e;
            }
        } else if (sscanf(line, "xgroup %d %" SCNu64 " %" SCNu64, &s, &a, &b) == 3 && s >= 0 &&
                   s < N_GROUPS) {
            r->xg_bytes[s] += a;
            r->xg_ns[s] += b;
        } else if (sscanf(line, "ids %" SCNu64 " %" SCNu64, &a, &b) == 2) {
            if (a && (!r->id_min || a < r->id_min))
                r->id_min = (uint32_t)a;
            if (b > r->id_max)
                r->id_max = (uint32_t)b;
        } else if (sscanf(line, "attn %lf", &x) == 1) {
            if (x > r->attn_max_err)
                r->attn_max_err = x;
        } else if (!strncmp(line, "fail ", 5) && !r->first_fail[0]) {
            line[strcspn(line, "\n")] = 0;
            const size_t n = strlen(line + 5);
            const size_t m = n < sizeof(r->first_fail) - 1 ? n : sizeof(r->first_fail) - 1;
            memcpy(r->first_fail, line + 5, m);
            r->first_fail[m] = 0;
        }
    }
    fclose(f);
    return seen;
}

/* ---- the table ------------------------------------------------------------------------------- */

/* The final table of r: how the run went (how: processes or --local), its wall time. */
void print_table(const struct report *r, const char *how, double wall_s)
{
    printf("\nkvdemo: %s; model L=%d H=%d (query %d) D=%d %s; prefill N=%d NHD layer-major; "
           "decode groups: ",
           how, L_LAYERS, H_KV, H_Q, D_HEAD, kv_dtype_name(DTYPE), PF_N);
    for (uint32_t g = 0; g < N_GROUPS; g++) {
        struct kv_layout_config lc;
        group_layout(g, &lc);
        printf("%sN=%" PRId64 " %s %s%s", g ? ", " : "", lc.block_tokens, kv_order_name(lc.order),
               kv_arrange_name(lc.arrange),
               lc.block_pad_elems || lc.block_stride_bytes ? " padded" : "");
    }
    printf("\n\n");
    printf("  requests        %" PRIu64 " (%" PRIu64 " ok)\n", r->requests, r->requests_ok);
    printf("  tokens          %" PRIu64 "\n", r->tokens);
    printf("  bytes moved     %.1f MiB (prefill -> decode)\n", (double)r->xfer_bytes / 1048576.0);
    printf("  decode block ids %u .. %u (pools of %" PRId64 "..%" PRId64 " blocks, churned)\n",
           r->id_min, r->id_max, (int64_t)3 * MAX_TOKENS / 64 + 1, (int64_t)3 * MAX_TOKENS / 8 + 1);
    printf("  wall time       %.2f s\n\n", wall_s);
    printf("  %-24s %10s %8s %10s %9s\n", "stage", "MiB", "calls", "ms", "GB/s");
    for (int s = 0; s < ST_COUNT; s++) {
        const double ms = (double)r->ns[s] / 1e6;
        printf("  %-24s %10.1f %8" PRIu64 " %10.1f %9.2f\n", stage_name[s],
               (double)r->bytes[s] / 1048576.0, r->calls[s], ms,
               r->ns[s] ? (double)r->bytes[s] / (double)r->ns[s] : 0.0);
        for (uint32_t g = 0; s == ST_XFER && g < N_GROUPS; g++) {
            struct kv_layout_config lc;
            group_layout(g, &lc);
            char name[64];
            snprintf(name, sizeof(name), "  to N=%" PRId64 " %s %s%s", lc.block_tokens,
                     kv_order_name(lc.order), lc.arrange ? "blk" : "lyr",
                     lc.block_pad_elems || lc.block_stride_bytes ? " pad" : "");
            printf("  %-24s %10.1f %8s %10.1f %9.2f\n", name, (double)r->xg_bytes[g] / 1048576.0,
                   "", (double)r->xg_ns[g] / 1e6,
                   r->xg_ns[g] ? (double)r->xg_bytes[g] / (double)r->xg_ns[g] : 0.0);
        }
    }
    if (r->lw_bytes) {
        const double w = (double)r->lw_whole_ns / 1e6, l = (double)r->lw_layers_ns / 1e6;
        printf("\n  layer-wise transfer, one request of %.1f MiB, %d layers, compute %.2f ms per "
               "layer (same run):\n",
               (double)r->lw_bytes / 1048576.0, L_LAYERS, (double)r->lw_c_ns / 1e6);
        printf("  %-24s %10.1f %8d %10.1f   compute all layers, then one write\n",
               "  whole request", (double)r->lw_bytes / 1048576.0, 1, w);
        printf("  %-24s %10.1f %8d %10.1f   post each layer once computed: %.1f ms saved "
               "(%.2fx)\n",
               "  layer by layer", (double)r->lw_bytes / 1048576.0, L_LAYERS, l, w - l,
               w > 0 ? l / w : 0.0);
    }
    if (r->mla_requests || r->mla_xfers) {
        struct kv_layout_config pc, dc;
        mla_layout(false, &pc);
        mla_layout(true, &dc);
        printf("\n  MLA group, %.0f ms in all: DeepSeek-shaped latent cache, K only, L=%d H=1 D=%d "
               "%s,\n  per-tensor scale %g; prefill N=%" PRId64 " %s %s -> decode N=%" PRId64
               " %s %s padded;\n  decode attention kv_attn_decode_mla Hq=%d dv=%d:\n",
               (double)r->mla_wall_ns / 1e6, MLA_L, MLA_D, kv_dtype_name(pc.dtype),
               (double)MLA_SCALE, pc.block_tokens, kv_order_name(pc.order),
               kv_arrange_name(pc.arrange), dc.block_tokens, kv_order_name(dc.order),
               kv_arrange_name(dc.arrange), MLA_HQ, MLA_DV);
        printf("  %-24s %10.1f %8" PRIu64 " %10.1f %9.2f   %" PRIu64 " requests (%" PRIu64 " ok)\n",
               "  transfer (plan)", (double)r->mla_xfer_bytes / 1048576.0, r->mla_xfers,
               (double)r->mla_xfer_ns / 1e6,
               r->mla_xfer_ns ? (double)r->mla_xfer_bytes / (double)r->mla_xfer_ns : 0.0,
               r->mla_requests, r->mla_ok);
        printf("  %-24s %10.1f %8" PRIu64 " %10.1f %9.2f   max |err| vs reference %.3g\n",
               "  decode attention", (double)r->mla_attn_bytes / 1048576.0, r->mla_requests * MLA_L,
               (double)r->mla_attn_ns / 1e6,
               r->mla_attn_ns ? (double)r->mla_attn_bytes / (double)r->mla_attn_ns : 0.0,
               r->mla_attn_err);
    }
    printf("\n  attention max |err| vs reference  %.3g (tolerance 1e-3 x (1 + |ref|))\n",
           r->attn_max_err);
    printf("  checks passed   %" PRIu64 " / %" PRIu64 "\n", r->passed, r->checks);
    if (r->first_fail[0])
        printf("  FAILED: %s\n", r->first_fail);
}
