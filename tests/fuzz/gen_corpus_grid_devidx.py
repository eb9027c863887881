#!/usr/bin/env python3
"""Seed corpus of fuzz_grid_devidx (tests/fuzz/fuzz_grid_devidx.c).

Each seed is one launch of a device-index kernel body on the CPU grid
emulator, encoded as the target decodes its input: a header (body, cache
shape, dtype | decode body << 1), then the arrays byte by byte. Bytes below
0xE0 are valid choices, from 0xE0 (0xF0 for lengths and indptr edits) the
hostile ones. Valid seeds for every body and both page layouts (CSR and
block table), then a few invalid ones of each kind.

    tests/fuzz/gen_corpus_grid_devidx.py [outdir]   (default:
                                corpus_grid_devidx beside this script)
"""
import os
import sys

WRITE, READ, DECODE, COPY, COPY_EX, PLAN = range(6)
F32, F16 = 0, 1
# decode bodies (fuzz_grid_devidx.c op_decode): auto, general, pipelined
# vector, split-KV in 2 chunks, split-KV by its plan
AUTO, GENERAL, PIPE, SPLIT2, SPLIT = range(5)


def hdr(op, shape, dt=F32, body=0):
    return bytes([op, shape, dt | body << 1])


def csr(seqs, indptr_edit=(0, 0)):
    """seqs: [(page bytes, last byte)]; indptr_edit: (mb, kb)."""
    out = [0, len(seqs)]
    for pages, last in seqs:
        out += [len(pages)] + pages + [last]
    return bytes(out + list(indptr_edit))


def btab(cols, seqs):
    """seqs: [(len byte, [cols page bytes])]; cols 1..4."""
    out = [1, len(seqs), cols - 1]
    for ln, pages in seqs:
        out += [ln] + pages
    return bytes(out)


VALID_CSR = csr([([3, 10, 21], 1), ([], 0), ([7], 3), ([40, 9, 2, 33], 0)])
VALID_BT = btab(3, [(1, [4, 13, 8]), (9, [5, 5, 5]), (0, [30, 2, 17]), (3, [11, 6, 1])])

SEEDS = {
    # write: layer byte (bit 0 all layers), T, (hi, lo) per slot
    "write_layer": hdr(WRITE, 0) + bytes([2, 6, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]),
    "write_all_hnd": hdr(WRITE, 2, F16) + bytes([1, 5, 0, 90, 0, 7, 0, 33, 1, 1, 0, 2]),
    "write_packed": hdr(WRITE, 4) + bytes([1, 4, 0, 1, 0, 47, 0, 20, 0, 3]),
    "write_invalid": hdr(WRITE, 1) + bytes([0, 6, 0, 5, 0xE2, 0, 0xE1, 0, 0, 9, 0xE4, 0, 0xE0, 0]),
    # read: layer byte, pages, out_indptr byte, its index byte
    "read_csr": hdr(READ, 0) + bytes([2]) + VALID_CSR + bytes([0, 0]),
    "read_bt_all": hdr(READ, 3, F16) + bytes([1]) + VALID_BT + bytes([0, 0]),
    "read_csr_packed": hdr(READ, 4) + bytes([3]) + VALID_CSR + bytes([0, 0]),
    "read_bad_page_out": hdr(READ, 2) + bytes([0]) + csr([([3, 0xE1], 0), ([5], 0)]) + bytes([0xE4, 2]),
    "read_decreasing": hdr(READ, 5) + bytes([0]) + csr([([3, 4], 0), ([5], 0), ([6, 7], 1)], (0xF8, 2)) + bytes([0, 0]),
    # decode: layer | G << 1 | scales << 2 | window << 4, pages
    "decode_csr_auto": hdr(DECODE, 0, F32, AUTO) + bytes([0x01]) + VALID_CSR,
    "decode_bt_general": hdr(DECODE, 2, F16, GENERAL) + bytes([0x06]) + VALID_BT,
    "decode_csr_pipe": hdr(DECODE, 7, F32, PIPE) + bytes([0x0A]) + csr([([1, 2], 2), ([9], 0)]),
    "decode_bt_split": hdr(DECODE, 6, F32, SPLIT2) + bytes([0x03]) + VALID_BT,
    "decode_window": hdr(DECODE, 3, F32, SPLIT) + bytes([0x61]) + VALID_CSR,
    "decode_invalid_csr": hdr(DECODE, 0, F32, GENERAL) + bytes([0x00]) + csr([([3, 0xE1], 0), ([5], 0xF1), ([6], 0)], (0xF1, 2)),
    "decode_invalid_bt": hdr(DECODE, 2, F32, AUTO) + bytes([0x04]) + btab(2, [(0xF0, [1, 2]), (2, [0xE3, 4]), (8, [5, 0xE0])]),
    # copy: pair count, (src, dst) per pair
    "copy": hdr(COPY, 0) + bytes([4, 1, 2, 3, 4, 5, 6, 7, 8]),
    "copy_invalid": hdr(COPY, 1, F16) + bytes([4, 1, 2, 0xE0, 4, 5, 0xE2, 0xE3, 0xE1]),
    # copy_ex: layer0 | n_layers << 2 | planes << 4, pair count, pairs
    "copy_ex": hdr(COPY_EX, 0) + bytes([0x00, 3, 20, 2, 1, 9, 5, 0]),
    "copy_ex_hnd_k": hdr(COPY_EX, 2, F16) + bytes([0x15, 3, 16, 2, 1, 9, 0xE0, 0]),
    # plan: partner byte, tokens, source ids, destination ids
    "plan": hdr(PLAN, 0) + bytes([0, 10, 3, 9, 1, 4, 5, 6]),
    "plan_n8_hnd": hdr(PLAN, 6, F16) + bytes([2, 13, 3, 4, 5, 6, 1, 2]),
    "plan_invalid": hdr(PLAN, 1) + bytes([1, 9, 3, 0xE0, 1, 4, 0xE2, 6]),
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "corpus_grid_devidx")
    os.makedirs(out, exist_ok=True)
    for name, data in sorted(SEEDS.items()):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"{len(SEEDS)} seeds in {out}")


if __name__ == "__main__":
    main()
