#!/usr/bin/env bash
# Checks the prose docs (README.md and docs/**/*.md, except docs/spec/ and docs/results/):
#  - at most 2,500 lines in all;
#  - no commit hash of this repository (result-file paths under results/ may name one);
#  - no issue references ("issue #N", "#NN").
# Prints the line count; exits 1 on any violation, naming the file and line.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
limit=2500
mapfile -t files < <({ echo README.md; find docs -name '*.md' -not -path 'docs/spec/*' -not -path 'docs/results/*'; } | sort)
fail=0
lines=$(cat "${files[@]}" | wc -l)
echo "check-docs: README.md + docs/ (without spec/, results/): ${lines} lines (limit ${limit})"
if [ "$lines" -gt "$limit" ]; then
  echo "check-docs: *** over the limit of ${limit} lines"; fail=1
fi
in_git=false
git rev-parse --git-dir >/dev/null 2>&1 && in_git=true
for f in "${files[@]}"; do
  # Paths into results/ carry the commit their run built; they are not prose.
  text=$(sed -E 's#[^][() `"]*results/[^][() `"]*##g' "$f")
  if $in_git; then
    while IFS=: read -r n word; do
      if git cat-file -e "${word}^{commit}" 2>/dev/null; then
        echo "$f:$n: names commit $word (measurement history belongs in docs/results/LOG.md or git)"; fail=1
      fi
    done < <(grep -noE '\b[0-9a-f]{7,40}\b' <<<"$text" | grep -E ':[0-9a-f]*[a-f][0-9a-f]*$|:[0-9]{7,}$' | sort -u)
  fi
  while IFS= read -r hit; do
    echo "$f:$hit: issue reference"; fail=1
  done < <(grep -noiE '(issue|pr|pull request)s? #?[0-9]+|(^|[^[:alnum:]&/#])#[0-9]+\b' <<<"$text")
done
[ "$fail" -eq 0 ] && echo "check-docs: ok"
exit "$fail"
