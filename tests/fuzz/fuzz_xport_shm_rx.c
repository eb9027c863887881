/*
 * fuzz_xport_shm_rx.c - libFuzzer target for the same-host transport's
 * receive side (connector/transport/kv_xport_shm_rx.c): the control
 * messages a peer sends, fed through a SOCK_SEQPACKET socketpair into a
 * transport driven by hand (kv__xport_create_manual: no progress thread,
 * every run deterministic).
 *
 * Input: byte 0 is the mode, the rest a list of messages, each a 2-byte
 * little-endian length and that many bytes, sent as one datagram.
 *   bit 0  handshake first: the harness is a valid peer (HELLO with the
 *          right token and a sealed memfd of the right size), the
 *          transport accepts it, exposes region 1 (64 KiB) to it, imports
 *          a region 7 the harness claims, and posts a write (transfer 1:
 *          two entries of 1000 bytes in slot 0, and a notification) and a
 *          read (transfer 2: two entries); so ACK, RDATA, RNACK, NOTE_ACK,
 *          READ, DATA and FREE messages of the input meet real slots,
 *          transfers and exposures. Without it the input is the first
 *          thing the connection sees (a HELLO then comes without memfd).
 *   bit 1  structure-aware: each message's magic, version, reserved field
 *          and payload length are set right after mutation, so the fuzzer
 *          gets past the header checks to the fields behind them.
 *   bit 2  (with bit 0) the ring the harness writes is filled with input
 *          bytes: what a DATA copies out is hostile too.
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
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#define FUZZ_NAME "fuzz_xport_shm_rx"
#include "fuzz_xport.h"
#include "kv_xport_shm_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define TOKEN 0xF023ull
#define NONCE 0x600DF00Eull
static int g_mfd = -1; /* the harness's ring memfd: made once, sealed */
static char *g_ring;   /* its mapping (the harness's half first) */

static void ring_once(void)
{
    if (g_mfd >= 0)
        return;
    const off_t bytes = 2 * (off_t)KV__SHM_RING_BYTES;
    g_mfd = memfd_create("fuzz-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (g_mfd < 0 || ftruncate(g_mfd, bytes) != 0 ||
        fcntl(g_mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
        die("memfd");
    g_ring = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, g_mfd, 0);
    if (g_ring == MAP_FAILED)
        die("mmap");
}

/* One datagram (with fd when >= 0); false when the socket is full or gone. */
static bool send_msg(int fd, const void *p, size_t n, int pass)
{
    union {
        struct cmsghdr h;
        char c[CMSG_SPACE(sizeof(int))];
    } cm;
    memset(&cm, 0, sizeof(cm));
    struct iovec iov = {(void *)p, n};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (pass >= 0) {
        mh.msg_control = cm.c;
        mh.msg_controllen = sizeof(cm.c);
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &pass, sizeof(int));
    }
    return sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT) == (ssize_t)n;
}

/* Read and drop what the transport sent; the first HELLO's nonce kept. */
static void drain(int fd, uint64_t *nonce)
{
    unsigned char b[KV__SHM_MSG_MAX + 8];
    ssize_t r;
    while ((r = recv(fd, b, sizeof(b), MSG_DONTWAIT)) > 0) {
        struct kv__shm_msg m;
        if (nonce && !*nonce && kv__shm_msg_decode(b, (size_t)r, &m) == KV_OK &&
            m.type == KV__SM_HELLO && m.plen == KV__XPORT_HELLO_BYTES) {
            struct kv__xport_hello h;
            kv__xport_hello_decode(b + KV__SHM_HDR, &h);
            *nonce = h.nonce;
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > (1u << 20))
        return 0;
    const uint8_t mode = data[0];
    data++;
    size--;
    ring_once();
    kv__error_mute();
    struct fz_xport fz;
    /* listens: the peer comes through kv__shm_adopt */
    fz_open(&fz, KV_XPORT_SHM, "fuzz", TOKEN, 0);
    kv_xport *x = fz.x;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
        die("socketpair");
    (void)fcntl(sv[1], F_SETFL, O_NONBLOCK);
    if (kv__shm_adopt(x, sv[0]) != KV_OK)
        die("adopt");

    if (mode & 1) {
        unsigned char h[KV__SHM_HDR + KV__XPORT_HELLO_BYTES];
        const struct kv__xport_hello hh = {.version = KV_XPORT_PROTOCOL_VERSION,
                                           .kind = KV_XPORT_SHM,
                                           .token = TOKEN,
                                           .nonce = NONCE,
                                           .conns = 2};
        const struct kv__shm_msg hm = {.version = KV_XPORT_PROTOCOL_VERSION,
                                       .type = KV__SM_HELLO,
                                       .slot = KV__SHM_SLOTS,
                                       .len = KV__SHM_SLOT,
                                       .plen = KV__XPORT_HELLO_BYTES};
        kv__shm_msg_encode(&hm, h);
        kv__xport_hello_encode(&hh, h + KV__SHM_HDR);
        if (!send_msg(sv[1], h, sizeof(h), g_mfd))
            die("hello");
        if (kv_xport_accept(x, 1000, &fz.p) != KV_OK)
            die("accept");
        uint64_t nonce = 0;
        drain(sv[1], &nonce);
        if (!nonce)
            die("the transport's HELLO");
        unsigned char blob[KV_XPORT_BLOB_MAX];
        const struct kv__xport_blob b = {.version = KV_XPORT_PROTOCOL_VERSION,
                                         .kind = KV_XPORT_SHM,
                                         .region = 7,
                                         .bytes = 1u << 20,
                                         .exposer = NONCE,
                                         .importer = nonce};
        fz_post(&fz, blob, kv__xport_blob_encode(&b, blob));
        if (mode & 4) /* the harness's ring: slot by slot, the input's bytes */
            for (uint32_t s = 0; s < KV__SHM_SLOTS && size; s++)
                memcpy(g_ring + (uint64_t)s * KV__SHM_SLOT, data, size < 4096 ? size : 4096);
        kv__xport_step(x, 0);
        drain(sv[1], NULL);
    }

    /* The peer's messages, each [u16 length][bytes], fed as they are read. */
    unsigned char msg[KV__SHM_MSG_MAX + 16];
    size_t at = 0;
    for (int rounds = 0; rounds < 4096 && at + 2 <= size; rounds++) {
        size_t n = (size_t)data[at] | (size_t)data[at + 1] << 8;
        at += 2;
        n = n < size - at ? n : size - at;
        n = n < sizeof(msg) ? n : sizeof(msg);
        memcpy(msg, data + at, n);
        at += n;
        if ((mode & 2) && n >= KV__SHM_HDR) {
            memcpy(msg, "KVSM", 4);
            kv__le_put(msg + 4, KV_XPORT_PROTOCOL_VERSION, 2);
            kv__le_put(msg + 56, n - KV__SHM_HDR, 4);
            kv__le_put(msg + 60, 0, 4);
        }
        bool sent = false;
        for (int k = 0; k < 4 && !sent; k++) {
            sent = send_msg(sv[1], msg, n, -1);
            if (!sent && errno != EAGAIN && errno != EWOULDBLOCK)
                break; /* the transport closed the connection */
            kv__xport_step(x, 0);
            drain(sv[1], NULL);
        }
        if (!sent)
            break;
    }
    kv__xport_step(x, 0);
    drain(sv[1], NULL);

    /* Release everything, in order; destroy must then succeed. */
    fz_close(&fz);
    close(sv[1]);
    kv__error_unmute();
    return 0;
}
