#!/usr/bin/env python3
"""Generate docs/api.md from the public headers, so the reference always
matches the code. For each header: its top comment, then its types and
constants (structs, enums, typedefs, #define constants and macros, X-macro
tables), then its functions (every KV_API declaration and every inline
function), each with the declaration in a code block and its comment below.

    scripts/gen-api-doc.py > docs/api.md        (CI checks it is current)
    scripts/gen-api-doc.py --lint > /dev/null   (stderr: undocumented items)

Which comment belongs to what (the rules a header author writes to):
  - A comment on the lines right above a declaration, with no blank line in
    between, describes that declaration.
  - A comment after code on the same line (`f(void); /* ... */`) describes
    that line's declaration only.
  - A comment above a run of declarations with no blank lines between them
    describes every declaration of the run that has no comment of its own; a
    run of such functions is shown once, together.
  - A banner (`/* ---- title ---- */`) titles the declarations after it; it
    is a sub-heading, never a description.
  - Any other comment (before an #include, or followed by a blank line) is
    not part of the reference.
Output is deterministic: headers in the order below (then any other
installed header, sorted), declarations in source order.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADERS = [
    "include/kvcache/kv.h", "kvcache/kv_status.h", "kvcache/kv_version.h", "kvcache/kv_dtype.h",
    "kvcache/kv_threads.h", "kvcache/kv_view.h", "kvcache/kv_layout.h",
    "kvcache/kv_block_ops.h", "kvcache/kv_page_table.h", "allocator/kv_arena.h",
    "allocator/kv_block_pool.h", "allocator/kv_cache.h", "allocator/kv_paged.h",
    "attention/kv_attn.h",
]
# Installed headers (Makefile: every module header but *_int.h and the
# library-internal ones); any not listed above is appended so a new public
# header can never be left out silently.
MODULES = ["kvcache", "allocator", "attention", "connector", "binding"]
# The library-internal headers, from the Makefile's LIB_HEADERS (one list:
# a new one is never documented as public by accident).
LIB_INTERNAL = set(re.search(r"^LIB_HEADERS\s*:=\s*(.*)$", (ROOT / "Makefile").read_text(),
                             re.M).group(1).split())

LINT = []


def lint(msg):
    LINT.append(msg)


# ---------------------------------------------------------------- comments --

def strip_comment(c):
    """Text of a /* */ or // comment: delimiters and the ` * ` gutter removed,
    indentation relative to the gutter kept."""
    c = c.strip()
    if c.startswith("//"):
        lines = [re.sub(r"^\s*//+ ?", "", ln) for ln in c.splitlines()]
    else:
        c = re.sub(r"^/\*+", "", c)
        c = re.sub(r"\*+/$", "", c)
        raw = c.splitlines()
        lines = []
        for k, ln in enumerate(raw):
            if k == 0:
                ln = ln[1:] if ln.startswith(" ") else ln
            elif re.match(r"\s*\*", ln):
                ln = re.sub(r"^\s*\* ?", "", ln)
            else:
                ln = ln.strip()  # continuation without a gutter
            lines.append(ln.rstrip())
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    # a gutterless first line next to indented gutter lines: dedent the rest
    ind = [len(ln) - len(ln.lstrip()) for ln in lines[1:] if ln.strip()]
    if lines and ind and min(ind) > 0 and not lines[0].startswith(" "):
        m = min(ind)
        lines = [lines[0]] + [ln[m:] for ln in lines[1:]]
    return "\n".join(lines)


def banner_title(text):
    """'metadata operations (never copy)' for '---- metadata ... ----', else None."""
    if "\n" in text:
        return None
    m = re.fullmatch(r"\s*[-=]{2,}\s*(.*?)\s*[-=]*\s*", text)
    return m.group(1) if m and m.group(1) else None


def remove_comments(s):
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", s, flags=re.S)


# ----------------------------------------------------------------- scanner --

class Item:
    def __init__(self, kind, text, start, end):
        self.kind = kind      # comment | pp | decl
        self.text = text
        self.start = start    # first and last line (1-based)
        self.end = end
        self.trailing = False  # comment after code on its first line
        self.cond = []        # enclosing #if chains: [(chain id, branch line)]


def scan(text):
    """Top-level items of a header: comments, preprocessor lines (with their
    continuations) and declarations (to ';' or an inline function's '}')."""
    items = []
    i, n, line = 0, len(text), 1
    line_has_code = False  # code seen earlier on the current line

    def skip_comment(j):
        if text.startswith("//", j):
            k = text.find("\n", j)
            return n if k < 0 else k
        k = text.find("*/", j + 2)
        return n if k < 0 else k + 2

    def skip_string(j):
        q, j = text[j], j + 1
        while j < n and text[j] != q:
            j += 2 if text[j] == "\\" else 1
        return j + 1

    def skip_pp(j):
        while j < n:
            if text.startswith("/*", j):
                j = skip_comment(j)
            elif text[j] == "\\" and text.startswith("\n", j + 1):
                j += 2
            elif text[j] == "\n":
                return j
            else:
                j += 1
        return j

    while i < n:
        ch = text[i]
        if ch == "\n":
            line += 1
            line_has_code = False
            i += 1
        elif ch.isspace():
            i += 1
        elif text.startswith("/*", i) or text.startswith("//", i):
            j = skip_comment(i)
            it = Item("comment", text[i:j], line, line + text.count("\n", i, j))
            it.trailing = line_has_code
            items.append(it)
            line = it.end
            i = j
        elif ch == "#":
            j = skip_pp(i)
            items.append(Item("pp", text[i:j], line, line + text.count("\n", i, j)))
            line = items[-1].end
            line_has_code = True
            i = j
        elif ch == "}":  # closes extern "C" {
            i += 1
            line_has_code = True
        else:
            start, depth, j = i, 0, i
            while j < n:
                c = text[j]
                if text.startswith("/*", j) or text.startswith("//", j):
                    j = skip_comment(j)
                    continue
                if c in "\"'":
                    j = skip_string(j)
                    continue
                if c == "#" and text[text.rfind("\n", 0, j) + 1:j].strip() == "":
                    j = skip_pp(j)
                    continue
                if c == "{":
                    head = remove_comments(text[start:j]).strip()
                    if depth == 0 and re.fullmatch(r'extern\s+"C"', head):
                        start = j = j + 1  # transparent: nothing to record
                        break
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        head = remove_comments(text[start:j])
                        body_open = head.find("{")
                        if remove_comments(text[start:start + body_open]).rstrip().endswith(")"):
                            j += 1  # inline function definition
                            break
                elif c == ";" and depth == 0:
                    j += 1
                    break
                j += 1
            while start < j and text[start].isspace():
                if text[start] == "\n":
                    line += 1
                start += 1
            if start < j:
                it = Item("decl", text[start:j], line, line + text.count("\n", start, j))
                items.append(it)
                line = it.end
                line_has_code = True
            i = j
    return items


