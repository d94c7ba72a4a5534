#!/usr/bin/env python3
"""The shape of src/, checked on every test run (test/run's "structure" suite).

The rules of CONTRIBUTING.md that a compiler does not enforce:

  functions   no function in src/**/*.c is longer than 120 lines
  calls       no cycle of calls between files: the symbols each object file
              uses (nm) never lead back to it through other files
  includes    no cycle of #include "..." between the headers in src/**
  folders     src/'s folders are the layers of docs/internals.md's table
              ("The files, by layer"), in the order of the Makefile's
              TUVL_LAYERS, and every .c is in one of them and named in
              that section
  layers      no call goes up the table: a file calls only into its own
              layer or one below it (the step kinds are called through the
              step table, never by name)

Run after a build (it reads src/**/*.o).  Prints one line per check,
"ok <check>" or "not ok <check>: <what>", and exits 1 when one fails.
"""
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SRC = os.path.join(ROOT, "src")
INTERNALS = os.path.join(ROOT, "docs", "internals.md")
MAKEFILE = os.path.join(ROOT, "Makefile")
MAX_LINES = 120


def long_functions():
    """(file, line, name, length) of every function over MAX_LINES lines; a
    function runs from its "{" in column 0 to the next "}" in column 0."""
    found = []
    for path in sorted(glob.glob(os.path.join(SRC, "**", "*.c"), recursive=True)):
        lines = open(path, encoding="utf-8").read().split("\n")
        i = 0
        while i < len(lines):
            # a function's "{" follows its parameter list; a struct's or an
            # enum's follows its name
            if lines[i] == "{" and lines[i - 1].rstrip().endswith(")"):
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


def objects():
    """The object files of src/ whose source is there: a file moved or
    removed leaves its old .o behind until make clean."""
    return [o for o in sorted(glob.glob(os.path.join(SRC, "**", "*.o"), recursive=True))
            if os.path.exists(o[:-2] + ".c")]


def symbol_uses():
    """{(file, file it calls into): symbols}, from the object files; a file
    is its path under src/ without .c ("runtime/worker")."""
    defined, used = {}, {}
    for obj in objects():
        name = os.path.relpath(obj, SRC)[:-2]
        out = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
        used[name] = set()
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "U":
                used[name].add(parts[1])
            elif len(parts) == 3 and parts[1] in "TDBR":
                defined[parts[2]] = name
    edges = {}
    for f, syms in used.items():
        for sym in syms:
            if sym in defined and defined[sym] != f:
                edges.setdefault((f, defined[sym]), set()).add(sym)
    return used.keys(), edges


def call_graph():
    """{file: set of files whose symbols it uses}."""
    files, edges = symbol_uses()
    graph = {f: set() for f in files}
    for f, g in edges:
        graph[f].add(g)
    return graph


def layer_table():
    """[(layer, path)] of docs/internals.md's table, top layer first; path
    is a folder under src/ ("runtime/") or a file ("init.c")."""
    text = open(INTERNALS, encoding="utf-8").read()
    m = re.search(r"<!-- layers: begin.*?-->(.*?)<!-- layers: end -->", text, re.S)
    if not m:
        return []
    rows = []
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[1].startswith("`src/"):
            rows.append((cells[0], cells[1].strip("`")[len("src/"):]))
    return rows


def layer_of(table, f):
    """The index in table of file f ("runtime/worker"), or None."""
    for i, (_, path) in enumerate(table):
        if (path.endswith("/") and f.startswith(path)) or f + ".c" == path:
            return i
    return None


