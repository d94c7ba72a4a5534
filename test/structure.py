#!/usr/bin/env python3
"""The shape of src/, checked on every test run (test/run's "structure" suite).

Three rules of CONTRIBUTING.md that a compiler does not enforce:

  functions   no function in src/**/*.c is longer than 120 lines
  calls       no cycle of calls between files: the symbols each object file
              uses (nm) never lead back to it through other files
  includes    no cycle of #include "..." between the headers in src/**

Run after a build (it reads src/**/*.o).  Prints one line per check,
"ok <check>" or "not ok <check>: <what>", and exits 1 when one fails.
"""
import glob
import os
import re
import subprocess
import sys

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
MAX_LINES = 120


def long_functions():
    """(file, line, name, length) of every function over MAX_LINES lines; a
    function runs from its "{" in column 0 to the next "}" in column 0."""
    found = []
    for path in sorted(glob.glob(os.path.join(SRC, "**", "*.c"), recursive=True)):
        lines = open(path, encoding="utf-8").read().split("\n")
        i = 0
        while i < len(lines):
            if lines[i] == "{":
                j = i - 1
                while j > 0 and "(" not in lines[j]:
                    j -= 1
                m = re.match(r"^\s*(?:[\w\s\*]*?)(\w+)\s*\(", lines[j])
                k = i + 1
                while k < len(lines) and lines[k] != "}":
                    k += 1
                if k - i + 1 > MAX_LINES:
                    found.append((os.path.basename(path), i + 1, m.group(1) if m else "?", k - i + 1))
                i = k
            i += 1
    return found


def call_graph():
    """{file: set of files whose symbols it uses}, from the object files."""
    defined, used = {}, {}
    for obj in sorted(glob.glob(os.path.join(SRC, "**", "*.o"), recursive=True)):
        name = os.path.basename(obj)[:-2]
        out = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
        used[name] = set()
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "U":
                used[name].add(parts[1])
            elif len(parts) == 3 and parts[1] in "TDBR":
                defined[parts[2]] = name
    return {f: {defined[s] for s in syms if s in defined and defined[s] != f}
            for f, syms in used.items()}


def cycles(graph):
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def include_graph():
    graph = {}
    for path in glob.glob(os.path.join(SRC, "**", "*.h"), recursive=True):
        graph[os.path.basename(path)] = set(
            re.findall(r'#include "([^"]+)"', open(path, encoding="utf-8").read()))
    return graph


def main():
    if not glob.glob(os.path.join(SRC, "**", "*.o"), recursive=True):
        print("not ok calls: no object files in src/ (build first)")
        return 1
    failed = 0
    checks = [
        ("functions", [f"{f}:{line} {name} has {n} lines" for f, line, name, n in long_functions()]),
        ("calls", [" -> ".join(c) for c in cycles(call_graph())]),
        ("includes", [" -> ".join(c) for c in cycles(include_graph())]),
    ]
    for name, problems in checks:
        if problems:
            failed += 1
            print(f"not ok {name}: {'; '.join(problems)}")
        else:
            print(f"ok {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
