/* kvtest.c - helpers shared by the cmocka suites. */
#include <stdio.h>
#include <stdlib.h>

#include "kvtest.h"

const char *kvt_data_path(const char *name)
{
    static char buf[4096];
    const char *dir = getenv("KV_TEST_DATA_DIR");
    snprintf(buf, sizeof(buf), "%s/%s", dir && *dir ? dir : KV_TEST_DATA_DIR, name);
    return buf;
}

int64_t kvt_ref_offset_elems(const struct kv_layout_config *c, int64_t l, int64_t kv, int64_t b,
                             int64_t n, int64_t h, int64_t d)
{
    const int64_t es = (int64_t)kv_dtype_size(c->dtype);
    const int64_t planes = c->kv_packed ? 1 : 2, plane = c->kv_packed ? 0 : kv;
    const int64_t row = c->kv_packed ? 2 * c->head_dim : c->head_dim;
    const int64_t natural = c->block_tokens * c->num_heads * row;
    const int64_t bstride =
        c->block_stride_bytes ? c->block_stride_bytes / es : natural + c->block_pad_elems;
    const int64_t in =
        (c->order == KV_ORDER_NHD ? n * c->num_heads + h : h * c->block_tokens + n) * row +
        (c->kv_packed ? kv * c->head_dim : 0) + d;
    const int64_t unit = c->arrange == KV_ARRANGE_LAYER_MAJOR
                             ? (l * planes + plane) * c->num_blocks + b
                             : (b * c->num_layers + l) * planes + plane;
    return unit * bstride + in;
}
