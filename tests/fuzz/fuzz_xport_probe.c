/*
 * fuzz_xport_probe.c - libFuzzer target for the answer a KV_XPORT_AUTO
 * connecting side reads from the listener it probes
 * (kv__xport_probe_parse, connector/transport/kv_xport_codec.c): the
 * frame header, a REFUSE's reason, the hello, and the same-host offer
 * (secret, port, the abstract socket name the connecting side will then
 * connect to).
 *
 * Input: byte 0 is the mode, the rest the bytes.
 *   bit 0  framed: the rest is a payload; a frame header with the right
 *          checksums is put before it (type HELLO, or REFUSE with bit 1),
 *          so the fuzzer gets past the header to the fields behind it;
 *          else the rest is the whole answer as received.
 *   bit 2  (framed) the payload's first 48 bytes are replaced by a valid
 *          hello answering the probe: the offer behind it is what varies.
 * On KV_OK the offer must hold what the connecting side relies on: a
 * secret and a port that are not 0, a name of 1 .. 40 bytes of
 * [0-9a-z-] that fits a socket name. Any violation aborts.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

#include "kv_xport_frame_int.h"
#include "kv_xport_int.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define TOKEN 0xF0F0ull
#define NONCE 0x5EED5EEDull

static void die(const char *what)
{
    fprintf(stderr, "fuzz_xport_probe: %s\n", what);
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kv_xport x; /* only its config is read */
    x.cfg.kind = KV_XPORT_AUTO;
    x.cfg.token = TOKEN;
    x.cfg.fingerprint = 3;
    x.cfg.conns_per_peer = 2;
    if (size < 1)
        return 0;
    const uint8_t mode = data[0];
    data++;
    size--;
    unsigned char buf[KV__XF_BYTES + 512];
    size_t n;
    if (mode & 1) {
        unsigned char *pl = buf + KV__XF_BYTES;
        const size_t len = size < 512 ? size : 512;
        memcpy(pl, data, len);
        if ((mode & 4) && len >= KV__XPORT_HELLO_BYTES) {
            const struct kv__xport_hello h = {.version = KV_XPORT_PROTOCOL_VERSION,
                                              .kind = KV_XPORT_AUTO,
                                              .token = TOKEN,
                                              .fingerprint = 3,
                                              .nonce = 77,
                                              .echo = NONCE};
            kv__xport_hello_encode(&h, pl);
        }
        const struct kv__xf f = {.version = KV_XPORT_PROTOCOL_VERSION,
                                 .type = (mode & 2) ? KV__XF_REFUSE : KV__XF_HELLO,
                                 .offset = (uint64_t)(int64_t)(int8_t)(mode & 0xF0),
                                 .length = len,
                                 .payload_sum = len ? kv__xxh3_64(pl, len) : 0};
        kv__xf_encode(&f, buf);
        n = KV__XF_BYTES + len;
    } else {
        n = size < sizeof(buf) ? size : sizeof(buf);
        memcpy(buf, data, n);
    }
    struct kv__xport_offer o;
    memset(&o, 0xA5, sizeof(o));
    const kv_status st = kv__xport_probe_parse(&x, NONCE, buf, n, &o);
    if (st != KV_OK) {
        if (st != KV_ERR_CORRUPT && st != KV_ERR_MISMATCH && st != KV_ERR_CAPACITY &&
            kv_status_name(st)[0] == 0)
            die("an unnamed status");
        return 0;
    }
    const size_t len = strnlen(o.name, sizeof(o.name));
    if (o.secret == 0 || o.port == 0 || len == 0 || len > KV__XPORT_OFFER_NAME_MAX)
        die("an accepted offer without secret, port or name");
    for (size_t i = 0; i < len; i++) {
        const char c = o.name[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || c == '-'))
            die("an accepted name byte outside [0-9a-z-]");
    }
    char sock[sizeof(((struct sockaddr_un *)0)->sun_path)];
    const int w = snprintf(sock, sizeof(sock) - 1, "kvcache-shm:%s:%u", o.name, (unsigned)o.port);
    if (w < 0 || (size_t)w >= sizeof(sock) - 1)
        die("an accepted name that does not fit a socket name");
    return 0;
}