def annotate_conditions(items):
    """Record on each item the #if chains around it, ignoring the include
    guard and `#ifdef __cplusplus`."""
    stack, chain = [], 0
    guard = None
    for k, it in enumerate(items):
        if it.kind != "pp":
            it.cond = [(c, b) for c, b, ign in stack if not ign]
            continue
        m = re.match(r"#\s*(\w*)\s*(.*)", it.text, re.S)
        word, rest = m.group(1), m.group(2)
        if word in ("if", "ifdef", "ifndef"):
            chain += 1
            ignore = "__cplusplus" in rest
            if word == "ifndef" and guard is None:
                nxt = items[k + 1] if k + 1 < len(items) else None
                name = rest.split()[0] if rest.split() else ""
                if nxt and nxt.kind == "pp" and re.match(r"#\s*define\s+%s\s*$" % re.escape(name),
                                                          nxt.text):
                    guard = name
                    ignore = True
            stack.append((chain, it.text.strip(), ignore))
        elif word in ("elif", "else") and stack:
            c, _, ign = stack.pop()
            stack.append((c, it.text.strip(), ign))
        elif word == "endif" and stack:
            stack.pop()
        it.cond = [(c, b) for c, b, ign in stack if not ign]
    return guard


# ----------------------------------------------------------------- entries --

class Entry:
    def __init__(self, cat, name, code, item):
        self.cat = cat          # type | func | xmap
        self.name = name
        self.code = code        # list of code lines
        self.item = item
        self.own = None         # comment Item right above
        self.group = None       # comment Item above the run (may be own)
        self.trail = []         # same-line comment texts
        self.section = None     # banner title
        self.rows = None        # X-macro rows


def define_parts(pp):
    """(name, params, value, [comment texts]) of a #define line."""
    spliced = re.sub(r"[ \t]*\\\n", "\n", pp)  # line continuations inside comments
    comments = [strip_comment(c) for c in re.findall(r"/\*.*?\*/|//[^\n]*", spliced, re.S)]
    body = remove_comments(pp).replace("\\\n", " ")
    m = re.match(r"\s*#\s*define\s+(\w+)(\([^)]*\))?(.*)", body, re.S)
    return m.group(1), m.group(2) or "", " ".join(m.group(3).split()), comments


