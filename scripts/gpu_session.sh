#!/usr/bin/env bash
# One 2-GPU (or larger) H100 / H200 lease, after the payload copies (PLATFORMS.md, "GPU vLLM on
# the device"; the last call carries .vllm_gpu/3 .whl, and .whl_trl build/csrc for PHASE=extra).
# One call per phase, each under 10 minutes, in this order:
#
#   PHASE=checks  installs vLLM / megatron-core (once per lease), then vLLM TP 2 of the
#                 Qwen3-MoE-shaped model with TP-sharded experts (no expert parallelism) and an
#                 EP 2 variant == TP 1 == the HF trainer, with the stock control (issue 43).
#   PHASE=bench   the TP 2 rollout benchmark ALONE on GPUs 0-1 (Llama-3-8B widths, stock vs
#                 plugin vs plugin + one-shot exchange, 3 alternating rounds; issue 44).
#   PHASE=extra   TRL's GRPOTrainer with colocated vLLM on GPU 0 (issue 46) beside the CUDA C++
#                 det_gemm tests + benchmark vs cuBLAS on GPU 1 (issue 47).
#   PHASE=kernels the MoE / poly_norm GPU op tests (every component required) on GPU 0 beside the
#                 MoE layer benchmark vs vLLM's fused_moe and the experts tile sweep on GPU 1.
#
# Four-GPU lease:
#   PHASE=bench4  the TP 4 rollout (stock vs plugin, Llama-3-8B widths, 3 rounds) alone.
#                 ROLLOUT_CONFIGS=rl_engine,rl_engine_oneshot: the NCCL vs one-shot exchange
#                 (issue 44's default decision); ROLLOUT_ARGS=--step-times: where a slow
#                 generate's time goes (also for PHASE=bench)
#   PHASE=tp4     vLLM TP 4 == TP 1 == HF (NCCL and one-shot exchange, stock control;
#                 T_JOB=560), MEGATRON=1 then Megatron TP 1 == 2 == 4.
#   PHASE=tests2 PART=all  the whole GPU suite, a quarter a GPU (6 workers each); PART=e1 then
#                 PART=e2: in eighths over two calls; PART=list SLICES="3:0 4:1": chosen
#                 eighths on chosen GPUs (what a cut-off call left).
#   PHASE=moe4    installs; vLLM TP 2 (TP-sharded experts) + the EP 2 variant + stock control on
#                 GPUs 0-1 (as checks) beside the Megatron MoE trainer TP 2 (ETP 2) == TP 1 with
#                 its control on GPUs 2-3, then the MoE layer benchmark on GPU 2 beside the GPU
#                 tests this session fixed (vLLM engine tests on CUDA vLLM, compile tests) on GPU 3.
#                 Give it T_JOB=560: the vLLM job starts four engines (420 s was too short on
#                 4 x H200, 2026-11-28).
#
# Two-GPU lease, one call each, in this order (the benchmarks alone on their GPUs):
#   PHASE=ep2     installs; vLLM TP 2 (TP-sharded experts) + the EP 2 variant == TP 1 == the HF
#                 trainer on GPUs 0-1 (CONTROL=1 adds the stock rollouts: two more engine starts;
#                 ONESHOT=1 a TP 2 rollout over the one-shot exchange: one more, ~90 s).
#   PHASE=moe_rollout  the Qwen3-MoE-shaped rollout, stock vs plugin, 3 alternating rounds, on
#                 GPU 0 beside, on GPU 1, the TP 1 cost of the grouped numerics (rl_engine vs
#                 rl_engine_g8, Llama-3-8B widths, 3 rounds) then the trainer MoE layer vs
#                 Megatron's own MoE and transformers' block.
#   PHASE=bench   (above) the TP 2 rollout.
#   PHASE=trainer_g8  the HF trainer step with / without the grouped numerics at TP 1 on GPU 0,
#                 the trainer MoE block (--quick) on GPU 1.
#   PHASE=g8_csrc the same HF trainer step on GPU 0 beside, on GPU 1, the CUDA C++ det_gemm tests,
#                 every tile configuration vs cuBLAS and the fitted choice (carry build/csrc).
#   PHASE=tests2  the GPU suite (REQUIRE vllm megatron liger) on both GPUs, in quarters over two calls:
#                 PART=1 then PART=2 (PYTEST_WORKERS: 6 a GPU); carry build/csrc too, or the
#                 CUDA C++ GPU tests skip.
#   PHASE=vtests  the vLLM engine tests only (test_vllm_moe.py on GPU 0; test_vllm_plugin.py and
#                 test_trainer_vs_vllm.py on GPU 1).
#
# One-GPU lease (a one-GPU machine counts half its held time), steps one after the other:
#   PHASE=solo_a  installs; the experts tile sweep at decode sizes (SWEEP_TS, default 1,4,16),
#                 then the CUDA C++ det_gemm tests + benchmark vs cuBLAS (carry build/csrc).
#   PHASE=solo_b  the GPU tests of tests/ops (REQUIRE vllm megatron liger: a skip for any fails),
#                 OPS_PART=1 then OPS_PART=2 (half of its files each: one call each).
#   PHASE=solo_c  the GPU tests of tests/invariance, tests/adapters and the drift monitor
#                 (REQUIRE as above), then TRL's GRPOTrainer (carry .whl_trl).
#
# Logs and JSON under $OUT; a short table last. T_JOB: seconds per job (default 540).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/_vllm_site.sh
. scripts/_vllm_site.sh
export PYTHONPATH="$ROOT:/tmp/vllm_site:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
names=()
job() {  # job NAME SECONDS GPUS CMD...: in the background, its log $OUT/NAME.log
  local name=$1 seconds=$2 gpus=$3
  shift 3
  names+=("$name")
  (CUDA_VISIBLE_DEVICES=$gpus timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1; echo $? > "$OUT/$name.rc") &
}
MOE_MODEL=/tmp/ep_qwen3_moe
make_moe_model() {
  [ -f $MOE_MODEL/config.json ] || $PY -c "from rl_engine.testing.tiny_models import make_tiny_model as m; m('$MOE_MODEL', arch='qwen3_moe', dtype='bfloat16', seed=0, initializer_range=0.02, num_hidden_layers=4, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, vocab_size=32768, max_position_embeddings=2048)"
}