def folder_problems(table):
    """What differs between the table, src/'s folders and TUVL_LAYERS."""
    if not table:
        return ["docs/internals.md has no layers table"]
    problems = []
    folders = [p.rstrip("/") for _, p in table if p.endswith("/")]
    on_disk = sorted(d for d in os.listdir(SRC) if os.path.isdir(os.path.join(SRC, d)))
    for d in on_disk:
        if d not in folders:
            problems.append(f"src/{d}/ is not in the table")
    for d in folders:
        if d not in on_disk:
            problems.append(f"the table's src/{d}/ does not exist")
    m = re.search(r"^TUVL_LAYERS = (.*)$", open(MAKEFILE, encoding="utf-8").read(), re.M)
    if not m or m.group(1).split() != folders:
        problems.append(f"the Makefile's TUVL_LAYERS is not {' '.join(folders)}")
    text = open(INTERNALS, encoding="utf-8").read()
    section = text[text.find("## The files, by layer"):]
    section = section[:section.find("\n## ", 1)]
    for path in sorted(glob.glob(os.path.join(SRC, "**", "*.c"), recursive=True)):
        f = os.path.relpath(path, SRC)[:-2]
        if layer_of(table, f) is None:
            problems.append(f"src/{f}.c is in no layer of the table")
        if f"`{os.path.basename(f)}.c`" not in section:
            problems.append(f"src/{f}.c is not named in internals.md's \"The files, by layer\"")
    return problems


def upward_calls(table):
    """Calls into a layer above the caller's, with the symbols."""
    _, edges = symbol_uses()
    found = []
    for (f, g), syms in sorted(edges.items()):
        lf, lg = layer_of(table, f), layer_of(table, g)
        if lf is not None and lg is not None and lg < lf:
            found.append(f"{f}.c ({table[lf][0]}) calls up into {g}.c ({table[lg][0]}): "
                         f"{', '.join(sorted(syms))}")
    return found


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


def unindented():
    """The files of src/ pgindent's formatting would change (make indent)."""
    files = sorted(glob.glob(os.path.join(SRC, "**", "*.[ch]"), recursive=True))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "indent.py"), "--check"] + files,
                       capture_output=True, text=True)
    if r.returncode == 0:
        return []
    bad = [line for line in r.stderr.splitlines() if line.startswith("tools/indent.py")]
    return bad or [r.stderr.strip() or "tools/indent.py --check failed"]


def exports():
    """Symbols of tuvl.so that PostgreSQL does not look up by name (exports.map
    keeps every other one local), and SQL functions it does not export."""
    so = os.path.join(ROOT, "tuvl.so")
    if not os.path.exists(so):
        return ["tuvl.so is not built"]
    out = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True,
                         check=True).stdout
    syms = {line.split()[-1] for line in out.splitlines() if line.strip()}
    allowed = re.compile(r"^(tuvl_\w+|pg_finfo_tuvl_\w+|Pg_magic_func|_PG_init|TuvlLauncherMain|TuvlWorkerMain)$")
    problems = [f"tuvl.so exports {sym}" for sym in sorted(syms) if not allowed.match(sym)][:10]
    for path in sorted(glob.glob(os.path.join(ROOT, "sql", "tuvl--*.sql"))):
        for name in sorted(set(re.findall(r"'MODULE_PATHNAME',\s*'(\w+)'", open(path, encoding="utf-8").read()))):
            if name not in syms:
                problems.append(f"{os.path.basename(path)} names {name}, which tuvl.so does not export")
    return problems


