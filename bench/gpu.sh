#!/usr/bin/env bash
# The one command a bare GPU machine runs, from the repository root: the punica kernel tests on
# CUDA, then the engine and kernel benchmarks on synthetic checkpoints (no model hub there).
#
# Before it, here: `bash bench/device_wheels.sh` (the wheels the machine lacks, into .whl/).
# The device call:  command `bash bench/gpu.sh`, carry [".whl"]  (.whl/ is ignored by git, so it
# travels only when the call names it). Results land in $OUT (at most 8 files come back):
#   env.txt                nvidia-smi, Python, torch, triton, the GPU torch sees
#   steps.log              each step's command, exit code, seconds, and its stderr's last lines
#   pytest.log             TRITON_INTERPRET=0 python -m pytest -q tests/punica_kernels (CUDA cases)
#   pytest_engine.log      the same for the engine's kernels (W4A16, W8A16, attention, norms, gated
#                          input, slot loads)
#   parity.log             the engine on the Triton backend on the GPU vs the CPU backend and transformers,
#                          and no Triton compile while serving after the start-up warm-up
#   kernels.json           bench/kernels.py --device cuda --quick (JSON lines: BGMV, SGMV)
#   engine_smollm2.json    bench/engine.py on a synthetic SmolLM2-135M (+ transformers on CUDA)
#   multi_lora.json        bench/multi_lora.py on the same (+ PEFT on CUDA)
#   engine_llama3_8b.json  bench/engine.py on a synthetic Llama-3-8B (modest concurrency, no peer)
#   multi_lora_llama3_8b.json  bench/multi_lora.py --requests 64 on the synthetic Llama-3-8B (4-bit)
#   engine_llama3_1_8b.json    bench/engine.py on a synthetic Llama-3.1-8B (llama3 RoPE scaling, 4-bit)
#   engine_qwen2_5_7b.json     bench/engine.py on a synthetic Qwen2.5-7B (q/k/v biases, 28/4 heads, 4-bit)
#   quant_kernels.json     bench/kernels.py --device cuda --only quant (JSON lines: every quantized
#                          checkpoint format's linears at Llama-3.1-8B shapes, M 1/4/16/64, vs dense bf16)
#   engine_llama3_1_8b_q4_k_m.json  bench/engine.py on a synthetic Llama-3.1-8B in llama.cpp's Q4_K_M mix
#   startup_smollm2.json, startup_llama3_1_8b.json  bench/engine.py --startup-warmup on: the engine's
#                          start-up warm-up (seconds, graphs, forwards, Triton compiles during it and after)
#   overlap_smollm2.json, overlap_llama3_1_8b.json  bench/engine.py --overlap-steps both: tok/s with
#                          steps resolved one at a time and overlapped, one engine after the other
# The synthetic checkpoints are written here by the script itself, to /tmp/synthetic (the
# machine's local disk), with `python -m engine.loader.synthetic` (--shape for the Llama GGUF
# shapes, --family for the model families: Q4_0 layers, Q8_0 embeddings, the family's metadata
# and tokenizer as llama.cpp writes them); gguf, which writes and reads them, is a carried wheel.
# All steps do not fit one 10-minute call (nor do their files: at most 8 come back, env.txt,
# steps.log and pytest.log among them): STEPS_ONLY="name ..." runs only the named steps, e.g.
#   STEPS_ONLY="pytest pytest_engine parity" bash bench/gpu.sh              (150 + 150 + 200 s)
#   STEPS_ONLY="synthetic_smollm2 kernels engine_smollm2 multi_lora startup_smollm2" bash bench/gpu.sh
#   STEPS_ONLY="synthetic_llama3_8b engine_llama3_8b multi_lora_llama3_8b" bash bench/gpu.sh
#   STEPS_ONLY="synthetic_llama3_1_8b engine_llama3_1_8b synthetic_qwen2_5_7b engine_qwen2_5_7b" bash bench/gpu.sh
#   STEPS_ONLY="quant_kernels synthetic_llama3_1_8b_q4_k_m engine_llama3_1_8b_q4_k_m" bash bench/gpu.sh
#   STEPS_ONLY="synthetic_smollm2 startup_smollm2 synthetic_llama3_1_8b startup_llama3_1_8b" bash bench/gpu.sh
#   STEPS_ONLY="synthetic_smollm2 overlap_smollm2 synthetic_llama3_1_8b overlap_llama3_1_8b" bash bench/gpu.sh
#                                                                           (60 + 120 + 90 + 240 s)
# (the last: the Q4_K_M writer runs on the host in the background while quant_kernels uses the
# GPU, overlapping its 150 s within its own 420 s; the engine gets what remains of TOTAL_S, up to 240 s).
# A failing or timed-out step is logged and the next one runs; the whole script stays within
# TOTAL_S seconds (default 530, inside the device's 10-minute command limit): each step gets its
# own budget, cut to what is left. ENGINE_FORMAT (default w4a16: 4-bit weights) is the --formats/--format given to
# the engine benchmarks; BACKEND (default triton) their --backend.
set -u
cd "$(dirname "$0")/.."

OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
TOTAL_S="${TOTAL_S:-530}"
ENGINE_FORMAT="${ENGINE_FORMAT:-w4a16}"
BACKEND="${BACKEND:-triton}"
START=$(date +%s)
STEPS="$OUT/steps.log"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the benchmarks run the kernels compiled for the GPU
: >"$STEPS"

log() { echo "$(date -u +%H:%M:%S) $*" >>"$STEPS"; }

# budget_for NAME BUDGET_S: prints the seconds step NAME may run (BUDGET_S, cut to what is left
# of TOTAL_S), or nothing when it does not run (not in STEPS_ONLY, or under 10 s left; logged).
budget_for() {
  local name=$1 budget=$2
  if [[ -n ${STEPS_ONLY:-} && " $STEPS_ONLY " != *" $name "* ]]; then
    log "== $name: not in STEPS_ONLY"
    return
  fi
  local left=$((START + TOTAL_S - $(date +%s)))
  if ((left < 10)); then
    log "== $name: skipped, ${left}s left of ${TOTAL_S}s"
    return
  fi
  ((budget > left)) && budget=$left
  echo "$budget"
}

# step_done NAME RC T0 ERR OUT: logs a finished step's exit code, time and stderr's tail (and its
# stdout when that went to OUT under /tmp, i.e. the step's STDOUT_FILE was "-").
step_done() {
  local name=$1 rc=$2 t0=$3 err=$4 out=$5
  ((rc == 124 || rc == 137)) && log "   $name timed out"
  log "   $name rc=$rc in $(($(date +%s) - t0))s; stderr's last lines:"
  tail -n 25 "$err" | sed 's/^/   | /' >>"$STEPS"
  [[ $out == /tmp/gpu_* ]] && sed 's/^/   > /' "$out" >>"$STEPS"
  return 0
}

# step NAME BUDGET_S STDOUT_FILE CMD...: runs CMD with stdout to STDOUT_FILE ("-": into
# steps.log), at most BUDGET_S seconds (or what is left of TOTAL_S); records the exit code, the
# time, and the stderr's tail.
step() {
  local name=$1 budget=$2 out=$3
  shift 3
  budget=$(budget_for "$name" "$budget")
  [[ -z $budget ]] && return 0
  [[ $out == - ]] && out=/tmp/gpu_step.out
  log "== $name (budget ${budget}s): $*"
  local t0=$(date +%s) rc
  timeout --kill-after=10 "$budget" "$@" >"$out" 2>/tmp/gpu_step.err
  rc=$?
  step_done "$name" "$rc" "$t0" /tmp/gpu_step.err "$out"
}

