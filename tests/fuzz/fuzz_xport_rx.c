/*
 * fuzz_xport_rx.c - libFuzzer target for the TCP transport's receive state
 * machine (connector/transport/kv_xport_tcp_rx.c) and the blob decoder
 * (kv_xport_rmem_import): the bytes a peer sends, fed through a socketpair
 * into a transport driven by hand (kv__xport_create_manual: no progress
 * thread, so every run is deterministic).
 *
 * Input: byte 0 is the mode, the rest the byte stream from the peer.
 *   bit 0  handshake first: the harness is a valid peer (HELLO with the
 *          right token), the transport accepts it, exposes region 1 (64
 *          KiB) to it, imports a region 7 the harness claims, and posts a
 *          write (transfer 1: two entries and a notification) and a read
 *          (transfer 2: two entries) to it; so ACK, NACK, RDATA, READ and
 *          WRITE frames of the input meet real transfers and exposures.
 *          Without it the input is the first thing the connection sees.
 *   bit 1  structure-aware: every frame's checksums (header, payload, a
 *          WRITE's descriptor table) are recomputed after mutation, so the
 *          fuzzer gets past the header checks to the fields behind them.
 *   bit 2  (with bit 0) the first up-to-256 bytes are also imported as a
 *          blob.
 * The limits are small (4 notifications, 4 reads served) so the refusal
 * paths are reached. After each input the handles are released in order
 * and kv_xport_destroy must succeed; ASan/UBSan and the leak checker see
 * the rest. Any violation aborts.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#define FUZZ_NAME "fuzz_xport_rx"
#include "fuzz_xport.h"
#include "kv_xport_tcp_int.h"
#include "kvt_xport_raw.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define TOKEN 0xF022ull
#define NONCE 0x600DF00Dull

/* Read and drop what the transport sent (its replies). */
static void drain(int fd)
{
    unsigned char sink[65536];
    while (recv(fd, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
    }
}

static size_t unread(int fd)
{
    int n = 0;
    return ioctl(fd, FIONREAD, &n) == 0 && n > 0 ? (size_t)n : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > (1u << 20))
        return 0;
    const uint8_t mode = data[0];
    data++;
    size--;
    kv__error_mute();
    struct fz_xport fz;
    /* listens: the peer comes through kv__tcp_adopt */
    fz_open(&fz, KV_XPORT_TCP, "127.0.0.1", TOKEN, 1);
    kv_xport *x = fz.x;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        die("socketpair");
    (void)fcntl(sv[1], F_SETFL, O_NONBLOCK);
    if (kv__tcp_adopt(x, sv[0]) != KV_OK)
        die("adopt");

    kv_xport_rmem *rb = NULL;
    if (mode & 1) {
        unsigned char h[KV__XF_BYTES + KV__XPORT_HELLO_BYTES];
        if (!kvt_raw_send(sv[1], h, kvt_raw_hello(h, TOKEN, 0, NONCE, 0, 1, 0)))
            die("hello");
        if (kv_xport_accept(x, 1000, &fz.p) != KV_OK)
            die("accept");
        struct kv__xf f;
        unsigned char pl[KV__XPORT_HELLO_BYTES];
        if (!kvt_raw_next(sv[1], &f, pl, sizeof(pl), 1000) || f.type != KV__XF_HELLO)
            die("the transport's HELLO");
        struct kv__xport_hello hh;
        kv__xport_hello_decode(pl, &hh);
        unsigned char blob[KV_XPORT_BLOB_MAX];
        fz_post(&fz, blob, kvt_raw_blob(blob, 7, 1u << 20, NONCE, hh.nonce));
        if ((mode & 4) && kv_xport_rmem_import(fz.p, data, size < 256 ? size : 256, &rb) == KV_OK &&
            kv_xport_rmem_free(rb) != KV_OK)
            die("free of an imported blob");
        kv__xport_step(x, 0);
        drain(sv[1]);
    }

    /* The peer's bytes, as the mode says; fed while the transport reads. */
    unsigned char *buf = malloc(size ? size : 1);
    if (!buf)
        die("malloc");
    if (size)
        memcpy(buf, data, size);
    if (mode & 2)
        kvt_raw_fix_sums(buf, size);
    size_t sent = 0;
    for (int rounds = 0; rounds < 4096; rounds++) {
        if (sent < size) {
            const ssize_t k = send(sv[1], buf + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (k > 0)
                sent += (size_t)k;
            else if (k < 0 && errno != EAGAIN)
                break; /* the transport closed the connection */
        }
        kv__xport_step(x, 0);
        drain(sv[1]);
        if (sent == size && unread(sv[0]) == 0) {
            kv__xport_step(x, 0);
            drain(sv[1]);
            break;
        }
    }
    free(buf);

    /* Release everything, in order; destroy must then succeed. */
    fz_close(&fz);
    close(sv[1]);
    kv__error_unmute();
    return 0;
}