def wrap_decl(d, width=100):
    """A one-line prototype wrapped at commas, continuation lines aligned
    after the opening parenthesis (the headers' clang-format style)."""
    if len(d) <= width or "(" not in d:
        return [d]
    col = d.index("(") + 1
    params, depth, last = [], 0, col
    for k in range(col, len(d)):  # split at the top-level commas only
        depth += {"(": 1, ")": -1}.get(d[k], 0)
        if d[k] == "," and depth == 0:
            params.append(d[last:k].strip())
            last = k + 1
    params.append(d[last:].strip())
    lines, cur = [], d[:col] + params[0]
    for k, p in enumerate(params[1:], 1):
        if len(cur) + 2 + len(p) + (0 if k == len(params) - 1 else 1) > width:
            lines.append(cur + ",")
            cur = " " * col + p
        else:
            cur += ", " + p
    return lines + [cur]


def decl_entry(it):
    src = it.text.strip()
    flat = " ".join(remove_comments(src).split())
    if re.match(r"KV_API\b", flat):
        name = re.search(r"(\w+)\s*\(", flat.replace("KV_API ", "", 1)).group(1)
        return Entry("func", name, wrap_decl(" ".join(src.split()).replace("KV_API ", "", 1)), it)
    if src.endswith("}") and re.match(r"(static\s+inline|inline|KV_HD)\b", flat):
        name = re.search(r"(\w+)\s*\(", flat[:flat.find("{")]).group(1)
        return Entry("func", name, src.splitlines(), it)
    if flat.startswith("typedef"):
        m = (re.search(r"\(\s*\*\s*(\w+)\s*\)\s*\(", flat)  # function pointer
             or re.search(r"(\w+)\s*(\[[^\]]*\])*\s*;$", flat))
        return Entry("type", m.group(1), src.splitlines(), it)
    m = re.match(r"(struct|enum|union)\s+(\w+)\s*\{", flat)
    if m:
        return Entry("type", f"{m.group(1)} {m.group(2)}", src.splitlines(), it)
    m = re.search(r"(\w+)\s*(\[[^\]]*\])*\s*(=[^;]*)?;$", flat)
    lint(f"{it.start}: unrecognized declaration {flat[:60]!r}")
    return Entry("type", m.group(1) if m else flat[:40], src.splitlines(), it)


def build_entries(text, path):
    items = scan(text)
    guard = annotate_conditions(items)
    top = items[0] if items and items[0].kind == "comment" else None

    entries, section = [], None
    defines = {}  # name -> Entry (conditional variants merge)
    for k, it in enumerate(items):
        if it.kind == "comment":
            t = strip_comment(it.text)
            if not it.trailing and it is not top and banner_title(t):
                section = banner_title(t)
            continue
        e = None
        if it.kind == "decl":
            e = decl_entry(it)
        elif it.kind == "pp" and re.match(r"#\s*define\b", it.text):
            name, params, value, comments = define_parts(it.text)
            if name == guard:
                continue
            if re.fullmatch(r"\w+_MAP", name) and params == "(X)":
                e = Entry("xmap", name, [], it)
                e.rows = re.findall(r"X\((.*?)\)\s*(?:\\|$)", it.text, re.M)
            elif name in defines:
                defines[name].variants.append((it, params, value, comments))
                continue
            else:
                e = Entry("type", name, [], it)
                e.variants = [(it, params, value, comments)]
                defines[name] = e
        if e is None:
            continue
        # comments: own (right above), group (above the run), trailing (same line)
        nxt = items[k + 1] if k + 1 < len(items) else None
        if nxt and nxt.kind == "comment" and nxt.trailing and nxt.start == it.end:
            e.trail.append(strip_comment(nxt.text))
        j, prev = k - 1, it
        while j >= 0 and prev.start - items[j].end <= 1:
            p = items[j]
            if p.kind == "comment" and not p.trailing:
                if p is not top and not banner_title(strip_comment(p.text)):
                    e.group = p
                    e.own = p if j == k - 1 else None
                break
            prev, j = p, j - 1
        e.section = section
        entries.append(e)
    return entries, (strip_comment(top.text) if top else None)


# --------------------------------------------------------------- rendering --

def render_text(t):
    """Comment text as Markdown: prose as a paragraph, anything laid out
    (indentation, aligned columns, diagrams, list-like lines) verbatim."""
    lines = t.splitlines()
    laid_out = any(ln.startswith(" ") or re.search(r"\S {2,}\S", ln)
                   or re.match(r"\s*([-+*>#|=]|\d+[.)])(\s|$)", ln) for ln in lines) or re.search(r"<[A-Za-z/!?]|[^\s(\[{]\*|(^|\s)_\w", t)
    if laid_out:
        return ["```text"] + lines + ["```"]
    return lines


