#!/usr/bin/env python3
"""Lists the functions in src/ (tests and testing/ helpers excepted) longer than 120 lines.

A function is a definition that opens at column 0 (namespace-level, as STYLE.md lays them out) or
at column 2 inside a class, and ends at the brace that closes it; its length counts from the first
line of its signature to that brace, lambdas and comments inside included.

  tools/check-functions.py            list the offenders; exit 1 if any is not in the baseline or
                                      grew past its baseline length
  tools/check-functions.py --baseline rewrite tools/function-lengths.txt from the tree

The baseline (tools/function-lengths.txt) holds the offenders the rooms-by-phase split has still to
break up; it may only shrink. ctest runs the check as tool.check_functions.
"""
import os
import re
import subprocess
import sys

LIMIT = 120
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = os.path.join(ROOT, "tools", "function-lengths.txt")
NOT_A_FUNCTION = re.compile(r"^\s*(namespace|class|struct|enum|union|extern|using|typedef|template\s*<[^>]*>\s*(class|struct))\b")


def sources():
    try:
        out = subprocess.run(["git", "ls-files", "src"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
        files = out.split()
    except (OSError, subprocess.CalledProcessError):
        files = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "src")) for f in fs]
    for f in sorted(files):
        if not f.endswith((".cc", ".h", ".cu", ".cuh")) or f.endswith("_test.cc") or "/testing/" in f:
            continue
        yield f


def strip(line):
    """The line without string / char literals and // comments (enough for brace counting)."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])*'", "''", line)
    return line.split("//", 1)[0]


def functions(path):
    lines = open(os.path.join(ROOT, path), encoding="utf-8", errors="replace").read().split("\n")
    i = 0
    while i < len(lines):
        code = strip(lines[i])
        if not code.rstrip().endswith("{") or code.lstrip().startswith(("}", "#")):
            i += 1
            continue
        # The signature's first line: walk back over the continuation lines of the same definition.
        start = i
        while start > 0 and i - start < 8:
            prev = lines[start - 1]
            p = strip(prev).rstrip()
            if not prev.strip() or prev.lstrip().startswith(("//", "#")) or p.endswith((";", "}", "{", ":")):
                break
            start -= 1
        head = lines[start]
        indent = len(head) - len(head.lstrip(" "))
        signature = " ".join(strip(lines[k]).strip() for k in range(start, i + 1))
        if indent not in (0, 2) or NOT_A_FUNCTION.match(head) or "(" not in signature or \
                re.match(r"\s*(if|for|while|switch|do|else|case|default|return)\b", head):
            i += 1
            continue
        depth, j = 0, i
        while j < len(lines):
            c = strip(lines[j])
            depth += c.count("{") - c.count("}")
            if depth <= 0:
                break
            j += 1
        m = re.search(r"([\w:~]+(?:operator\S*)?)\s*\(", signature)
        yield (m.group(1) if m else signature[:60]), start + 1, j - start + 1
        i = j + 1 if indent == 0 else i + 1


def main():
    found = {}
    for f in sources():
        for name, line, n in functions(f):
            if n > LIMIT:
                found[f"{f} {name}"] = (n, line)
    if "--baseline" in sys.argv:
        with open(BASELINE, "w") as out:
            out.write("# Functions over %d lines still to split (tools/check-functions.py); may only shrink.\n" % LIMIT)
            for k in sorted(found):
                out.write(f"{k} {found[k][0]}\n")
        print(f"check-functions: {len(found)} offenders written to {os.path.relpath(BASELINE, ROOT)}")
        return 0
    base = {}
    if os.path.exists(BASELINE):
        for l in open(BASELINE):
            if l.strip() and not l.startswith("#"):
                key, n = l.rsplit(" ", 1)
                base[key] = int(n)
    bad = 0
    for k in sorted(found, key=lambda k: -found[k][0]):
        n, line = found[k]
        f, name = k.split(" ", 1)
        where = f"{f}:{line} {name}: {n} lines"
        if k not in base:
            print(f"check-functions: {where} (over {LIMIT}, not in the baseline)", file=sys.stderr)
            bad = 1
        elif n > base[k]:
            print(f"check-functions: {where} (grew past its baseline {base[k]})", file=sys.stderr)
            bad = 1
        else:
            print(f"  {where} (baseline {base[k]})")
    gone = sorted(set(base) - set(found))
    if gone:
        print(f"check-functions: {len(gone)} baseline entries are no longer over {LIMIT}: drop them "
              f"(tools/check-functions.py --baseline): " + "; ".join(gone), file=sys.stderr)
        bad = 1
    print(f"check-functions: {len(found)} functions in src/ over {LIMIT} lines ({len(base)} in the baseline)")
    return bad


if __name__ == "__main__":
    sys.exit(main())