install() {
  vllm_site_install || exit 3
  if [ ! -f /tmp/site/.rl_engine_ok ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.rl_engine_ok
  fi
}
T=${T_JOB:-540}
case ${PHASE:-checks} in
  checks)
    install
    make_moe_model || exit 2
    job vllm_etp2 "$T" 0,1 $PY -m rl_engine.harness.vllm_tp_check --model $MOE_MODEL --tp 2 \
      --control --variant ep2:enable_expert_parallel=True --json "$OUT/vllm_etp2.json"
    ;;
  bench)
    install
    job rollout_tp2 "$T" 0,1 $PY benchmarks/bench_rollout.py --model llama8b_width --tp 2 \
      --configs "${ROLLOUT_CONFIGS:-stock,rl_engine,rl_engine_oneshot}" --sizes 256 --new-tokens 256 --repeats 2 \
      --rounds 3 ${ROLLOUT_ARGS:-} --out "$OUT/bench"
    ;;
  extra)
    job trl "$T" 0 env OUT="$OUT/trl" bash scripts/gpu_trl.sh
    job csrc "$T" 1 env OUT="$OUT/csrc" bash scripts/gpu_csrc.sh
    ;;
  kernels)
    install
    job gpu_ops "$T" 0 $PY -m pytest -q -p no:logging --require vllm,megatron,liger \
      tests/ops/test_moe_experts_triton.py tests/ops/test_moe_triton.py tests/ops/test_moe.py \
      tests/ops/test_moe_experts_subtree_triton.py tests/ops/test_grouped_poly_norm_triton.py \
      tests/ops/test_poly_norm.py --junitxml "$OUT/gpu_ops.xml"
    job moe_bench "$T" 1 bash -c "$PY benchmarks/bench_moe.py --out '$OUT/bench' && $PY benchmarks/sweep_moe_experts.py --out '$OUT/bench'"
    ;;
  moe4)
    install
    make_moe_model || exit 2
    job vllm_etp2 "$T" 0,1 $PY -m rl_engine.harness.vllm_tp_check --model $MOE_MODEL --tp 2 \
      --control --variant ep2:enable_expert_parallel=True --json "$OUT/vllm_etp2.json"
    job megatron_tp2 "${T_MEGATRON:-300}" 2,3 $PY -m rl_engine.harness.ep_check --model $MOE_MODEL \
      --ep 1 --tp 2 --control --device cuda --dtype bfloat16
    wait "$!"
    job moe_bench "$((T - ${T_MEGATRON:-300}))" 2 $PY benchmarks/bench_moe.py --out "$OUT/bench"
    job fixed_tests "$((T - ${T_MEGATRON:-300}))" 3 bash -c "$PY -m pytest tests/ops -q -p no:logging \
      -n 8 -k 'compile or cat_equals' --require vllm,megatron,liger > '$OUT/ops_compile.log' 2>&1; \
      OUT='$OUT/t2' REQUIRE='vllm megatron liger' SKIP_FUZZ=1 SKIP_BENCH=1 PYTEST_WORKERS=4 \
      TESTS='tests/adapters/test_vllm_compat.py tests/adapters/test_vllm_plugin.py \
      tests/adapters/test_vllm_moe.py tests/adapters/test_trainer_vs_vllm.py' bash scripts/gpu_check.sh"
    ;;
  ep2)
    install
    make_moe_model || exit 2
    job vllm_ep2 "$T" 0,1 $PY -m rl_engine.harness.vllm_tp_check --model $MOE_MODEL --tp 2 \
      ${CONTROL:+--control} --variant ep2:enable_expert_parallel=True \
      ${ONESHOT:+--variant oneshot:RL_ENGINE_TP_ONESHOT=1} --json "$OUT/vllm_ep2.json"
    ;;
  moe_rollout)
    install
    job moe_rollout "$T" 0 $PY benchmarks/bench_rollout.py --model qwen3_moe --tp 1 \
      --configs stock,rl_engine --sizes 64,256 --new-tokens 256 --repeats 2 --rounds 3 \
      --out "$OUT/moe"
    job g8_train "$T" 1 bash -c "$PY benchmarks/bench_rollout.py --model llama8b_width --tp 1 \
      --configs rl_engine,rl_engine_g8 --sizes 256 --new-tokens 256 --repeats 2 --rounds 3 \
      --out '$OUT/g8'; $PY benchmarks/bench_moe_train.py --quick --out '$OUT/train'"
    ;;
  trainer_g8)
    # the trainer side of issue 44 item 3 (the HF step with the grouped numerics at TP 1 vs
    # without, and vs HF + SDPA / Liger) beside the trainer MoE block (T = 4096; its Megatron
    # baseline runs SequentialMLP on an image without TE / grouped_gemm: slow)
    install
    job trainer_g8 "$T" 0 $PY benchmarks/bench_trainer_hf.py --no-megatron \
      --rows hf_sdpa,rl_engine_hf,rl_engine_hf_g8,hf_liger --out "$OUT/trainer"
    job moe_train "$T" 1 $PY benchmarks/bench_moe_train.py --quick --out "$OUT/train"
    ;;
  g8_csrc)
    install
    job trainer_g8 "$T" 0 $PY benchmarks/bench_trainer_hf.py --no-megatron \
      --rows hf_sdpa,rl_engine_hf,rl_engine_hf_g8,hf_liger --out "$OUT/trainer"
    job csrc "$T" 1 env OUT="$OUT/csrc" BENCH_ARGS=--configs TEST_TIMEOUT=150 BENCH_TIMEOUT="$((T - 190))" \
      bash scripts/gpu_csrc.sh
    ;;
  tests2)
    # the GPU suite in quarters (round robin over its files, so each mixes op and engine tests):
    # PART=1 runs quarters 1 and 2, PART=2 quarters 3 and 4, one per GPU
    install
    all=$(ls tests/ops/test_*.py tests/invariance/test_*.py tests/adapters/test_*.py; echo tests/audit/test_drift_monitor.py)
    # slice S of N: every N-th file (round robin), so each slice mixes op and engine tests
    slice_of() { echo "$all" | awk -v s="$1" -v n="$2" 'NR % n == s % n' | tr '\n' ' '; }
    slice_job() {  # slice_job SLICE N GPU
      job "tests_${1}of$2" "$T" "$3" env OUT="$OUT/tests_${1}of$2" TESTS="$(slice_of "$1" "$2")" \
        PYTEST_WORKERS="${PYTEST_WORKERS:-6}" CPU_SHARE="$(nvidia-smi -L | wc -l)" \
        REQUIRE="vllm megatron liger" SKIP_FUZZ=1 SKIP_BENCH=1 \
        TEST_TIMEOUT="$((T - 45))" bash scripts/gpu_check.sh
    }
    case ${PART:-} in
      1) slice_job 1 4 0; slice_job 2 4 1 ;;
      2) slice_job 3 4 0; slice_job 4 4 1 ;;
      # four GPUs: a quarter a GPU, or eighths over two calls. Workers: 6 a GPU by default.
      # Earlier runs that did not fit (91% of a half on 2 x H200, 85-90% of a quarter on
      # 4 x H200) ran every worker with an intra-op thread per core: CPU_SHARE now divides the
      # cores (gpu_check.sh), and six eighths on 4 x H200 took 381 s in one call (2026-11-28)
      all) slice_job 1 4 0; slice_job 2 4 1; slice_job 3 4 2; slice_job 4 4 3 ;;
      e1) slice_job 1 8 0; slice_job 2 8 1; slice_job 3 8 2; slice_job 4 8 3 ;;
      e2) slice_job 5 8 0; slice_job 6 8 1; slice_job 7 8 2; slice_job 8 8 3 ;;
      # SLICES="S:GPU ...": chosen eighths, e.g. the ones a timed-out call left unfinished
      list) for sg in ${SLICES:?PART=list needs SLICES}; do slice_job "${sg%%:*}" 8 "${sg##*:}"; done ;;
      *) echo "PHASE=tests2 needs PART=1 or PART=2 (two GPUs), all, or e1 then e2 (four GPUs)"; exit 2 ;;
    esac
    ;;
  bench4)
    # the TP 4 rollout alone on the machine (Llama-3-8B widths, 3 alternating rounds; 6 engine
    # starts took 464 s on 4 x H100, 2026-11-28: the one-shot row does not fit in the same call)
    install
    job rollout_tp4 "$T" 0,1,2,3 $PY benchmarks/bench_rollout.py --model llama8b_width --tp 4 \
      --configs "${ROLLOUT_CONFIGS:-stock,rl_engine}" --sizes 256 --new-tokens 256 --repeats 2 \
      --rounds 3 ${ROLLOUT_ARGS:-} --out "$OUT/bench"
    ;;
  tp4)
    # vLLM TP 4 == TP 1 == the HF trainer on the current code, the NCCL exchange and the one-shot
    # exchange (variant), with the stock control: five engine starts (220 s was too short on
    # 4 x H200, 2026-11-28: give it T_JOB=560). MEGATRON=1: then Megatron TP 1 == 2 == 4 (NCCL)
    # with its control, 150 s a step (passed on 4 x H200, 2026-11-28)
    install
    if [ -n "${MEGATRON:-}" ]; then
      tp_vllm=$((T - 180)); tp_megatron="OUT='$OUT/tp' TP_DEGREES=1,2,4 TP_STEP_TIMEOUT=150 bash scripts/gpu_tp.sh"
    else
      tp_vllm=$((T - 10)); tp_megatron=true
    fi
    job vllm_tp4 "$T" 0,1,2,3 bash -c "OUT='$OUT/tp' TP_DEGREES=1,4 VLLM_TP=1 TP_STEP_TIMEOUT=$tp_vllm \
      VLLM_ARGS='--variant oneshot:RL_ENGINE_TP_ONESHOT=1' bash scripts/gpu_tp.sh; $tp_megatron"
    ;;
  vtests)
    # the vLLM engine tests against trainers on the engine's device: the MoE file on GPU 0, the
    # dense plugin file and trainers-vs-vLLM on GPU 1
    install
    job vtests_a "$T" 0 env OUT="$OUT/va" TESTS="tests/adapters/test_vllm_moe.py" \
      REQUIRE="vllm megatron liger" SKIP_FUZZ=1 SKIP_BENCH=1 TEST_TIMEOUT="$((T - 45))" bash scripts/gpu_check.sh
    job vtests_b "$T" 1 env OUT="$OUT/vb" \
      TESTS="tests/adapters/test_vllm_plugin.py tests/adapters/test_trainer_vs_vllm.py" \
      REQUIRE="vllm megatron liger" SKIP_FUZZ=1 SKIP_BENCH=1 TEST_TIMEOUT="$((T - 45))" bash scripts/gpu_check.sh
    ;;
  solo_a)
    install
    job sweep "${T_SWEEP:-170}" 0 $PY benchmarks/sweep_moe_experts.py --ts "${SWEEP_TS:-1,4,16}" \
      --out "$OUT/bench"
    wait
    job csrc "$((T - ${T_SWEEP:-170}))" 0 env OUT="$OUT/csrc" bash scripts/gpu_csrc.sh
    ;;
  solo_b)
    # tests/ops takes more than one 10-minute call on one H100 (96% in 540 s, 2026-11-28):
    # OPS_PART=1 / 2, the first / second half of its files, in two calls
    install
    files=$(ls tests/ops/test_*.py)
    n=$(echo "$files" | wc -l)
    if [ "${OPS_PART:-1}" = 1 ]; then part=$(echo "$files" | head -n $((n / 2))); else part=$(echo "$files" | tail -n $((n - n / 2))); fi
    job ops_tests "$T" 0 env OUT="$OUT/ops${OPS_PART:-1}" TESTS="$(echo $part)" REQUIRE="vllm megatron liger" \
      SKIP_FUZZ=1 SKIP_BENCH=1 TEST_TIMEOUT="$((T - 15))" bash scripts/gpu_check.sh
    ;;
  solo_c)
    install
    job rest_tests "${T_TESTS:-260}" 0 env OUT="$OUT/rest" REQUIRE="vllm megatron liger" SKIP_FUZZ=1 \
      SKIP_BENCH=1 TESTS="tests/invariance tests/adapters tests/audit/test_drift_monitor.py" \
      TEST_TIMEOUT="$((${T_TESTS:-260} - 15))" bash scripts/gpu_check.sh
    wait
    job trl "$((T - ${T_TESTS:-260}))" 0 env OUT="$OUT/trl" bash scripts/gpu_trl.sh
    ;;
  *) echo "PHASE=checks, bench, extra, kernels, moe4, ep2, moe_rollout, trainer_g8, g8_csrc, tests2, bench4, tp4, vtests, solo_a, solo_b or solo_c"; exit 2 ;;
esac
wait
# the device returns a limited number of files: the folders travel as one archive
dirs=$(find "$OUT" -mindepth 1 -maxdepth 1 -type d -printf '%f\n')
if [ -n "$dirs" ]; then
  # shellcheck disable=SC2086
  tar czf "$OUT/results.tgz" -C "$OUT" $dirs && (cd "$OUT" && rm -rf $dirs)
fi
for n in "${names[@]}"; do
  echo "== $n"
  grep -v "^INFO\|^WARNING\|^(EngineCore\|^\[W\|UserWarning\|warnings.warn" "$OUT/$n.log" | tail -12
done
echo
status=0
for n in "${names[@]}"; do
  r=$(cat "$OUT/$n.rc" 2>/dev/null || echo "?")
  printf '%-14s exit %s\n' "$n" "$r"
  [ "$r" = 0 ] || status=1
done
exit $status
