#!/usr/bin/env bash
# Is the test run trustworthy? Clone the committed main into a fresh folder and run CI there
# (`.ci/run`: a new venv, the install, the cold book build, every test) several times in a row,
# optionally with CPU-bound processes spinning beside it, as on a busy laptop or a shared CI machine.
#
#   bench/ci_repeat.sh [RUNS] [SPINNERS]      e.g. bench/ci_repeat.sh 3 0; bench/ci_repeat.sh 2 2
#
# Prints one line per run (pass/fail, wall time, the test counts pytest reported) and keeps each
# run's log in the clone's folder, named at the end. Exit status: the number of failed runs.
set -uo pipefail

runs=${1:-3}
spinners=${2:-0}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/ci-repeat-XXXXXX")
spinner_pids=()

stop_spinners() {
    for pid in "${spinner_pids[@]}"; do kill "$pid" 2>/dev/null; done
    spinner_pids=()
}
trap 'stop_spinners; echo "logs kept in $work"' EXIT
trap 'exit 130' INT TERM

failed=0
for run in $(seq 1 "$runs"); do
    clone="$work/run$run"
    git clone --quiet --branch main "$repo" "$clone"
    for _ in $(seq 1 "$spinners"); do
        python3 -c 'while True: pass' &
        spinner_pids+=($!)
    done
    started=$(date +%s)
    (cd "$clone" && CI=true bash .ci/run) > "$clone.log" 2>&1
    status=$?
    seconds=$(( $(date +%s) - started ))
    stop_spinners
    counts=$(grep -E '^=+ .*(passed|failed).* in ' "$clone.log" | sed -E 's/^=+ (.*) in .*/\1/' | paste -sd ';' -)
    if [ "$status" -eq 0 ]; then verdict=PASS; else verdict=FAIL; failed=$((failed + 1)); fi
    printf 'run %d/%d  %s  %dm%02ds  spinners %d  tests: %s\n' "$run" "$runs" "$verdict" \
        $((seconds / 60)) $((seconds % 60)) "$spinners" "${counts:-none reported}"
    if [ "$status" -ne 0 ]; then
        grep -E '^(FAILED|ERROR) ' "$clone.log" | head -20
    fi
    rm -rf "$clone"  # its venv alone is several GB; the log stays
done
exit "$failed"
