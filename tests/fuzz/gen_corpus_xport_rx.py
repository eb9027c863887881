#!/usr/bin/env python3
"""Seeds for tests/fuzz/fuzz_xport_rx.c (run from the repo root; writes
tests/fuzz/corpus_xport_rx/). Each seed is a mode byte then frames whose
checksums are left zero: the seeds set the structure-aware bit (2), so the
harness recomputes them; the fuzzer then mutates fields, lengths and mode.
The frame layout is connector/transport/kv_xport_frame_int.h; the transfers and
regions named are the ones the harness sets up in handshake mode (region 1
exposed to the peer, transfer 1 a write of 2 entries with a notification,
transfer 2 a read of 2 entries)."""
import os
import struct

T = dict(HELLO=1, REFUSE=2, WRITE=3, ACK=4, NACK=5, NOTIFY=6, BYE=7, READ=8, RDATA=9)
NOTE = 0xFFFFFFFF


def frame(typ, entry=0, xfer=0, region=0, offset=0, payload=b"", length=None):
    n = len(payload) if length is None else length
    h = b"KVXF" + struct.pack("<HHIIQIIQQQQ", 1, typ, 0, entry, xfer, region, 0,
                              offset & (2**64 - 1), n, 0, 0)
    assert len(h) == 64
    return h + payload


def write(xfer, pieces):
    desc = b"".join(struct.pack("<IIQQ", e, reg, off, len(d)) for e, reg, off, d in pieces)
    body = desc + b"".join(d for *_, d in pieces)
    return frame(T["WRITE"], entry=len(pieces), xfer=xfer, payload=body)


def hello(nonce, echo=0, conns=1, conn=0, token=0xF022):
    return frame(T["HELLO"], payload=struct.pack("<IIQQQQII", 1, 1, token, 0, nonce, echo,
                                                  conns, conn))


def ack_records(recs):
    return b"".join(struct.pack("<IiQ", e, st, n) for e, st, n in recs)


seeds = {
    "notify": (3, frame(T["NOTIFY"], xfer=9, offset=5, payload=b"hello")),
    "notify_over_limit": (3, frame(T["NOTIFY"], xfer=9, payload=b"x" * 4352)),
    "notify_flood": (3, b"".join(frame(T["NOTIFY"], xfer=i, payload=b"n") for i in range(8))),
    "write_two_pieces": (3, write(1, [(0, 1, 0, b"a" * 100), (1, 1, 60000, b"b" * 200)])),
    "write_overlap": (3, write(1, [(0, 1, 100, b"a" * 100), (1, 1, 150, b"b" * 100)])),
    "write_out_of_bounds": (3, write(1, [(0, 1, 65500, b"c" * 100), (1, 9, 0, b"d" * 10)])),
    "read": (3, frame(T["READ"], entry=0, xfer=4, region=1, offset=4096,
                      payload=struct.pack("<Q", 1000))),
    "read_flood": (3, b"".join(frame(T["READ"], entry=i, xfer=4, region=1, offset=i * 100,
                                     payload=struct.pack("<Q", 100)) for i in range(8))),
    "ack_write": (3, frame(T["ACK"], entry=2, xfer=1,
                           payload=ack_records([(0, 0, 1000), (1, 0, 1000)]))
                  + frame(T["ACK"], entry=NOTE, xfer=1)),
    "ack_forged_status": (3, frame(T["ACK"], entry=2, xfer=1,
                                   payload=ack_records([(0, -12345, 1000), (1, 0, 1000)]))),
    "nack_read": (3, frame(T["NACK"], entry=0, xfer=2, offset=-5)),
    "nack_note": (3, frame(T["NACK"], entry=NOTE, xfer=1, offset=-21)),
    "rdata": (3, frame(T["RDATA"], entry=0, xfer=2, offset=0, payload=b"r" * 1000)
              + frame(T["RDATA"], entry=1, xfer=2, offset=0, payload=b"s" * 3000)),
    "rdata_partial": (3, frame(T["RDATA"], entry=1, xfer=2, offset=0, payload=b"s" * 1000)),
    "stall_mid_write": (3, write(1, [(0, 1, 0, b"z" * 5000)])[:64 + 24 + 100]),
    "bye": (3, frame(T["BYE"])),
    "hello_raw": (2, hello(0x1234) + frame(T["NOTIFY"], xfer=1, payload=b"after")),
    "hello_twice": (3, hello(0x1234)),
    "refuse_raw": (2, frame(T["REFUSE"], offset=-21, payload=b"too many")),
    "blob": (7, b"KVXB" + struct.pack("<HHIIQQQ", 1, 1, 1, 0, 65536, 0x600DF00D, 0) + b"\0" * 8),
}

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_xport_rx")
os.makedirs(out, exist_ok=True)
for name, (mode, body) in seeds.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(bytes([mode]) + body)
print(f"{len(seeds)} seeds in {out}")
