#!/usr/bin/env python3
"""tools/typedefs.py: the typedef names pg_bsd_indent must know, one a line.

pgindent formats a declaration right only when it knows the type's name is
a type (`List *l`, not `List * l`).  PostgreSQL finds its names in the
debugging symbols of a build; tuvl takes them from the headers it compiles
against: PostgreSQL's server headers, libcurl's and libyaml's, the C
library's common ones, and its own headers and sources.  `make typedefs`
writes typedefs.list with this; `make indent` reads it.

    tools/typedefs.py INCLUDEDIR... -- SOURCEFILE... > typedefs.list
"""
import os
import re
import sys

COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
FUNCPTR = re.compile(r"\(\s*\*\s*(\w+)\s*\)")
IDENT = re.compile(r"(\w+)\s*(?:\[[^\]]*\]\s*)*$")
# always types, whatever the headers say (the C library's, used everywhere)
BASE = {"FILE", "bool", "int8_t", "int16_t", "int32_t", "int64_t", "pid_t", "size_t", "ssize_t",
        "time_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t", "va_list", "sig_atomic_t",
        "pthread_t", "socklen_t", "off_t", "uintptr_t", "intptr_t", "fd_set"}


def typedef_names(text):
    """The names the typedefs of a C text declare."""
    text = COMMENT.sub(" ", text)
    # macros' bodies declare nothing by themselves (genbki.h's CATALOG)
    text = re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)
    for m in re.finditer(r"\btypedef\b", text):
        depth, i = 0, m.end()
        while i < len(text):
            c = text[i]
            if c in "({":
                depth += 1
            elif c in ")}":
                depth -= 1
            elif c == ";" and depth == 0:
                break
            i += 1
        decl = text[m.end():i]
        # the part after the last closing brace: struct/enum bodies hold no names of the typedef
        tail = decl[decl.rfind("}") + 1:] if "}" in decl else decl
        f = FUNCPTR.search(tail)
        if f:
            yield f.group(1)
            continue
        if "(" in tail:
            # a function type: typedef int Name(args)
            n = IDENT.search(tail[:tail.index("(")].strip())
            if n:
                yield n.group(1)
            continue
        for part in tail.split(","):
            part = re.sub(r"\b__attribute__\s*\(\(.*\)\)", "", part).strip().rstrip("*").strip()
            n = IDENT.search(part)
            if n and not n.group(1).isdigit():
                yield n.group(1)


def files(paths):
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                for n in names:
                    if n.endswith(".h"):
                        yield os.path.join(root, n)
        elif os.path.exists(p):
            yield p


def main():
    args = sys.argv[1:]
    split = args.index("--") if "--" in args else len(args)
    names = set(BASE)
    for f in files(args[:split] + args[split + 1:]):
        with open(f, encoding="utf-8", errors="replace") as fh:
            names.update(typedef_names(fh.read()))
    # keywords, and names tuvl uses for variables: PostgreSQL's `text`
    # (a varlena; tuvl declares one `text *`, and names 160 variables text)
    names -= {"text", "int", "char", "void", "long", "short", "unsigned", "signed", "struct", "union", "enum",
              "const", "volatile", "double", "float"}
    for n in sorted(names):
        print(n)


if __name__ == "__main__":
    main()
