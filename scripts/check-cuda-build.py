#!/usr/bin/env python3
"""Check that a build really contains CUDA device code (a check that can fail).

    scripts/check-cuda-build.py build/libkvcache.so build-cu-*/**/*.cu.o
    scripts/check-cuda-build.py --self-test

For each file given, every CUDA fat binary embedded in it (found by its
header magic 0xBA55ED50) is listed as (kind, arch) entries: kind 2 is an ELF
cubin (machine code for one sm_XX), kind 1 is PTX (virtual code a driver can
JIT). The library must carry, in every fat binary, machine code for each
--sm (default 80 and 90) and PTX for --ptx (default 90); a file with no fat
binary at all fails (a CUDA=0 stub build exports the same C symbols, so a
symbol check alone would pass for it). The toolkit here has no cuobjdump, so
the fat binary header is read directly (layout: u32 magic, u16 version,
u16 header size, u64 payload size; then entries: u16 kind, u16 version,
u32 entry header size, u64 payload size, ..., u32 arch at byte 28).
"""
import argparse
import struct
import sys
import tempfile
from pathlib import Path

MAGIC = 0xBA55ED50
KIND = {1: "ptx", 2: "elf"}


def fatbins(data):
    """Yield a list of (kind, arch) for every fat binary in data."""
    pos = 0
    magic = struct.pack("<I", MAGIC)
    while True:
        i = data.find(magic, pos)
        if i < 0 or i + 16 > len(data):
            return
        _, version, hsize, fsize = struct.unpack_from("<IHHQ", data, i)
        if version != 1 or hsize < 16 or i + hsize + fsize > len(data):
            pos = i + 4  # not a header: the magic appeared by chance
            continue
        entries, p, end = [], i + hsize, i + hsize + fsize
        while p + 32 <= end:
            kind, _, ehsize, padded = struct.unpack_from("<HHIQ", data, p)
            arch = struct.unpack_from("<I", data, p + 28)[0]
            if ehsize < 32 or kind not in KIND:
                break
            entries.append((KIND[kind], arch))
            p += ehsize + padded
        yield entries
        pos = end


def check(paths, sms, ptxs):
    errs, seen = [], 0
    for path in paths:
        data = Path(path).read_bytes()
        bins = list(fatbins(data))
        if not bins:
            errs.append(f"{path}: no CUDA fat binary (was it built without nvcc?)")
            continue
        for k, entries in enumerate(bins):
            seen += 1
            have = set(entries)
            for sm in sms:
                if ("elf", sm) not in have:
                    errs.append(f"{path}: fat binary {k} has no sm_{sm} machine code "
                                f"(has {sorted(have)})")
            for ptx in ptxs:
                if ("ptx", ptx) not in have:
                    errs.append(f"{path}: fat binary {k} has no compute_{ptx} PTX "
                                f"(has {sorted(have)})")
        print(f"{path}: {len(bins)} fat binar{'y' if len(bins) == 1 else 'ies'}: "
              + "; ".join(", ".join(f"{kd}:{a}" for kd, a in sorted(set(e))) for e in bins))
    return errs


def fake_fatbin(entries):
    body = b""
    for kind, arch in entries:
        payload = b"\0" * 64
        hdr = struct.pack("<HHIQ", {"ptx": 1, "elf": 2}[kind], 0x101, 64, len(payload))
        hdr += b"\0" * (28 - len(hdr)) + struct.pack("<I", arch)
        hdr += b"\0" * (64 - len(hdr))
        body += hdr + payload
    return b"junk" + struct.pack("<IHHQ", MAGIC, 1, 16, len(body)) + body + b"tail"


def self_test():
    cases = [
        ("complete", [("elf", 80), ("elf", 90), ("ptx", 90)], True),
        ("no ptx", [("elf", 80), ("elf", 90)], False),
        ("no sm_80", [("elf", 90), ("ptx", 90)], False),
        ("nothing", None, False),
    ]
    ok = True
    with tempfile.TemporaryDirectory() as d:
        for name, entries, want in cases:
            f = Path(d) / "lib.bin"
            f.write_bytes(b"no device code here" if entries is None else fake_fatbin(entries))
            got = not check([str(f)], [80, 90], [90])
            if got != want:
                print(f"check-cuda-build self-test: case '{name}' passed={got}, want {want}")
                ok = False
    print("check-cuda-build self-test: " + ("missing arches and stub builds are caught"
                                            if ok else "FAILED"))
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--sm", type=int, action="append", help="required sm_XX (default 80, 90)")
    ap.add_argument("--ptx", type=int, action="append", help="required PTX (default 90)")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.files:
        ap.error("no files")
    errs = check(a.files, a.sm or [80, 90], a.ptx or [90])
    for e in errs:
        print("check-cuda-build: " + e)
    return 1 if errs else 0


if __name__ == "__main__":
    sys.exit(main())
