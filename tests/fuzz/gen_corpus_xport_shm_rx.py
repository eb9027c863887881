#!/usr/bin/env python3
"""Seeds for tests/fuzz/fuzz_xport_shm_rx.c (run from the repo root; writes
tests/fuzz/corpus_xport_shm_rx/). Each seed is a mode byte then messages,
each a 2-byte little-endian length and the message. The message layout is
connector/transport/kv_xport_shm_int.h; the transfers, slots and regions
named are the ones the harness sets up in handshake mode (region 1 exposed
to the peer, transfer 1 a write of 2 entries of 1000 bytes in the
transport's slot 0 with a notification, transfer 2 a read of 2 entries)."""
import os
import struct

T = dict(HELLO=1, REFUSE=2, DATA=3, ACK=4, NOTIFY=5, NOTE_ACK=6, READ=7, RDATA=8,
         RNACK=9, FREE=10, BYE=11)


def msg(typ, slot=0, entry=0, xfer=0, region=0, status=0, off=0, ln=0, tag=0, payload=b""):
    h = b"KVSM" + struct.pack("<HHIIQIiQQQII", 1, typ, slot, entry, xfer, region, status,
                              off, ln, tag, len(payload), 0)
    assert len(h) == 64
    m = h + payload
    return struct.pack("<H", len(m)) + m


def data(slot, xfer, pieces):
    desc = b"".join(struct.pack("<IIQQ", e, reg, off, n) for e, reg, off, n in pieces)
    return msg(T["DATA"], slot=slot, entry=len(pieces), xfer=xfer,
               ln=sum(p[3] for p in pieces), payload=desc)


def ack(slot, xfer, recs):
    body = b"".join(struct.pack("<IiQ", e, st, n) for e, st, n in recs)
    return msg(T["ACK"], slot=slot, entry=len(recs), xfer=xfer, payload=body)


seeds = {
    "ack_write": [ack(0, 1, [(0, 0, 1000), (1, 0, 1000)]),
                  msg(T["NOTE_ACK"], xfer=1)],
    "ack_refused": [ack(0, 1, [(0, -5, 1000), (1, 0, 1000)])],
    "ack_forged": [ack(0, 1, [(0, 0, 999), (1, 0, 1000)])],
    "ack_wrong_slot": [ack(3, 1, [(0, 0, 1000), (1, 0, 1000)])],
    "note_refused": [ack(0, 1, [(0, 0, 1000), (1, 0, 1000)]),
                     msg(T["NOTE_ACK"], xfer=1, status=-21)],
    "data_in": [data(0, 9, [(0, 1, 0, 100), (1, 1, 65000, 536)])],
    "data_out_of_bounds": [data(1, 9, [(0, 1, 65500, 100), (1, 2, 0, 10)])],
    "data_slot_over": [data(8, 9, [(0, 1, 0, 100)])],
    "read_serve": [msg(T["READ"], xfer=5, entry=0, region=1, off=100, ln=3000),
                   msg(T["FREE"], slot=0)],
    "read_refused": [msg(T["READ"], xfer=5, region=1, off=65000, ln=3000),
                     msg(T["READ"], xfer=6, region=3, off=0, ln=1)],
    "read_flood": [msg(T["READ"], xfer=5 + i, region=1, off=0, ln=10) for i in range(8)],
    "rdata": [msg(T["RDATA"], slot=2, xfer=2, entry=0, off=0, ln=1000),
              msg(T["RDATA"], slot=3, xfer=2, entry=1, off=0, ln=3000)],
    "rdata_unasked": [msg(T["RDATA"], slot=2, xfer=2, entry=0, off=5, ln=10)],
    "rnack": [msg(T["RNACK"], xfer=2, entry=1, status=-5)],
    "notify": [msg(T["NOTIFY"], xfer=4, tag=7, payload=b"hello")],
    "notify_flood": [msg(T["NOTIFY"], xfer=4 + i, tag=i, payload=b"x" * 16) for i in range(6)],
    "free_unheld": [msg(T["FREE"], slot=1)],
    "hello_twice": [msg(T["HELLO"], slot=8, ln=1 << 20, payload=bytes(48))],
    "bye": [msg(T["BYE"])],
    "garbage": [struct.pack("<H", 70) + bytes(range(70))],
}

out = "tests/fuzz/corpus_xport_shm_rx"
os.makedirs(out, exist_ok=True)
for name, msgs in seeds.items():
    with open(os.path.join(out, name), "wb") as f:
        f.write(bytes([0x3]) + b"".join(msgs))
with open(os.path.join(out, "raw_hello"), "wb") as f:  # no handshake: a HELLO without memfd
    f.write(bytes([0x2]) + msg(T["HELLO"], slot=8, ln=1 << 20, payload=bytes(48)))
with open(os.path.join(out, "ring_input"), "wb") as f:
    f.write(bytes([0x7]) + data(0, 9, [(0, 1, 0, 4096)]))
