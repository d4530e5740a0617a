#!/usr/bin/env bash
# The multi-process checks of the multi-rank engine, under mpirun (run by ctest when MPI was found):
#   run_checks.sh BIN [PART]    PART: train | reshard | async | kill | all (default)
#   - train:   1..4 ranks give bit-identical params (BIN train)
#   - reshard: a checkpoint saved by W ranks resumes bit-identically with every W' in 1..4
#   - async:   the same with asynchronous saves (a policy with async = true)
#   - kill:    20 times, SIGKILL of one random rank at a random point of a run that saves every
#              step; afterwards `latest` names a complete checkpoint that resumes bit-identically
#              with another world size, and no partial checkpoint is ever named; the crash leaves
#              at most one leftover (step-N.incomplete or .deleting), which the resumed run's first
#              save removes (ckpt/checkpoint_gc.h)
set -euo pipefail
bin=$1
part=${2:-all}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mpi() { local n=$1; shift; mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$n" "$@"; }
say() { echo "run_checks: $*"; }
# The crash leftovers of root $1: real directories named step-<digits>.incomplete or .deleting.
leftovers() { find "$1" -mindepth 1 -maxdepth 1 -type d -regextype posix-extended \
                -regex '.*/step-[0-9]+\.(incomplete|deleting)' | wc -l; }

if [[ $part == all || $part == train ]]; then
  for n in 1 2 3 4; do mpi "$n" "$bin" train; done
fi

reshard() {
  for w in 1 2 3 4; do
    mpi "$w" "$bin" save "$tmp/ck$w" 4 > /dev/null
    for w2 in 1 2 3 4; do mpi "$w2" "$bin" resume "$tmp/ck$w" 6; done
  done
}
if [[ $part == all || $part == reshard ]]; then reshard; fi
if [[ $part == all || $part == async ]]; then
  cat > "$tmp/async.lua" <<'LUA'
return {
  place = function(groups, ctx)
    local out = {}
    for i, g in ipairs(groups) do out[g.name] = (i % 2 == 0) and "cpu" or "gpu" end
    return out
  end,
  checkpoint = function(info, ctx) return { async = true, keep_last = 3 } end,
}
LUA
  export FERRY_CHECK_POLICY="$tmp/async.lua"
  rm -rf "$tmp"/ck*
  reshard
  unset FERRY_CHECK_POLICY
fi

if [[ $part == all || $part == kill ]]; then
  for i in $(seq 1 20); do
    w=$(( i % 3 + 2 ))            # 2..4 writers
    w2=$(( (i * 7) % 4 + 1 ))     # 1..4 readers
    root="$tmp/kill$i"
    log="$tmp/kill$i.log"
    mpi "$w" "$bin" save "$root" 100000 > "$log" 2>&1 &
    mp=$!
    # At least one checkpoint committed, then a random point of a later save (or step).
    until grep -q "^saved 1$" "$log"; do
      kill -0 "$mp" 2> /dev/null || { cat "$log"; say "kill $i: the run ended before its first save"; exit 1; }
      sleep 0.02
    done
    sleep "0.$(( RANDOM % 40 ))"
    ranks=($(pgrep -P "$mp" || true))
    [[ ${#ranks[@]} -gt 0 ]] || { cat "$log"; say "kill $i: no rank processes under mpirun"; exit 1; }
    victim=${ranks[$(( RANDOM % ${#ranks[@]} ))]}
    kill -9 "$victim" 2> /dev/null || true
    wait "$mp" && { say "kill $i: the run survived the SIGKILL?"; exit 1; } || true
    # mpirun may return before every rank of the job is gone (rank 0 may still be committing a
    # checkpoint the victim already wrote its file for): wait for the whole job.
    for _ in $(seq 1 300); do pgrep -f "$bin save $root " > /dev/null || break; sleep 0.1; done
    pkill -9 -f "$bin save $root " 2> /dev/null || true
    latest=$(cat "$root/latest")
    [[ -d "$root/$latest" && -f "$root/$latest/manifest.json" ]] || { say "kill $i: latest '$latest' is not complete"; exit 1; }
    before=$(leftovers "$root")
    [[ $before -le 1 ]] || { ls -la "$root"; say "kill $i: $before leftovers after one kill"; exit 1; }
    mpi "$w2" "$bin" resume "$root" 0 save
    after=$(leftovers "$root")
    [[ $after -eq 0 ]] || { ls -la "$root"; say "kill $i: $after leftovers after the next save"; exit 1; }
    say "kill $i: killed one of $w ranks mid-run; $latest (complete) resumed bit-identically with $w2 ranks;" \
        "leftovers: $before after the kill, $after after the next save"
  done
fi
say "all passed ($part)"
