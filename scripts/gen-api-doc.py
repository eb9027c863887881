#!/usr/bin/env python3
"""Generate docs/api.md from the public headers, so the reference always
matches the code: each header's top comment, then every KV_API function with
the comment above it (statuses, ownership), and the public structs/enums.

    scripts/gen-api-doc.py > docs/api.md        (CI checks it is current)
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADERS = [
    "kvcache/kv.h", "kvcache/kv_status.h", "kvcache/kv_dtype.h", "kvcache/kv_mem.h",
    "kvcache/kv_view.h", "kvcache/kv_layout.h", "kvcache/kv_block_ops.h",
    "kvcache/kv_page_table.h", "allocator/kv_arena.h", "allocator/kv_block_pool.h",
    "allocator/kv_cache.h",
]


def strip_comment(c):
    lines = []
    for ln in c.strip().splitlines():
        ln = ln.strip()
        ln = re.sub(r"^/\*+ ?", "", ln)
        ln = re.sub(r"\s*\*+/$", "", ln)
        ln = re.sub(r"^\* ?", "", ln)
        lines.append(ln)
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def main():
    out = ["# API reference", "",
           "Generated from the public headers by `scripts/gen-api-doc.py`; the headers are "
           "the source of truth. Every fallible call returns a `kv_status` (`KV_OK == 0`); "
           "`kv_last_error()` gives the detail of the calling thread's last failure. "
           "Pointer arguments are borrowed for the call unless the text says otherwise.", ""]
    for h in HEADERS:
        p = ROOT / h
        if not p.exists():
            continue
        text = p.read_text()
        out.append(f"## `{h}`")
        out.append("")
        m = re.match(r"\s*(/\*.*?\*/)", text, re.S)
        if m:
            out.append("```")
            out.append(strip_comment(m.group(1)))
            out.append("```")
            out.append("")
        # X-macro lists (status codes, dtypes, copy reasons) as tables
        lines = text.splitlines()
        for i, ln in enumerate(lines):
            xm = re.match(r"#define (KV_\w+_MAP)\(X\)", ln)
            if not xm:
                continue
            body = []
            j = i
            while lines[j].rstrip().endswith("\\"):
                j += 1
                body.append(lines[j])
            rows = re.findall(r"X\((.*)\)", "\n".join(body))
            out.append(f"### `{xm.group(1)}`")
            out.append("")
            for r in rows:
                out.append("- " + " ".join(f"`{c.strip()}`" if k == 0 else c.strip()
                                            for k, c in enumerate(r.split(",", 2))))
            out.append("")
        # public types: struct/enum bodies at top level
        for tm in re.finditer(r"^(typedef enum \w+ \{.*?^\} \w+;|struct \w+ \{.*?^\};)", text,
                              re.S | re.M):
            body = tm.group(1)
            name = re.match(r"(?:typedef enum|struct) (\w+)", body).group(1)
            out.append(f"### `{name}`")
            out.append("")
            out.append("```c")
            out.append(body)
            out.append("```")
            out.append("")
        # functions: optional comment block immediately before a KV_API declaration
        for fm in re.finditer(r"((?:/\*(?:(?!\*/).)*\*/\s*)?)(KV_API [^;{]*\))\s*;", text, re.S):
            comment, decl = fm.group(1), " ".join(fm.group(2).split())
            name = re.search(r"(\w+)\s*\(", decl).group(1)
            out.append(f"### `{name}`")
            out.append("")
            out.append("```c")
            out.append(decl.replace("KV_API ", "") + ";")
            out.append("```")
            if comment.strip():
                out.append("")
                out.append(strip_comment(comment))
            out.append("")
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
