#!/usr/bin/env python3
"""Refuse byte comparisons of structs in the tests.

    scripts/check-test-compares.py [DIR ...]     (default: tests)
    scripts/check-test-compares.py --self-test

A struct's padding bytes are indeterminate: a struct assignment need not copy
them and an initializer need not clear them, so memcmp over a struct passes
or fails with the compiler, its flags and whatever the stack held before
(tests/unit/test_xport_frame.c failed that way under DEBUG=1). The debug
build pattern-fills uninitialized locals (-ftrivial-auto-var-init=pattern),
which makes a read of an unwritten *field* fail everywhere; but gcc zeroes
padding under that flag, so a padding comparison would pass there and fail
under clang or an older gcc. This check closes that gap: compare structs
field by field (tests/common/kvtest.h: kvt_view_diff, kvt_layout_diff, ...).

Flagged, in assert_memory_equal / assert_memory_not_equal / memcmp / bcmp:
  - a pointer argument that is the address of a whole object: `&x`,
    `&s.field`, `&p->field` (not `&a[i]`, an element of a buffer);
  - a length that is the size of a struct or of one pointee:
    `sizeof(struct ...)`, `sizeof(*p)`.
Byte buffers (arrays, pointers into storage, `n * sizeof(*p)`) pass. A
comparison that really means bytes says so on its line with a comment
containing "check-test-compares: bytes".
"""
import argparse
import re
import sys
from pathlib import Path

CALLS = ("assert_memory_equal", "assert_memory_not_equal", "memcmp", "bcmp")
CALL_RE = re.compile(r"\b(" + "|".join(CALLS) + r")\s*\(")
WHOLE_OBJECT_RE = re.compile(r"^&\s*\(?\s*[A-Za-z_]\w*(\s*(\.|->)\s*[A-Za-z_]\w*)*\s*\)?$")
STRUCT_SIZE_RE = re.compile(r"^sizeof\s*\(?\s*(struct\b|\*\s*\(?\s*[A-Za-z_][\w.>\-\s]*\)?\s*\)?$)")
WAIVER = "check-test-compares: bytes"


def strip_comments_and_strings(text):
    """text with comments and string/char literals blanked, newlines kept."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def split_args(text, start):
    """Top-level arguments of the call whose '(' is at text[start - 1]."""
    args, depth, cur, i = [], 0, [], start
    while i < len(text):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                args.append("".join(cur).strip())
                return args
            depth -= 1
        elif c == "," and depth == 0:
            args.append("".join(cur).strip())
            cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    return None


def check_text(name, text):
    """[(line, message)] for each struct comparison in text."""
    raw_lines = text.splitlines()
    clean = strip_comments_and_strings(text)
    found = []
    for m in CALL_RE.finditer(clean):
        line = clean.count("\n", 0, m.start()) + 1
        end_line = line
        args = split_args(clean, m.end())
        if not args or len(args) < 3:
            continue
        end_line = line + args[0].count("\n") + args[1].count("\n") + args[2].count("\n")
        span = raw_lines[line - 1 : end_line]
        if any(WAIVER in s for s in span):
            continue
        a, b, size = (" ".join(x.split()) for x in args[:3])
        why = None
        for arg in (a, b):
            if WHOLE_OBJECT_RE.match(arg):
                why = f"'{arg}' is a whole object"
                break
        if why is None and STRUCT_SIZE_RE.match(size):
            why = f"length '{size}' is the size of one struct"
        if why:
            found.append(
                (line, f"{m.group(1)}({a}, {b}, {size}): {why}; compare its fields "
                       "(padding bytes are indeterminate)"))
    return found


def check_tree(dirs):
    bad = 0
    for d in dirs:
        for path in sorted(Path(d).rglob("*")):
            if path.suffix not in (".c", ".h", ".cu") or not path.is_file():
                continue
            for line, msg in check_text(str(path), path.read_text(errors="replace")):
                print(f"{path}:{line}: {msg}", file=sys.stderr)
                bad += 1
    return bad


SELF_TEST_BAD = [
    "assert_memory_equal(&f, &sample, sizeof(f));",
    "assert_memory_equal(&now.st, &before->st, sizeof(now.st));",
    "if (memcmp(&before, &v, sizeof(v)) != 0) x();",
    "CHECK(memcmp(x, y, sizeof(*x)) == 0);",
    "assert_memory_not_equal(p, q, sizeof(struct kv_view));",
    "assert_memory_equal(&lo,\n                    &before, sizeof(lo));",
    "return bcmp(&a->geom, &b->geom, n) == 0;",
]
SELF_TEST_GOOD = [
    'assert_memory_equal(b, "KVXF", 4);',
    "assert_memory_equal(refs, f->ref, sizeof(refs));",
    "assert_memory_equal(now.refs, before->refs, before->num_blocks * sizeof(*now.refs));",
    'if (memcmp(&g->raw[4], "kvsv", 4) != 0) x();',
    "assert_memory_equal(a.buf + 100, b.buf + 5000, 1000);",
    "/* never memcmp(&a, &b, sizeof(a)) a struct */",
    'puts("memcmp(&a, &b, sizeof(a))");',
    "assert_memory_equal(&v, &w, sizeof(v)); /* check-test-compares: bytes (never written) */",
    "CHECK(memcmp(got, want, (size_t)n * eb) == 0);",
]


def self_test():
    ok = True
    for s in SELF_TEST_BAD:
        if not check_text("<self-test>", s):
            print(f"self-test: not flagged: {s!r}", file=sys.stderr)
            ok = False
    for s in SELF_TEST_GOOD:
        if check_text("<self-test>", s):
            print(f"self-test: flagged: {s!r}", file=sys.stderr)
            ok = False
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="*", default=["tests"])
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        if not self_test():
            return 1
        print(f"check-test-compares self-test: {len(SELF_TEST_BAD)} struct compares flagged, "
              f"{len(SELF_TEST_GOOD)} byte compares passed")
        return 0
    bad = check_tree(args.dirs)
    if bad:
        print(f"{bad} struct comparison(s) over bytes in the tests", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
