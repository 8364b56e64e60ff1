#!/usr/bin/env bash
# The headline benchmarks in one prepared run, for a lent GPU machine (the `device` tool's `run`):
#
#     bash benchmarks/device_run.sh          # with timeout_s=560; results come back under $OUT
#
# It uses that machine's own python3, whose image already holds jax (CUDA), flax, optax, chex,
# orbax, matplotlib, rich and scikit-learn (nothing can be installed there), and imports jaxsane
# from this checkout through PYTHONPATH. Each benchmark has its own time limit, so one that hangs
# cannot eat the others' time. QUICK=1 runs tiny settings (to check the script on a CPU box:
# `PY=.venv/bin/python QUICK=1 bash benchmarks/device_run.sh`). LADDER=1 runs only the doctor-at-scale
# ladder (benchmarks/doctor_scaling.py), the compile log of one rung (benchmarks/doctor_compiles.py) and then the
# overfit sweep's timings, a run of its own within the same
# limit (RUNGS="lm_1m" and DEADLINE=SECONDS narrow it; on a CPU box: `PY=.venv/bin/python LADDER=1
# RUNGS=cnn_small DEADLINE=200 bash benchmarks/device_run.sh`).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PY:-python3}"
OUT="${OUT:-/tmp/jaxsane-device-run}"
mkdir -p "$OUT"

run() {  # run NAME SECONDS SCRIPT ARGS...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$PY" -W ignore "$@" 2>&1 | tee "$OUT/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]}"
}

"$PY" -c "import jax, jaxsane; print(jax.__version__, jax.default_backend(), jax.devices())" 2>&1 | tee "$OUT/devices.txt"
if [ "${LADDER:-0}" = 1 ]; then  # doctor at scale: a run of its own (LADDER=1 bash benchmarks/device_run.sh)
    # A smoke doctor run first: if jaxsane cannot run on that machine's jax, stop at once and keep the lease's
    # time for a second try. Then the rungs one by one, each its own process tree and JSON, inside a deadline
    # (DEADLINE seconds from the start), so a slow rung cannot cost the table; the sweep benchmark if time is left.
    deadline=${DEADLINE:-530}
    log="$OUT/ladder.txt"
    cat "$OUT/devices.txt" >"$log" && rm "$OUT/devices.txt"
    echo "== smoke: jaxsane doctor on the bundled example" | tee -a "$log"
    timeout 150 "$PY" -W ignore -m jaxsane.cli doctor 2>&1 | tail -40 | tee -a "$log"
    status=${PIPESTATUS[0]}
    echo "== smoke: exit $status after ${SECONDS}s" | tee -a "$log"
    [ "$status" -le 1 ] || exit 3
    for rung in ${RUNGS:-lm_1m cnn_small cnn_large lm_10m lm_50m}; do
        left=$((deadline - SECONDS))
        [ "$left" -gt 30 ] || { echo "== $rung: skipped, ${left}s left" | tee -a "$log"; continue; }
        echo "== $rung (limit ${left}s)" | tee -a "$log"
        timeout "$left" "$PY" -W ignore benchmarks/doctor_scaling.py --rungs "$rung" --json "$OUT/ladder_$rung.json" 2>&1 \
            | tee -a "$log"
    done
    left=$((deadline - SECONDS))  # which programs doctor compiles on this machine, by thread (one rung)
    if [ "$left" -gt 90 ]; then
        echo "== doctor_compiles ${COMPILES_RUNG:-lm_1m} (limit ${left}s)" | tee -a "$log"
        timeout "$left" "$PY" -W ignore benchmarks/doctor_compiles.py "benchmarks/programs/scaling.py:${COMPILES_RUNG:-lm_1m}" \
            --top 15 2>&1 | tee -a "$log"
    fi
    for steps in 200 2000; do
        left=$((deadline - SECONDS))
        [ "$left" -gt 40 ] || break
        echo "== overfit_sweep --steps $steps (limit ${left}s)" | tee -a "$log"
        timeout "$left" "$PY" -W ignore benchmarks/overfit_sweep.py --reps 3 --steps "$steps" 2>&1 | tee -a "$log"
    done
    echo "== done after ${SECONDS}s" | tee -a "$log"
elif [ "${QUICK:-0}" = 1 ]; then
    run overfit_sweep 120 benchmarks/overfit_sweep.py --reps 1 --steps 200
    run guard_overhead 120 benchmarks/guard_overhead.py --steps 10
    run monitor_overhead 120 benchmarks/monitor_overhead.py --only mlp --rounds 2 --steps 10
    run nan_localization 180 benchmarks/nan_localization.py --skip-mlp --only log_of_zero_plain where_sqrt_trap_jit
else
    run overfit_sweep 200 benchmarks/overfit_sweep.py --reps 3
    run guard_overhead 120 benchmarks/guard_overhead.py --steps 150
    run monitor_overhead 90 benchmarks/monitor_overhead.py --only mlp --rounds 7 --steps 20
    run nan_localization 120 benchmarks/nan_localization.py
fi
