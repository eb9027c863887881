/*
 * test_abi.c - the ABI checks at the boundary: every config struct carries
 * its struct_size and every create/init refuses a config compiled against
 * other headers (size 0: never initialized; another size: other headers)
 * before reading any other field (kv_plan_config included: its size before
 * layer ranges is refused); ops tables carry a version; the version
 * and build lines say what was linked.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include <kvcache/kv.h>
#include "kvtest.h"

/* A config whose every field is set as for a valid create, except
 * struct_size: 0, one word short, one word long. */
static const size_t k_delta[] = {0, 1, 2};

static size_t bad_size(size_t good, size_t which)
{
    return which == 0 ? 0 : which == 1 ? good - sizeof(void *) : good + sizeof(void *);
}

static void assert_refused(kv_status st, const char *type, size_t which)
{
    char want[96];
    assert_int_equal(st, KV_ERR_INVALID_ARG);
    kvt_assert_msg_has(type);
    if (which == 0) {
        snprintf(want, sizeof(want), "%s_init()", type);
        kvt_assert_msg_has("struct_size 0");
        kvt_assert_msg_has(want);
    } else {
        kvt_assert_msg_has("other kvcache headers");
    }
}

static void test_abi_layout_config_size(void **state)
{
    (void)state;
    struct kv_layout_config c = KV_LAYOUT_CONFIG_INIT;
    struct kv_layout lo, before;
    c.num_layers = 2, c.num_blocks = 8, c.block_tokens = 4, c.num_heads = 2, c.head_dim = 8;
    c.dtype = KV_BF16;
    assert_int_equal(kv_layout_init(&c, &lo), KV_OK);
    for (size_t i = 0; i < 3; i++) {
        struct kv_layout_config bad = c;
        bad.struct_size = bad_size(sizeof(c), k_delta[i]);
        memset(&lo, 0x5A, sizeof(lo));
        before = lo;
        assert_refused(kv_layout_init(&bad, &lo), "kv_layout_config", i);
        assert_string_equal(kvt_layout_diff(&lo, &before), ""); /* out untouched */
    }
    /* the inline initializer and the macro agree */
    struct kv_layout_config d;
    memset(&d, 0xFF, sizeof(d));
    kv_layout_config_init(&d);
    struct kv_layout_config e = KV_LAYOUT_CONFIG_INIT;
    assert_string_equal(kvt_layout_config_diff(&d, &e), "");
    assert_int_equal(d.struct_size, sizeof(d));
}

static void test_abi_arena_config_size(void **state)
{
    (void)state;
    struct kv_arena_config c;
    kv_arena *a = (kv_arena *)(uintptr_t)0x1;
    kv_arena_config_init(&c, 4096);
    assert_int_equal(c.struct_size, sizeof(c));
    assert_int_equal(c.size_bytes, 4096);
    struct kv_arena_config m = KV_ARENA_CONFIG_INIT(4096);
    assert_string_equal(kvt_arena_config_diff(&c, &m), "");
    for (size_t i = 0; i < 3; i++) {
        struct kv_arena_config bad = c;
        bad.struct_size = bad_size(sizeof(c), k_delta[i]);
        assert_refused(kv_arena_create(&bad, &a), "kv_arena_config", i);
        assert_ptr_equal(a, (kv_arena *)(uintptr_t)0x1); /* *out set only on success */
    }
    assert_int_equal(kv_arena_create(&c, &a), KV_OK);
    kv_arena_destroy(a);
}

static void test_abi_block_pool_config_size(void **state)
{
    (void)state;
    struct kv_block_pool_config c = KV_BLOCK_POOL_CONFIG_INIT;
    kv_block_pool *p = NULL;
    c.num_blocks = 16;
    for (size_t i = 0; i < 3; i++) {
        struct kv_block_pool_config bad = c;
        bad.struct_size = bad_size(sizeof(c), k_delta[i]);
        assert_refused(kv_block_pool_create(&bad, &p), "kv_block_pool_config", i);
        assert_null(p);
    }
    assert_int_equal(kv_block_pool_create(&c, &p), KV_OK);
    kv_block_pool_destroy(p);
}