# Exported names tell their file: a family prefix and where it lives (a
# file, or a folder: "agent/"); the longest prefix a name starts with is
# its family.  The step kinds' names (StepExecute..., StepKind...) live
# in the kinds' folders.  CONTRIBUTING.md, "Exports".
FAMILIES = {
    "Agent": "agent/", "Step": ("agent/", "steps/"), "Judge": "agent/judge",
    "Supervisor": "agent/supervisor",
    "Grant": "api/grant_hint", "Replay": "api/replay",
    "Artifact": "catalog/artifact", "Guardrail": "catalog/guardrail", "LlmConfig": "catalog/model",
    "Use": "catalog/uses", "Workflow": "catalog/workflow",
    "Admission": "effects/admission", "Effect": "effects/effect", "Http": "effects/http",
    "Llm": "effects/llm", "LlmRequest": "effects/llm_request", "Mcp": "effects/mcp",
    "Retry": "effects/retry",
    "Secret": "effects/secret",
    "Breakpoints": "runtime/breakpoints", "Checkpoint": "runtime/checkpoint",
    "Compensation": "runtime/compensation", "Concurrency": "runtime/concurrency",
    "Drive": "runtime/driver", "Executor": "runtime/executor", "Hook": "runtime/hook",
    "Launcher": "runtime/launcher", "Lease": "runtime/lease", "RateLimit": "runtime/ratelimit",
    "Control": "runtime/run_control", "RunCreate": "runtime/run_create", "Run": "runtime/runtime",
    "Timers": "runtime/timers", "Validate": "runtime/validate", "Findings": "runtime/validate",
    "McpOAuth": "steps/mcp_oauth",
    "Channel": "storage/channel", "Journal": "storage/journal", "JournalBlock": "storage/journal_block",
    "Queue": "storage/queue", "Tuvl": "storage/shmem", "Status": "storage/status",
    "Cron": "support/cron", "Deadline": "support/deadline", "Duration": "support/duration",
    "Gucs": "support/gucs", "Json": "support/jsonutil", "Text": "support/jsonutil",
    "JsonSchema": "support/jsonschema", "NameIndex": "support/nameindex", "Security": "support/security",
    "Spi": "support/spiutil", "Suggest": "support/suggest", "Template": "support/template",
    "Token": "support/tokens", "Yaml": "support/yamlparse",
    "Metric": "telemetry/metrics", "Metrics": "telemetry/metrics", "Trace": "telemetry/trace",
    "Otlp": "telemetry/otlp",
}
# what PostgreSQL looks up by name, and its own naming of a backend's slot
FAMILY_EXCEPTIONS = {"TuvlLauncherMain": "runtime/launcher", "TuvlWorkerMain": "runtime/worker",
                     "MyTuvlSlot": "storage/shmem"}


def family_problems():
    """Exported names whose family prefix lives in another file, or in none."""
    problems = []
    for obj in objects():
        f = os.path.relpath(obj, SRC)[:-2]
        out = subprocess.run(["nm", "-g", "--defined-only", obj], capture_output=True, text=True,
                             check=True).stdout
        for line in out.splitlines():
            name = line.split()[-1]
            if re.match(r"^(tuvl_|pg_finfo_|Pg_magic_func$|_PG_init$)", name):
                continue
            if name in FAMILY_EXCEPTIONS:
                if FAMILY_EXCEPTIONS[name] != f:
                    problems.append(f"{name} is defined in {f}.c, not {FAMILY_EXCEPTIONS[name]}.c")
                continue
            prefix = max((p for p in FAMILIES if re.match(p + r"([A-Z]|$)", name)), key=len, default=None)
            if prefix is None:
                problems.append(f"{f}.c exports {name}, of no family (test/structure.py FAMILIES)")
                continue
            where = FAMILIES[prefix]
            places = where if isinstance(where, tuple) else (where,)
            if not any(f.startswith(p) if p.endswith("/") else f == p for p in places):
                problems.append(f"{f}.c exports {name}, of the family {prefix}* of {', '.join(places)}")
    return problems


def main():
    if not objects():
        print("not ok calls: no object files in src/ (build first)")
        return 1
    unbuilt = [os.path.relpath(c, SRC)
               for c in sorted(glob.glob(os.path.join(SRC, "**", "*.c"), recursive=True))
               if not os.path.exists(c[:-2] + ".o")]
    if unbuilt:
        print(f"not ok calls: no object file for {', '.join(unbuilt)} (build first)")
        return 1
    failed = 0
    table = layer_table()
    checks = [
        ("functions", [f"{f}:{line} {name} has {n} lines" for f, line, name, n in long_functions()]),
        ("calls", [" -> ".join(c) for c in cycles(call_graph())]),
        ("includes", [" -> ".join(c) for c in cycles(include_graph())]),
        ("folders", folder_problems(table)),
        ("layers", upward_calls(table)),
        ("indent", unindented()),
        ("exports", exports()),
        ("names", family_problems()),
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
