# Sourced by scripts/gpu_check.sh and scripts/gpu_vllm.sh.
#
# run_group SECONDS LOG CMD...: run CMD under `timeout SECONDS` as a background job in a process
# group of its own (job control on; `timeout` leads the group, whose id is the job's PID), its
# output to LOG and followed on stdout; returns CMD's exit status (124 on timeout). Afterwards the
# whole group is stopped (TERM, then KILL): what a timed-out step leaves behind (pytest-xdist
# workers, an audit's vLLM worker holding the GPU) must not share the machine with the next step,
# and nobody else's processes on a shared node are touched. RUN_GROUP_SIGNAL=INT: the timeout
# interrupts first (pytest then prints its summary: counts, failures, skip reasons) and kills 20 s
# later.
run_group() {
  local seconds=$1 log=$2 pid rc sig
  shift 2
  : > "$log"
  set -m
  timeout ${RUN_GROUP_SIGNAL:+-s "$RUN_GROUP_SIGNAL" -k 20} "$seconds" "$@" > "$log" 2>&1 &
  pid=$!
  set +m
  tail -n +1 -f --pid="$pid" "$log" &
  wait "$pid"
  rc=$?
  wait
  for sig in TERM KILL; do
    kill -"$sig" -- "-$pid" 2>/dev/null
    sleep 1
  done
  return "$rc"
}
