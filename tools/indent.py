#!/usr/bin/env python3
"""tools/indent.py: format tuvl's C the way pgindent formats PostgreSQL's.

pgindent is PostgreSQL's wrapper around pg_bsd_indent: the same options,
a typedefs list, and a few fixes after it.  This does the same for the C
files given (`make indent` gives src/), with Debian's pg-bsd-indent and
the typedefs.list at the top of the tree (`make typedefs` makes it):

    tools/indent.py [--check] FILE...

--check changes nothing: it names each file whose formatting differs and
exits 1 if any does (the structure suite runs it).  pg_bsd_indent's
complaints about a file are printed; a file it cannot parse is left as it
is and counts as differing.
"""
import difflib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pgindent's options for pg_bsd_indent 2.1 (PostgreSQL 13 to 15)
OPTIONS = ["-bad", "-bap", "-bbb", "-bc", "-bl", "-cli1", "-cp33", "-cdb", "-nce", "-d0", "-di12",
           "-nfc1", "-i4", "-l79", "-lp", "-lpl", "-nip", "-npro", "-sac", "-tpg", "-ts4"]


def post_indent(source):
    """pgindent's fixes after pg_bsd_indent that tuvl's code needs."""
    # a single space before '*' in a function definition's return type
    source = re.sub(r"^([A-Za-z_]\S*)\s+\*$", r"\1 *", source, flags=re.M)
    # a tab between run-together comments
    source = re.sub(r"\*/(/\*.*\*/)$", r"*/\t\1", source, flags=re.M)
    return source


def indent(path, typedefs):
    """The file as pgindent would leave it, and pg_bsd_indent's complaints."""
    with open(path, encoding="utf-8") as f:
        before = f.read()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.c")
        r = subprocess.run(["pg_bsd_indent"] + OPTIONS + ["-U" + typedefs, path, out],
                           capture_output=True, text=True)
        if r.returncode != 0 or not os.path.exists(out):
            return before, (r.stderr.strip() or "pg_bsd_indent failed") + " (left as it is)"
        with open(out, encoding="utf-8") as f:
            after = post_indent(f.read())
    return after, r.stderr.strip()


def main():
    args = sys.argv[1:]
    check = "--check" in args
    files = [a for a in args if a != "--check"]
    typedefs = os.path.join(ROOT, "typedefs.list")
    if not os.path.exists(typedefs):
        sys.exit("tools/indent.py: %s is missing (make typedefs makes it)" % typedefs)
    if subprocess.run(["sh", "-c", "command -v pg_bsd_indent"], capture_output=True).returncode != 0:
        sys.exit("tools/indent.py: pg_bsd_indent is not installed (Debian: apt-get install pg-bsd-indent)")
    differ = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            before = f.read()
        after, complaints = indent(path, typedefs)
        if complaints:
            print("%s: %s" % (path, complaints.replace("\n", "; ")), file=sys.stderr)
        if after == before and "(left as it is)" not in complaints:
            continue
        differ.append(path)
        if check:
            diff = difflib.unified_diff(before.splitlines(), after.splitlines(), path, path + " (indented)",
                                        lineterm="", n=1)
            print("\n".join(list(diff)[:40]))
        elif after != before:
            with open(path, "w", encoding="utf-8") as f:
                f.write(after)
    if check and differ:
        print("tools/indent.py: %d file(s) not as pgindent formats them: %s (make indent formats them)"
              % (len(differ), " ".join(differ)), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
