/*
 * kvdemo.h - the parts of kvdemo, a disaggregated prefill -> decode run on
 * loopback (make demo), and what they share.
 *
 * The map: one file per part, in reading order.
 *
 *   workload.c      the batch of requests and the K/V generator, both derived from the seed
 *   report.c        what a run counts (stage timings, checks, the first failure), the
 *                   report a role process pipes to the parent, the final table
 *   cache.c         one side's cache: a kv_cache with its page table and pool, the bytes
 *                   of a block, the pages of a sequence
 *   prefill.c       prefill's work on a request: K/V through the write kernel; the shared
 *                   prefix offloaded, the pool scrambled, the prefix loaded back
 *   decode.c        decode's work: four layouts in churned pools, a request's blocks, every
 *                   byte read back, decode attention against a plain reference
 *   placement.c     the message decode sends prefill: request, decode's layout (the
 *                   library's kv_layout_config_encode), block ids, the exposure blob
 *   transport.c     what both role processes do on the transport
 * (connector/transport/kv_transport.h) decode_role.c   the decode process: listen, place requests,
 * verify what arrives prefill_role.c  the prefill process: connect, write each placed request into
 * decode layerwise.c     layer by layer against whole-request on one request (kv_xport_layers.h)
 *   mla.c           the MLA group: a DeepSeek-shaped latent cache (K only, D 576, fp8 with a
 *                   scale) moved into decode's latent layout, decoded by kv_attn_decode_mla
 *   local.c         --local: both sides in one process, the transfer by kv_plan_copy
 *   main.c          the command line and the parent: start decode, then prefill, read
 *                   both reports, print the table
 *
 * The run (two processes on 127.0.0.1; both derive the same batch from the seed):
 *
 *   prefill (own layout: N 16, NHD, layer-major)    decode (4 layouts, one per request group)
 *                                                   churn each pool (ids spread up to B - 1)
 *                                          <--place-- alloc blocks; placement: request, tokens,
 *                                                     layout config, block ids, (once) blob
 *   decode's layout from its config (the library's codec: fingerprint checked)
 *   write K/V through kv_attn_write (generator)
 *   (first prefix request) offload store, scramble
 *   the pool, load back, compare bit for bit
 *   kv_xport_write_plan into decode's blocks ===data + done===> read back through the page
 *   wait DONE, free                                 table, every byte against the generator;
 *                                                   decode attention vs a plain reference; free
 *
 * kvdemo sees the library through its public headers only (<kvcache/kv.h>).
 */
#ifndef KVDEMO_H
#define KVDEMO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <kvcache/kv.h>

/* bf16 <-> f32, the demo's own (the generator writes finite values; round
 * to nearest even), so its reference does not share the library's code. */
