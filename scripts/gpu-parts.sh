#!/usr/bin/env bash
# Re-split the staged wheels of ../shared/gpu/prepare.sh (.gpu/p0, .gpu/p1, ..., or the folders of
# an earlier split under any names) into .gpu/p0, .gpu/p1, ... of at most SIZE (as `split -b`
# reads it; default 40M), so that one part plus this working tree stays under the device call's
# 64 MiB carry: prepare.sh's first part is 60 MiB, which a tree over 4 MiB
# (bench/results grows) pushes past the limit.  stage.sh takes any number of parts; carry
# .gpu/p0, .gpu/p1, ... one call each, as before.  Fewer parts are fewer calls: with the 21 MB
# tree of run 41, 38M gives three.
# Usage: bash scripts/gpu-parts.sh [SIZE]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
size=${1:-40M}
cd "$root/.gpu"
# Any folder of parts under .gpu (prepare.sh's p0, p1, ... or an earlier split's) is read, once.
folders=$(ls -d */ 2>/dev/null | sed 's#/$##' | while read -r f; do ls "$f"/part.* >/dev/null 2>&1 && echo "$f"; done)
[ -n "$folders" ] || { echo "no staged parts under .gpu: run bash ../shared/gpu/prepare.sh first"; exit 1; }
stage=$(for f in $folders; do echo "$f/stage.sh"; done | head -n 1)
want=$(cat "$(echo "$folders" | head -n 1)/count") have=$(for f in $folders; do ls "$f"/part.*; done | wc -l)
[ "$have" -eq "$want" ] || { echo "under .gpu: $have parts in $(echo $folders), one split holds $want; keep one split's folders"; exit 1; }
work=$(mktemp -d "$root/.gpu/resplit.XXXXXX")
cat $(for f in $folders; do ls "$f"/part.*; done | awk -F'part.' '{print $NF "\t" $0}' | sort -n | cut -f2) > "$work/all"
# Every part's count file holds the same number: read the first.  The shared script reads it
# with `cat .gpu/p*/count | head -1`, which under `set -o pipefail` fails with SIGPIPE (exit 141)
# when cat still writes after head has exited, so each copy reads the first file instead.
# The parts' glob is the new folders' (p*), whatever the old ones were called.
sed -e 's#^want=.*#want=$(cat "$(ls .gpu/p*/count | sort | sed -n 1p)")#' -e 's#\.gpu/[a-z]\*/part#.gpu/p*/part#' \
    "$stage" > "$work/stage.sh"
(cd "$work" && split -b "$size" -d -a 2 all part. && rm all)
rm -rf $folders
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
