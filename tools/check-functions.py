#!/usr/bin/env python3
"""Lists the functions in src/ (tests and testing/ helpers excepted) longer than 120 lines.

A function is a definition that opens at column 0 (namespace-level, as STYLE.md lays them out) or
at column 2 inside a class, and ends at the brace that closes it; its length counts from the first
line of its signature to that brace, lambdas and comments inside included.

  tools/check-functions.py     list the offenders, longest first; exit 1 if there is any

ctest runs it as tool.check_functions.
"""
import os
import re
import subprocess
import sys

LIMIT = 120
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    found = []
    for f in sources():
        for name, line, n in functions(f):
            if n > LIMIT:
                found.append((n, f"{f}:{line} {name}: {n} lines (over {LIMIT})"))
    for _, where in sorted(found, reverse=True):
        print(f"check-functions: {where}", file=sys.stderr)
    print(f"check-functions: {len(found)} functions in src/ over {LIMIT} lines")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