static inline uint16_t demo_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float demo_bf16_to_f32(uint16_t b)
{
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* Exit statuses: 0 every check passed. */
#define EXIT_FAILED 1 /* a check failed or the library refused a call */
#define EXIT_USAGE 2

/* ---- the model and the batch ----------------------------------------------------------------- */

#define L_LAYERS 4
#define H_KV 8
#define H_Q 16 /* query heads: GQA, 2 per KV head */
#define D_HEAD 128
#define DTYPE KV_BF16
#define ELEM 2
#define TOKEN_BYTES ((uint64_t)L_LAYERS * 2 * H_KV * D_HEAD * ELEM) /* 16 KiB */
#define MAX_TOKENS 2048
#define MAX_REQUESTS 256
#define PF_N 16 /* prefill page size */
#define PF_BLOCKS 384
#define PF_BLOCK_BYTES ((uint64_t)PF_N * TOKEN_BYTES) /* 256 KiB: one prefill block's data */
#define PREFIX_BLOCKS 3
#define PREFIX_TOKENS (PREFIX_BLOCKS * PF_N)
#define N_GROUPS 4 /* decode layouts; request r goes to group r % N_GROUPS */
#define WINDOW 4   /* placements decode keeps in flight */
#define WAIT_MS 30000
#define XPORT_TOKEN UINT64_C(0x6b7664656d6f2121)

/* The MLA group (mla.c): a DeepSeek-shaped latent cache, K only, one KV
 * head, D = 576 = 512 latent + 64 rope dims, fp8 e4m3 with a per-tensor
 * scale; the first MLA_REQS requests of the batch, moved again as latents. */
#define MLA_L 3
#define MLA_D 576
#define MLA_DV 512 /* value dims: the first 512 of each latent row */
#define MLA_HQ 16  /* query heads of the MLA decode */
#define MLA_SCALE 0.25f
#define MLA_REQS 6
#define MLA_MAX_TOKENS 1024 /* an MLA request: its batch request's tokens, at most this */
#define MLA_GROUP N_GROUPS  /* its placements' group */
#define MLA_TOKEN_BYTES ((uint64_t)MLA_L * MLA_D * 1) /* 1728 bytes */

/* Tags of the notifications between the roles. */
enum { TAG_PLACE = 1, TAG_DONE = 2, TAG_FAILED = 3, TAG_END = 4, TAG_LAYERWISE = 5, TAG_MLA = 6 };

struct request {
    uint32_t id;
    uint32_t n_tokens;
    bool prefix; /* its first PREFIX_TOKENS tokens are the shared prefix */
};

/* What the command line asked for (main.c). */
struct opts {
    uint32_t requests;
    uint64_t seed;
    kv_xport_kind kind;
    bool local, fault;
    int port;               /* -1: none given */
    int port_fd, report_fd; /* -1: none given */
    uint32_t timeout_s;     /* the parent's limit on the whole run (--timeout) */
};

/* ---- workload.c: the batch and the generator ------------------------------------------------- */

uint64_t rng_next(uint64_t *s);
void make_requests(uint64_t seed, uint32_t n, struct request *out);
int32_t token_id(const struct request *r, uint32_t t);
float gen_value(uint64_t seed, uint32_t stream, uint32_t layer, uint32_t pos, uint32_t head,
                uint32_t d, uint32_t kv);
void gen_kv(uint64_t seed, const struct request *r, uint32_t t0, uint32_t T, uint16_t *k,
            uint16_t *v);

/* ---- report.c: stages, checks, errors, the report and the table ------------------------------ */

enum stage { ST_WRITE, ST_STORE, ST_LOAD, ST_XFER, ST_VERIFY, ST_ATTN, ST_COUNT };

struct report {
    uint64_t bytes[ST_COUNT];
    uint64_t ns[ST_COUNT];
    uint64_t calls[ST_COUNT];
    uint64_t checks, passed; /* passed <= checks; the run passes when they are equal */
    uint64_t requests, requests_ok, tokens, xfer_bytes;
    double attn_max_err;
    uint32_t id_min, id_max;                      /* decode block ids handed to prefill */
    uint64_t xg_bytes[N_GROUPS], xg_ns[N_GROUPS]; /* the transfer by decode layout */
    /* layerwise.c, one request: from prefill's start until its last layer
     * is acknowledged, with lw_c_ns of compute per layer; whole request
     * (compute every layer, then one write) vs layer by layer */
    uint64_t lw_bytes, lw_c_ns, lw_whole_ns, lw_layers_ns;
    /* mla.c: requests checked and ok (decode), transfers (prefill), MLA decode */
    uint64_t mla_requests, mla_ok, mla_xfers, mla_xfer_bytes, mla_xfer_ns;
    uint64_t mla_attn_bytes, mla_attn_ns, mla_wall_ns; /* wall: the whole group, on decode */
    double mla_attn_err;
    char first_fail[512];
};

extern struct report g_rep; /* this process's counts */
extern bool g_tty;          /* stdout is a terminal: progress on one line */
extern const char *g_role;  /* "kvdemo", "decode" or "prefill": the prefix of every message */

uint64_t now_ns(void);
void stage_add(enum stage s, uint64_t bytes, uint64_t t0);
void xfer_add(uint32_t g, uint32_t n_tokens, uint64_t t0);
/* Count a check; a failing one is named (the first is kept). Returns ok. */
__attribute__((format(printf, 2, 3))) bool check(bool ok, const char *fmt, ...);
/* A library call that must succeed: its status and words, then false. */
bool ok_call(kv_status st, const char *what);
/* A failure that is not a check (named, the first kept): false. */
__attribute__((format(printf, 1, 2))) bool fail_msg(const char *fmt, ...);
void progress(uint32_t done, uint32_t total, uint64_t t_start);
bool report_write(int fd, const struct report *r);
bool report_read(int fd, struct report *r, bool take_requests);
void print_table(const struct report *r, const char *how, double wall_s);

/* ---- cache.c: one side's cache --------------------------------------------------------------- */

struct side {
    kv_cache *c;
    kv_page_table *pt;          /* borrowed from c */
    kv_block_pool *pool;        /* borrowed from c */
    struct kv_paged_cache pc;   /* c's arena as the kernels see it */
    const struct kv_layout *lo; /* borrowed from c */
    char desc[160];             /* "N=16 NHD layer-major": for messages */
};

bool side_make(struct side *s, const struct kv_layout_config *lc, bool prefix);
void side_free(struct side *s);
void block_bytes(const struct side *s, uint32_t b, unsigned char *out, const void *in, int fill);
uint64_t block_data_bytes(const struct side *s);
bool seq_pages(const struct side *s, uint32_t seq, int32_t *indptr, int32_t *indices,
               uint64_t indices_len, int32_t *last, struct kv_pages *pages);
bool views_of_kv(uint16_t *k, uint16_t *v, uint32_t T, struct kv_view *kv_, struct kv_view *vv);

/* ---- prefill.c: prefill's work on a request -------------------------------------------------- */

struct prefill {
    uint64_t seed;
    struct side s;
    kv_offload *off;
    uint64_t prefix_hash[PREFIX_BLOCKS];
    bool prefix_stored;
    uint16_t *k, *v; /* [L][MAX_TOKENS][H][D] */
    int64_t *slots;  /* [MAX_TOKENS] */
    int32_t *tokens; /* [MAX_TOKENS] */
    struct side mla; /* the latent cache (mla_layout) */
    float *mla_k;    /* [MLA_L][MAX_TOKENS][1][MLA_D] */
};

bool prefill_init(struct prefill *p, uint64_t seed);
void prefill_fini(struct prefill *p);
bool prefill_request(struct prefill *p, const struct request *r, uint32_t *seq);
bool prefill_offload_store(struct prefill *p, uint32_t seq, unsigned char *snap);
bool prefill_offload_roundtrip(struct prefill *p, const uint32_t *old_ids,
                               const unsigned char *snap);

/* ---- decode.c: decode's work on a request ---------------------------------------------------- */

struct decode_group {
    struct side s;
    uint32_t *ballast; /* blocks held for the whole run, filled with a pattern */
    uint32_t n_ballast;
};

struct inflight {
    bool live;
    uint32_t req, seq;
};

struct decode {
    uint64_t seed;
    struct decode_group g[N_GROUPS];
    struct inflight fl[MAX_REQUESTS]; /* by request id: its sequence while placed */
    uint16_t *k, *v, *ek, *ev;        /* [L][MAX_TOKENS][H][D] */
    int32_t *indices;                 /* [MAX_TOKENS + 1] */
    bool fault;                       /* --fault: corrupt one request after its transfer */
    uint32_t fault_req;
    struct decode_group mla; /* the latent cache (mla_layout), churned */
    uint32_t mla_seq;        /* the MLA request placed, while mla_live */
    bool mla_live;
    uint8_t *mla_k, *mla_ek; /* [MLA_L][MAX_TOKENS][1][MLA_D] fp8: read, expected */
    int16_t *mla_kn;         /* the same as integers n (the value is n * MLA_SCALE) */
};

/* What decode tells prefill about one request (placement.c carries it). */
struct placement {
    uint32_t req, group;
    uint64_t n_tokens;
    struct kv_layout_config lc; /* the config of decode's layout (kv_layout_config_from) */
    uint32_t n_blocks;
    const uint32_t *blocks;
    uint32_t blob_len;
    const unsigned char *blob;
};

void group_layout(uint32_t g, struct kv_layout_config *lc);
bool decode_init(struct decode *d, uint64_t seed);
void decode_fini(struct decode *d);
bool decode_group_make(struct decode_group *dg, const struct kv_layout_config *lc, uint64_t seed);
void decode_group_check(struct decode_group *dg, uint32_t g);
bool decode_place(struct decode *d, const struct request *r, struct placement *pl);
void decode_release(struct decode *d, uint32_t req);
bool decode_check(struct decode *d, const struct request *r);

/* ---- placement.c: the placement message ------------------------------------------------------ */

void le32_put(unsigned char *p, uint32_t v);
uint32_t le32_get(const unsigned char *p);
bool place_encode(const struct placement *pl, unsigned char *buf, size_t cap, size_t *len);
bool place_decode(const unsigned char *buf, size_t len, struct placement *pl, uint32_t *blocks,
                  char *why, size_t why_cap);
bool place_accept(const struct placement *pl, const struct request *reqs, uint32_t n_req,
                  struct kv_layout *lo);

/* ---- transport.c, the roles, --local --------------------------------------------------------- */

const char *xstate_name(kv_xport_state st);
kv_status poll_msg(kv_xport *x, kv_xport_peer *peer, struct kv_xport_msg *msg);
bool send_msg(kv_xport_peer *peer, uint64_t tag, const void *msg, uint32_t len);
bool xport_new(const struct opts *o, bool listen, kv_xport **x);
bool xport_reg(kv_xport *x, const struct side *s, kv_xport_mem **mem);
bool xport_probe(const struct opts *o);

int run_decode(const struct opts *o, const struct request *reqs);  /* decode_role.c */
int run_prefill(const struct opts *o, const struct request *reqs); /* prefill_role.c */
int run_local(uint64_t seed, bool fault, const struct request *reqs, uint32_t n_req); /* local.c */

/* layerwise.c: the layer-by-layer comparison on one placed request */
bool decode_layerwise(struct decode *d, kv_xport *x, kv_xport_peer *peer, const struct request *r);
bool prefill_layerwise(struct prefill *p, const struct request *r, const struct placement *pl,
                       const struct kv_layout *lo, kv_xport_peer *peer, kv_xport_mem *mem,
                       kv_xport_rmem *rmem);

/* mla.c: the MLA group */
void mla_layout(bool decode, struct kv_layout_config *lc);
uint32_t mla_count(uint32_t n_req);
bool mla_decode_place(struct decode *d, const struct request *r, struct placement *pl);
void mla_decode_release(struct decode *d);
bool mla_decode_check(struct decode *d, const struct request *r);
bool mla_accept(const struct placement *pl, const struct request *reqs, uint32_t n_req,
                struct kv_layout *lo);
bool mla_prefill_write(struct prefill *p, const struct request *r, uint32_t *seq);
bool decode_mla(struct decode *d, kv_xport *x, kv_xport_peer *peer, kv_xport_mem *mem,
                const struct request *reqs, uint32_t n_req);
bool prefill_mla(struct prefill *p, const struct request *reqs, uint32_t n_req, kv_xport_peer *peer,
                 kv_xport_mem *mem, kv_xport_rmem **rmem, kv_plan **plan,
                 const struct kv_xport_msg *msg);
bool local_mla(struct prefill *p, struct decode *d, const struct request *reqs, uint32_t n_req);

#endif /* KVDEMO_H */