def define_code(e):
    out, last_chain = [], None
    for it, params, value, comments in e.variants:
        if it.cond:
            chain, branch = it.cond[-1]
            if chain != last_chain and last_chain is not None:
                out.append("#endif")
            out.append(branch)
            last_chain = chain
        elif last_chain is not None:
            out.append("#endif")
            last_chain = None
        out.append(f"#define {e.name}{params} {value}".rstrip())
    if last_chain is not None:
        out.append("#endif")
    return out


def is_define(e):
    return e.cat == "type" and not e.code


def notes(e):
    """Same-line comments: after a declaration, or inside a #define."""
    out = list(e.trail)
    if is_define(e):
        for it, _, _, comments in e.variants:
            out.extend(c for c in comments if c not in out)
    return out


def describe(e, path):
    parts = [strip_comment(e.group.text)] if e.group is not None else []
    parts.extend(t for t in notes(e) if t not in parts)
    if not parts:
        lint(f"{path}:{e.item.start}: {e.name} has no comment")
    return parts


def render_entry(out, group, path):
    """One entry: a declaration, or a run of them sharing one group comment."""
    e = group[0]
    out.append("#### " + ", ".join(f"`{g.name}`" for g in group))
    out.append("")
    if e.cat == "xmap":
        if e.group is not None:
            out.extend(render_text(strip_comment(e.group.text)))
            out.append("")
        for r in e.rows:
            out.append("- " + " ".join(f"`{c.strip()}`" if k == 0 else c.strip()
                                        for k, c in enumerate(r.split(",", 2))))
        out.append("")
        return
    if len(group) == 1:
        code = define_code(e) if is_define(e) else list(e.code)
        parts = describe(e, path)
    else:  # a run: every declaration, its same-line comments kept on its line
        code = []
        for g in group:
            lines = define_code(g) if is_define(g) else list(g.code)
            n = notes(g)
            if n:
                lines[-1] += " /* " + " ".join(" ".join(n).split()) + " */"
            code += lines
        parts = [strip_comment(e.group.text)]
    out.append("```c")
    out.extend(code)
    out.append("```")
    out.append("")
    for p in parts:
        out.extend(render_text(p))
        out.append("")
    if not parts:
        out.append("_No comment in the header._")
        out.append("")


def render_header(out, h, text):
    entries, top = build_entries(text, h)
    out.append(f"## `{h}`")
    out.append("")
    if top:
        out.append("```")
        out.append(top)
        out.append("```")
        out.append("")
    for cat, title in (("type", "Types and constants"), ("func", "Functions")):
        sel = [e for e in entries if (e.cat == cat or (cat == "type" and e.cat == "xmap"))]
        shown = None
        k = 0
        while k < len(sel):
            e = sel[k]
            # a run of functions (or #defines) sharing one group comment,
            # none of the rest having its own
            run = [e]
            if (cat == "func" or is_define(e)) and e.group is not None:
                while (k + len(run) < len(sel) and sel[k + len(run)].group is e.group
                       and sel[k + len(run)].own is None and sel[k + len(run)].cat == e.cat
                       and is_define(sel[k + len(run)]) == is_define(e)
                       and sel[k + len(run)].section == e.section):
                    run.append(sel[k + len(run)])
            heading = title + (f": {e.section}" if e.section else "")
            if heading != shown:
                out.append(f"### {heading}")
                out.append("")
                shown = heading
            render_entry(out, run, h)
            k += len(run)


def header_list():
    listed = [h for h in HEADERS if (ROOT / h).exists()]
    extra = sorted(str(p.relative_to(ROOT)) for m in MODULES for p in (ROOT / m).rglob("*.h")
                   if not p.name.endswith(("_int.h", "_hd.h"))
                   and str(p.relative_to(ROOT)) not in HEADERS
                   and str(p.relative_to(ROOT)) not in LIB_INTERNAL)
    for h in extra:
        lint(f"{h}: installed but not in HEADERS (appended)")
    for h in HEADERS:
        if h not in listed:
            lint(f"{h}: listed but missing")
    return listed + extra


def main():
    out = ["# API reference", "",
           "Generated from the public headers by `scripts/gen-api-doc.py`; the headers are "
           "the source of truth. Every fallible call returns a `kv_status` (`KV_OK == 0`); "
           "`kv_last_error()` gives the detail of the calling thread's last failure. "
           "Pointer arguments are borrowed for the call unless the text says otherwise.", ""]
    for h in header_list():
        render_header(out, h, (ROOT / h).read_text())
    while out and out[-1] == "":
        out.pop()
    sys.stdout.write("\n".join(out) + "\n")
    if "--lint" in sys.argv[1:]:
        for m in LINT:
            print("gen-api-doc: " + m, file=sys.stderr)


if __name__ == "__main__":
    main()