static void test_abi_page_table_config_and_ops_version(void **state)
{
    (void)state;
    struct kv_block_pool_config pc = KV_BLOCK_POOL_CONFIG_INIT;
    kv_block_pool *pool = NULL;
    kv_page_table *pt = NULL;
    pc.num_blocks = 16;
    assert_int_equal(kv_block_pool_create(&pc, &pool), KV_OK);
    struct kv_page_table_config c;
    kv_page_table_config_init(&c);
    c.block_tokens = 4, c.max_seqs = 2, c.max_blocks_per_seq = 4;
    assert_int_equal(kv_block_pool_ops(pool, &c.ops), KV_OK);
    assert_int_equal(c.ops.version, KV_BLOCK_OPS_VERSION);
    for (size_t i = 0; i < 3; i++) {
        struct kv_page_table_config bad = c;
        bad.struct_size = bad_size(sizeof(c), k_delta[i]);
        assert_refused(kv_page_table_create(&bad, &pt), "kv_page_table_config", i);
        assert_null(pt);
    }
    /* an ops table of another version (or never versioned) is refused */
    struct kv_page_table_config v0 = c;
    v0.ops.version = 0;
    assert_int_equal(kv_page_table_create(&v0, &pt), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("block ops version 0");
    v0.ops.version = KV_BLOCK_OPS_VERSION + 1;
    assert_int_equal(kv_page_table_create(&v0, &pt), KV_ERR_INVALID_ARG);
    kvt_assert_msg_has("version 2");
    assert_null(pt);
    assert_int_equal(kv_page_table_create(&c, &pt), KV_OK);
    kv_page_table_destroy(pt);
    kv_block_pool_destroy(pool);
}

static void test_abi_cache_config_size(void **state)
{
    (void)state;
    struct kv_cache_config c;
    kv_cache *cache = NULL;
    kv_cache_config_init(&c);
    assert_int_equal(c.layout.struct_size, sizeof(c.layout));
    c.layout.num_layers = 1, c.layout.num_blocks = 8, c.layout.block_tokens = 4;
    c.layout.num_heads = 1, c.layout.head_dim = 8, c.layout.dtype = KV_F32;
    c.max_seqs = 2;
    for (size_t i = 0; i < 3; i++) {
        struct kv_cache_config bad = c;
        bad.struct_size = bad_size(sizeof(c), k_delta[i]);
        assert_refused(kv_cache_create(&bad, &cache), "kv_cache_config", i);
        assert_null(cache);
    }
    /* the nested layout config is checked too */
    struct kv_cache_config bad = c;
    bad.layout.struct_size = 0;
    assert_refused(kv_cache_create(&bad, &cache), "kv_layout_config", 0);
    assert_null(cache);
    struct kv_cache_config m = KV_CACHE_CONFIG_INIT;
    assert_int_equal(m.struct_size, sizeof(m));
    assert_int_equal(m.layout.struct_size, sizeof(m.layout));
    assert_int_equal(kv_cache_create(&c, &cache), KV_OK);
    kv_cache_destroy(cache);
}

static void test_abi_plan_config_size(void **state)
{
    (void)state;
    struct kv_layout_config lc = KV_LAYOUT_CONFIG_INIT;
    struct kv_layout lo;
    lc.num_layers = 4, lc.num_blocks = 8, lc.block_tokens = 4, lc.num_heads = 2, lc.head_dim = 8;
    lc.dtype = KV_BF16;
    assert_int_equal(kv_layout_init(&lc, &lo), KV_OK);
    struct kv_plan_config c;
    memset(&c, 0xFF, sizeof(c));
    kv_plan_config_init(&c);
    struct kv_plan_config m = KV_PLAN_CONFIG_INIT;
    assert_int_equal(c.struct_size, sizeof(c));
    assert_int_equal(m.struct_size, sizeof(m));
    assert_true(c.n_heads == 0 && c.n_layers == 0 && c.src_layer0 == 0 && c.dst_layer0 == 0);
    c.src_layer0 = 1, c.dst_layer0 = 2, c.n_layers = 2;
    kv_plan *p = NULL;
    for (size_t i = 0; i < 3; i++) {
        struct kv_plan_config bad = c;
        bad.struct_size = bad_size(sizeof(c), k_delta[i]);
        assert_refused(kv_plan_create(&lo, &lo, &bad, &p), "kv_plan_config", i);
        assert_null(p);
    }
    /* the struct as it was before layer ranges (heads only) */
    struct kv_plan_config old = c;
    old.struct_size = offsetof(struct kv_plan_config, src_layer0);
    assert_refused(kv_plan_create(&lo, &lo, &old, &p), "kv_plan_config", 1);
    assert_int_equal(kv_plan_create(&lo, &lo, &c, &p), KV_OK);
    kv_plan_destroy(p);
    size_t off = 0, size = 0;
    assert_int_equal(kv_abi_field("kv_plan_config", "n_layers", &off, &size), KV_OK);
    assert_int_equal(off, offsetof(struct kv_plan_config, n_layers));
    assert_int_equal(size, sizeof(int64_t));
}

/* kv_copy_blocks_opts (attention/kv_attn.h): initialized by both forms,
 * refused with any other struct_size before a layer or block is read, and
 * in the table bindings check. */
static void test_abi_copy_blocks_opts_size(void **state)
{
    (void)state;
    struct kv_layout_config lc = KV_LAYOUT_CONFIG_INIT;
    struct kv_paged_cache pc = {.mem = KV_MEM_HOST};
    lc.num_layers = 2, lc.num_blocks = 8, lc.block_tokens = 4, lc.num_heads = 1, lc.head_dim = 8;
    lc.dtype = KV_F32;
    assert_int_equal(kv_layout_init(&lc, &pc.layout), KV_OK);
    static float mem[2 * 2 * 8 * 4 * 8];
    pc.base = mem;
    pc.storage_bytes = sizeof(mem);
    struct kv_copy_blocks_opts c;
    memset(&c, 0xFF, sizeof(c));
    kv_copy_blocks_opts_init(&c);
    struct kv_copy_blocks_opts m = KV_COPY_BLOCKS_OPTS_INIT;
    assert_int_equal(c.struct_size, sizeof(c));
    assert_int_equal(m.struct_size, sizeof(m));
    assert_true(c.layer0 == 0 && c.n_layers == 0 && c.planes == 0);
    struct kv_block_copy cp[1] = {{1, 2, 0}};
    for (size_t i = 0; i < 3; i++) {
        struct kv_copy_blocks_opts bad = c;
        bad.struct_size = bad_size(sizeof(c), k_delta[i]);
        assert_refused(kv_attn_copy_blocks_ex(pc, pc, cp, 1, &bad), "kv_copy_blocks_opts", i);
    }
    assert_int_equal(kv_attn_copy_blocks_ex(pc, pc, cp, 1, &c), KV_OK);
    size_t off = 0, size = 0, align = 0;
    assert_int_equal(kv_abi_struct("kv_copy_blocks_opts", &size, &align), KV_OK);
    assert_int_equal(size, sizeof(struct kv_copy_blocks_opts));
    assert_int_equal(kv_abi_field("kv_copy_blocks_opts", "planes", &off, &size), KV_OK);
    assert_int_equal(off, offsetof(struct kv_copy_blocks_opts, planes));
    assert_int_equal(size, sizeof(uint32_t));
}

/* kv_attn_opts (attention/kv_attn.h): both initializers give every option
 * off (window_left KV_ATTN_WINDOW_OFF), another struct_size is refused
 * before anything is read, and the table bindings check holds its fields. */
static void test_abi_attn_opts_size(void **state)
{
    (void)state;
    struct kv_layout_config lc = KV_LAYOUT_CONFIG_INIT;
    struct kv_paged_cache pc = {.mem = KV_MEM_HOST};
    lc.num_layers = 1, lc.num_blocks = 8, lc.block_tokens = 4, lc.num_heads = 1, lc.head_dim = 8;
    lc.dtype = KV_F32;
    assert_int_equal(kv_layout_init(&lc, &pc.layout), KV_OK);
    static float mem[2 * 8 * 4 * 8];
    pc.base = mem;
    pc.storage_bytes = sizeof(mem);
    struct kv_attn_opts c;
    memset(&c, 0xFF, sizeof(c));
    kv_attn_opts_init(&c);
    struct kv_attn_opts m = KV_ATTN_OPTS_INIT;
    assert_int_equal(c.struct_size, sizeof(c));
    assert_int_equal(m.struct_size, sizeof(m));
    assert_true(c.window_left == KV_ATTN_WINDOW_OFF && m.window_left == KV_ATTN_WINDOW_OFF);
    assert_true(c.logit_soft_cap == 0.0f && c.lse == NULL && c.lse_stride == 0);
    assert_true(m.logit_soft_cap == 0.0f && m.lse == NULL && m.lse_stride == 0);
    float qb[8], ob[8];
    int64_t sh[3] = {1, 1, 8};
    struct kv_view q, o;
    assert_int_equal(kv_view_init(qb, sizeof(qb), KV_F32, 3, sh, &q), KV_OK);
    assert_int_equal(kv_view_init(ob, sizeof(ob), KV_F32, 3, sh, &o), KV_OK);
    int32_t indptr[2] = {0, 0}, last[1] = {0};
    struct kv_pages pg = {.format = KV_PAGES_CSR,
                          .n_seqs = 1,
                          .indptr = indptr,
                          .indices = indptr,
                          .last_page_len = last};
    for (size_t i = 0; i < 3; i++) {
        struct kv_attn_opts bad = c;
        bad.struct_size = bad_size(sizeof(c), k_delta[i]);
        assert_refused(kv_attn_decode_ex(pc, 0, &q, &pg, 1.0f, NULL, &o, &bad), "kv_attn_opts", i);
    }
    assert_int_equal(kv_attn_decode_ex(pc, 0, &q, &pg, 1.0f, NULL, &o, &c), KV_OK);
    size_t off = 0, size = 0, align = 0;
    assert_int_equal(kv_abi_struct("kv_attn_opts", &size, &align), KV_OK);
    assert_int_equal(size, sizeof(struct kv_attn_opts));
    assert_int_equal(kv_abi_field("kv_attn_opts", "lse_stride", &off, &size), KV_OK);
    assert_int_equal(off, offsetof(struct kv_attn_opts, lse_stride));
    assert_int_equal(size, sizeof(int64_t));
}

static void test_abi_version_and_build_info(void **state)
{
    (void)state;
    char want[64];
    assert_string_equal(kv_version(), KV_VERSION_STRING);
    snprintf(want, sizeof(want), "%d.%d.%d", KV_VERSION_MAJOR, KV_VERSION_MINOR, KV_VERSION_PATCH);
    assert_string_equal(kv_version(), want);
    snprintf(want, sizeof(want), "kvcache %s host-memory=", KV_VERSION_STRING);
    assert_int_equal(strncmp(kv_build_info(), want, strlen(want)), 0);
    assert_non_null(strstr(kv_build_info(), KV_HAVE_CUDA ? "cuda=yes" : "cuda=no"));
    assert_non_null(strstr(kv_build_info(), KV_HAVE_RDMA ? "rdma=yes" : "rdma=no"));
}

/* kv_abi.h: the table bindings check their declarations against. */
static void test_abi_struct_table(void **state)
{
    (void)state;
    size_t size = 0, align = 0, off = 0;
    assert_int_equal(kv_abi_struct("kv_layout", &size, &align), KV_OK);
    assert_int_equal(size, sizeof(struct kv_layout));
    assert_int_equal(align, _Alignof(struct kv_layout));
    assert_int_equal(kv_abi_struct("kv_cache_config", &size, &align), KV_OK);
    assert_int_equal(size, sizeof(struct kv_cache_config));
    assert_int_equal(kv_abi_field("kv_layout", "fingerprint", &off, &size), KV_OK);
    assert_int_equal(off, offsetof(struct kv_layout, fingerprint));
    assert_int_equal(size, sizeof(uint64_t));
    assert_int_equal(kv_abi_field("kv_view", "shape", &off, &size), KV_OK);
    assert_int_equal(off, offsetof(struct kv_view, shape));
    assert_int_equal(size, sizeof(int64_t) * KV_MAX_DIMS);
    assert_int_equal(kv_abi_field("kv_cache_config", "layout", &off, &size), KV_OK);
    assert_int_equal(size, sizeof(struct kv_layout_config));
    assert_int_equal(kv_abi_struct("kv_nothing", &size, &align), KV_ERR_NOT_FOUND);
    kvt_assert_msg_has("kv_nothing");
    assert_int_equal(kv_abi_field("kv_layout", "nothing", &off, &size), KV_ERR_NOT_FOUND);
    kvt_assert_msg_has("\"nothing\" of struct \"kv_layout\"");
    assert_int_equal(kv_abi_struct(NULL, &size, &align), KV_ERR_NULL);
    assert_int_equal(kv_abi_field("kv_layout", "fingerprint", NULL, &size), KV_ERR_NULL);
}

/* The tests compare structs through tests/common's kvt_*_diff (never
 * memcmp): they must ignore padding bytes and name any field that differs. */
static void test_abi_struct_diffs_see_fields_not_padding(void **state)
{
    (void)state;
    struct kv_layout_config a = KV_LAYOUT_CONFIG_INIT, b;
    a.num_layers = 2, a.num_blocks = 8, a.block_tokens = 4, a.num_heads = 2, a.head_dim = 8;
    a.dtype = KV_BF16;
    struct kv_layout la, lb;
    assert_int_equal(kv_layout_init(&a, &la), KV_OK);
    /* a padding byte of each: the three after the bool kv_packed */
    const size_t cpad = offsetof(struct kv_layout_config, kv_packed) + 1;
    const size_t lpad = offsetof(struct kv_layout, kv_packed) + 1;
    assert_true(cpad < offsetof(struct kv_layout_config, block_pad_elems));
    assert_true(lpad < offsetof(struct kv_layout, elem_bytes));
    memcpy(&b, &a, sizeof(b));
    memcpy(&lb, &la, sizeof(lb));
    ((unsigned char *)&b)[cpad] ^= 0xFF;
    ((unsigned char *)&lb)[lpad] ^= 0xFF;
    assert_string_equal(kvt_layout_config_diff(&a, &b), "");
    assert_string_equal(kvt_layout_diff(&la, &lb), "");
    b.head_dim = 9;
    lb.fingerprint = la.fingerprint + 1;
    assert_non_null(strstr(kvt_layout_config_diff(&a, &b), "kv_layout_config.head_dim: 8 vs 9"));
    assert_non_null(strstr(kvt_layout_diff(&la, &lb), "kv_layout.fingerprint: "));
    /* the last field of each table is compared too */
    memcpy(&b, &a, sizeof(b));
    b.align_bytes = 64;
    assert_non_null(strstr(kvt_layout_config_diff(&a, &b), "align_bytes: 0 vs 64"));
    memcpy(&b, &a, sizeof(b));
    b.k_only = true;
    assert_non_null(strstr(kvt_layout_config_diff(&a, &b), "k_only: 0 vs 1"));
    memcpy(&lb, &la, sizeof(lb));
    lb.k_only = true;
    assert_non_null(strstr(kvt_layout_diff(&la, &lb), "kv_layout.k_only: 0 vs 1"));
    struct kv_view v, w;
    int64_t shape[2] = {2, 3};
    static float buf[6];
    assert_int_equal(kv_view_init(buf, sizeof(buf), KV_F32, 2, shape, &v), KV_OK);
    w = v;
    assert_string_equal(kvt_view_diff(&v, &w), "");
    w.strides[7] = 5; /* past ndim: still a field */
    assert_non_null(strstr(kvt_view_diff(&v, &w), "kv_view.strides[7]: 0 vs 5"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_abi_struct_table),
        cmocka_unit_test(test_abi_layout_config_size),
        cmocka_unit_test(test_abi_arena_config_size),
        cmocka_unit_test(test_abi_block_pool_config_size),
        cmocka_unit_test(test_abi_page_table_config_and_ops_version),
        cmocka_unit_test(test_abi_cache_config_size),
        cmocka_unit_test(test_abi_plan_config_size),
        cmocka_unit_test(test_abi_copy_blocks_opts_size),
        cmocka_unit_test(test_abi_attn_opts_size),
        cmocka_unit_test(test_abi_version_and_build_info),
        cmocka_unit_test(test_abi_struct_diffs_see_fields_not_padding),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
