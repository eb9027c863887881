/*
 * kvdemo_intruder.c - a peer that is not kvdemo's prefill but holds its
 * token (tools/kvdemo/kvdemo.h, XPORT_TOKEN: a constant, so anyone has it):
 * it connects to decode's port and posts DONE for requests 0..N-1 without
 * writing a byte, then stays until decode closes it (tests/cli/test_peers.sh).
 *
 *   kvdemo_intruder PORT N
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <kvcache/kv.h>

#define TOKEN UINT64_C(0x6b7664656d6f2121) /* kvdemo.h's XPORT_TOKEN */
#define TAG_DONE 2                         /* kvdemo.h's */

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: kvdemo_intruder PORT N\n");
        return 2;
    }
    struct kv_xport_config cfg = KV_XPORT_CONFIG_INIT;
    cfg.kind = KV_XPORT_TCP;
    cfg.token = TOKEN;
    cfg.timeout_ms = 3000;
    kv_xport *x = NULL;
    kv_xport_peer *p = NULL;
    if (kv_xport_create(&cfg, &x) != KV_OK ||
        kv_xport_connect(x, "127.0.0.1", (uint16_t)atoi(argv[1]), &p) != KV_OK ||
        kv_xport_peer_wait(p, 3000, NULL) != KV_OK) {
        fprintf(stderr, "kvdemo_intruder: %s\n", kv_last_error());
        return 1;
    }
    int rc = 0;
    for (uint32_t r = 0; r < (uint32_t)atoi(argv[2]); r++) {
        const unsigned char le[4] = {(unsigned char)r, (unsigned char)(r >> 8), 0, 0};
        const struct kv_xport_notify nt = {TAG_DONE, le, 4};
        kv_xport_xfer *t = NULL;
        kv_xport_state st = KV_XPORT_PENDING;
        if (kv_xport_write(p, NULL, 0, &nt, &t) != KV_OK ||
            kv_xport_xfer_wait(t, 3000, &st) != KV_OK || kv_xport_xfer_free(t) != KV_OK ||
            st != KV_XPORT_DONE) {
            fprintf(stderr, "kvdemo_intruder: DONE %u not delivered: %s\n", r, kv_last_error());
            rc = 1;
            break;
        }
    }
    kv_xport_peer_state ps = KV_XPORT_READY;
    kv_status why = KV_OK;
    for (int i = 0; i < 500 && ps != KV_XPORT_CLOSED; i++) {
        usleep(10000);
        if (kv_xport_peer_state_get(p, &ps, &why) != KV_OK)
            break;
    }
    kv_xport_peer_close(p);
    if (kv_xport_destroy(x) != KV_OK)
        rc = 1;
    return rc;
}
