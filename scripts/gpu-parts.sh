#!/usr/bin/env bash
# Re-split the staged wheels of ../shared/gpu/prepare.sh (.gpu/p0, .gpu/p1, ...) into parts of
# at most SIZE (as `split -b` reads it; default 40M), so that one part plus this working tree stays under the
# device call's 64 MiB carry: prepare.sh's first part is 60 MiB, which a tree over 4 MiB
# (bench/results grows) pushes past the limit.  stage.sh takes any number of parts; carry
# .gpu/p0, .gpu/p1, ... one call each, as before.
# Usage: bash scripts/gpu-parts.sh [SIZE]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
size=${1:-40M}
cd "$root/.gpu"
ls p*/part.* >/dev/null 2>&1 || { echo "no staged parts under .gpu: run bash ../shared/gpu/prepare.sh first"; exit 1; }
stage=$(ls p*/stage.sh | head -n 1)
work=$(mktemp -d "$root/.gpu/resplit.XXXXXX")
cat $(ls p*/part.* | sort -t. -k2 -n) > "$work/all"
# Every part's count file holds the same number: read the first.  The shared script reads it
# with `cat .gpu/p*/count | head -1`, which under `set -o pipefail` fails with SIGPIPE (exit 141)
# when cat still writes after head has exited, so each copy reads the first file instead.
sed 's#^want=.*#want=$(cat "$(ls .gpu/p*/count | sort | sed -n 1p)")#' "$stage" > "$work/stage.sh"
(cd "$work" && split -b "$size" -d -a 2 all part. && rm all)
rm -rf p[0-9]*
count=$(ls "$work"/part.* | wc -l)
i=0
for part in $(ls "$work"/part.* | sort); do
    mkdir -p "p$i"
    mv "$part" "p$i/part.$(printf '%02d' "$i")"
    cp "$work/stage.sh" "p$i/stage.sh"
    echo "$count" > "p$i/count"
    i=$((i + 1))
done
rm -rf "$work"
echo "gpu wheels ready: $(ls -d p[0-9]* | sort -V | sed 's#^#.gpu/#' | tr '\n' ' ')"