# bg_step NAME BUDGET_S STDOUT_FILE CMD...: step's rules, but CMD runs in the background (a
# host-only step, such as writing a checkpoint, beside a GPU step); bg_wait NAME waits for it and
# logs it as step does. A step not started (not selected, no time left) is not waited for.
declare -A BG_PID BG_T0 BG_OUT
bg_step() {
  local name=$1 budget=$2 out=$3
  shift 3
  budget=$(budget_for "$name" "$budget")
  [[ -z $budget ]] && return 0
  [[ $out == - ]] && out="/tmp/gpu_bg_$name.out"
  log "== $name (background, budget ${budget}s): $*"
  BG_T0[$name]=$(date +%s)
  BG_OUT[$name]=$out
  timeout --kill-after=10 "$budget" "$@" >"$out" 2>"/tmp/gpu_bg_$name.err" &
  BG_PID[$name]=$!
}
bg_wait() {
  local name=$1 rc
  [[ -z ${BG_PID[$name]:-} ]] && return 0
  wait "${BG_PID[$name]}"
  rc=$?
  step_done "$name" "$rc" "${BG_T0[$name]}" "/tmp/gpu_bg_$name.err" "${BG_OUT[$name]}"
  unset "BG_PID[$name]"
}

# The carried wheels (bench/device_wheels.sh), installed beside the image's packages.
if ls .whl/*.whl >/dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >>"$STEPS" 2>&1; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    log "wheels installed: $(ls .whl | tr '\n' ' ')"
  else
    log "wheel install FAILED (continuing without them)"
  fi
else
  log "no .whl/*.whl: run bench/device_wheels.sh here and name .whl in the call's carry"
fi

{
  echo "## date"; date -u
  echo "## nvidia-smi"; nvidia-smi 2>&1
  echo "## python"; "$PY" -V 2>&1; command -v "$PY"
  echo "## packages"
  "$PY" - <<'EOF' 2>&1
import importlib
for name in ("torch", "triton", "numpy", "safetensors", "tokenizers", "jinja2", "transformers", "peft", "gguf",
             "pydantic", "prometheus_client", "pytest", "hypothesis"):
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')} {getattr(m, '__file__', '')}")
    except Exception as e:
        print(f"{name} MISSING ({type(e).__name__}: {e})")
import torch
print("cuda available:", torch.cuda.is_available(), "| torch cuda:", torch.version.cuda)
if torch.cuda.is_available():
    print("device:", torch.cuda.get_device_name(), "| capability:", torch.cuda.get_device_capability())
EOF
  echo "## imports the benchmarks need"
  "$PY" -c "import engine.llm_engine, engine.loader.synthetic, punica_kernels, bench.common; print('ok')" 2>&1
  echo "## cpu"; nproc; grep -m1 "model name" /proc/cpuinfo
} >"$OUT/env.txt" 2>&1
log "env.txt written"

# The kernel tests on CUDA tensors: TRITON_INTERPRET=0 builds the kernels for the GPU (one process
# runs one of the two; the CPU-tensor cases skip here, CI runs them under the interpreter; see
# tests/conftest.py's `device` fixture). Third-party pytest plugins of the image are not loaded: they
# may not match the carried pytest.
# Two steps, each with its own budget: on a cold Triton cache every variant compiles here (the
# punica kernels alone took 143 s of a 150 s budget in session 14, before the grouped kernels).
step pytest 150 "$OUT/pytest.log" \
  env TRITON_INTERPRET=0 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -q -rfEs -p no:cacheprovider \
  tests/punica_kernels
cat /tmp/gpu_step.err >>"$OUT/pytest.log" 2>/dev/null
step pytest_engine 150 "$OUT/pytest_engine.log" \
  env TRITON_INTERPRET=0 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -q -rfEs -p no:cacheprovider \
  tests/engine/test_w4a16.py tests/engine/test_w8a16.py tests/engine/test_paged_attention.py \
  tests/engine/test_fused_norms.py tests/engine/test_gated_linear.py tests/engine/test_lora_slot_loads.py
cat /tmp/gpu_step.err >>"$OUT/pytest_engine.log" 2>/dev/null

# The whole engine on the Triton backend, compiled for the GPU, against the CPU backend (a mixed
# adapter batch that prefills in chunks and preempts) and against transformers (every family);
# and the start-up warm-up: every decode graph captured when the engine is built, and no Triton
# compile while serving a mixed workload after it (counted through the JIT's compile hook).
step parity 200 "$OUT/parity.log" \
  env TRITON_INTERPRET=0 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -q -rfEs -p no:cacheprovider \
  tests/engine/test_backend_parity.py "tests/engine/test_families.py::test_family_matches_transformers" \
  tests/engine/test_startup_warmup.py
cat /tmp/gpu_step.err >>"$OUT/parity.log" 2>/dev/null

step synthetic_smollm2 60 - "$PY" -m engine.loader.synthetic --shape smollm2 --out /tmp/synthetic/smollm2.gguf
step synthetic_llama3_8b 90 - "$PY" -m engine.loader.synthetic --shape llama3-8b --out /tmp/synthetic/llama3-8b.gguf
step synthetic_llama3_1_8b 90 - "$PY" -m engine.loader.synthetic --family llama3.1-8b --format gguf --quant q4_0 \
  --out /tmp/synthetic/llama3.1-8b.gguf
step synthetic_qwen2_5_7b 90 - "$PY" -m engine.loader.synthetic --family qwen2.5-7b --format gguf --quant q4_0 \
  --out /tmp/synthetic/qwen2.5-7b.gguf

step kernels 75 "$OUT/kernels.json" "$PY" bench/kernels.py --device cuda --quick

# The benchmarks below build their engines without the start-up warm-up (each warms up the widths
# it measures itself), to stay inside budgets set before the warm-up existed; its own cost and the
# compiles it saves are the startup_* steps'.
step engine_smollm2 120 "$OUT/engine_smollm2.json" "$PY" bench/engine.py --model /tmp/synthetic/smollm2.gguf \
  --backend "$BACKEND" --device cuda --formats "$ENGINE_FORMAT,bf16" --concurrency 1,8,32 --startup-warmup off

step multi_lora 100 "$OUT/multi_lora.json" "$PY" bench/multi_lora.py --model /tmp/synthetic/smollm2.gguf \
  --backend "$BACKEND" --device cuda --format "$ENGINE_FORMAT" --rounds 3 --startup-warmup off

# The start-up warm-up on the SmolLM2 shape: its seconds, graphs and forwards, the Triton compiles
# during it, and those after it while the benchmark serves (0 is the goal: none a request waits for).
step startup_smollm2 120 "$OUT/startup_smollm2.json" "$PY" bench/engine.py --model /tmp/synthetic/smollm2.gguf \
  --backend "$BACKEND" --device cuda --formats "$ENGINE_FORMAT" --concurrency 1,8 --new-tokens 16 --skip-hf \
  --startup-warmup on

# The 8B loads come last; each gets whatever time is left, up to its budget.
step engine_llama3_8b 240 "$OUT/engine_llama3_8b.json" "$PY" bench/engine.py --model /tmp/synthetic/llama3-8b.gguf \
  --backend "$BACKEND" --device cuda --formats "$ENGINE_FORMAT" --concurrency 1,8 --new-tokens 32 \
  --kv-cache-mb 1024 --skip-hf --startup-warmup off

# Issue 21's multi-LoRA figure: 64 concurrent requests with 64 distinct rank-16 adapters on the
# 4-bit Llama-3-8B shape, against the same run without adapters.
step multi_lora_llama3_8b 300 "$OUT/multi_lora_llama3_8b.json" "$PY" bench/multi_lora.py \
  --model /tmp/synthetic/llama3-8b.gguf --backend "$BACKEND" --device cuda --format "$ENGINE_FORMAT" \
  --requests 64 --new-tokens 32 --rounds 2 --skip-peft --kv-cache-mb 2048 --startup-warmup off

# The model families at real shapes, as engine_llama3_8b runs Llama-3-8B's: Llama-3.1-8B (the same
# matmuls, llama3-scaled RoPE tables) and Qwen2.5-7B (q/k/v biases, 7 query heads per KV head,
# 152064 ids).
step engine_llama3_1_8b 240 "$OUT/engine_llama3_1_8b.json" "$PY" bench/engine.py \
  --model /tmp/synthetic/llama3.1-8b.gguf --backend "$BACKEND" --device cuda --formats "$ENGINE_FORMAT" \
  --concurrency 1,8 --new-tokens 32 --kv-cache-mb 1024 --skip-hf --startup-warmup off
step engine_qwen2_5_7b 240 "$OUT/engine_qwen2_5_7b.json" "$PY" bench/engine.py \
  --model /tmp/synthetic/qwen2.5-7b.gguf --backend "$BACKEND" --device cuda --formats "$ENGINE_FORMAT" \
  --concurrency 1,8 --new-tokens 32 --kv-cache-mb 1024 --skip-hf --startup-warmup off
# The start-up warm-up at Llama-3.1-8B's shapes (as startup_smollm2): run it alone in a call, its
# time there is not known yet.
step startup_llama3_1_8b 300 "$OUT/startup_llama3_1_8b.json" "$PY" bench/engine.py \
  --model /tmp/synthetic/llama3.1-8b.gguf --backend "$BACKEND" --device cuda --formats "$ENGINE_FORMAT" \
  --concurrency 1,8 --new-tokens 16 --kv-cache-mb 1024 --skip-hf --startup-warmup on

# Overlapped steps (issue 35): the same engine with each step resolved before the next is
# scheduled, then with the next launched first (EngineConfig.overlap_steps), in one run: SmolLM2's
# shape, where the host's share of a step is largest, and Llama-3.1-8B's. Neither has run on a GPU
# yet; the budgets are estimates from engine_smollm2 / engine_llama3_1_8b.
step overlap_smollm2 120 "$OUT/overlap_smollm2.json" "$PY" bench/engine.py --model /tmp/synthetic/smollm2.gguf \
  --backend "$BACKEND" --device cuda --formats "$ENGINE_FORMAT" --concurrency 1,8,32 --new-tokens 32 --skip-hf \
  --startup-warmup off --overlap-steps both
step overlap_llama3_1_8b 240 "$OUT/overlap_llama3_1_8b.json" "$PY" bench/engine.py \
  --model /tmp/synthetic/llama3.1-8b.gguf --backend "$BACKEND" --device cuda --formats "$ENGINE_FORMAT" \
  --concurrency 1,8 --new-tokens 16 --kv-cache-mb 1024 --skip-hf --startup-warmup off --overlap-steps both

# Issue 34: the quantized checkpoint formats. First every format's linears at Llama-3.1-8B's
# shapes (bench/kernels.py --only quant: W4A16Linear / W8A16Linear on random codes, dense bf16
# beside them), while the host writes a Q4_K_M Llama-3.1-8B (llama.cpp's mix: Q4_K layers on the
# 4-bit kernels, Q6_K attn_v / ffn_down on the 8-bit ones, a Q4_K embedding, a Q6_K lm_head). The
# writer quantizes every one of the 8.0B weights with numpy on one core, minutes of host work that
# needs no GPU, so it runs in the background beside the GPU step; then the engine runs the file at
# batch 1 and 8. Budgets: the writer's 420 s spans quant_kernels' 150 s, leaving the engine what
# remains of TOTAL_S (up to its 240 s).
bg_step synthetic_llama3_1_8b_q4_k_m 420 - "$PY" -m engine.loader.synthetic --family llama3.1-8b --format gguf \
  --quant q4_k_m --out /tmp/synthetic/llama3.1-8b.q4_k_m.gguf
step quant_kernels 150 "$OUT/quant_kernels.json" "$PY" bench/kernels.py --device cuda --only quant
bg_wait synthetic_llama3_1_8b_q4_k_m
step engine_llama3_1_8b_q4_k_m 240 "$OUT/engine_llama3_1_8b_q4_k_m.json" "$PY" bench/engine.py \
  --model /tmp/synthetic/llama3.1-8b.q4_k_m.gguf --backend "$BACKEND" --device cuda --formats "$ENGINE_FORMAT" \
  --concurrency 1,8 --new-tokens 32 --kv-cache-mb 1024 --skip-hf --startup-warmup off

log "done in $(($(date +%s) - START))s"
cat "$STEPS"
