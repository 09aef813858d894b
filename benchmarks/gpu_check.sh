#!/usr/bin/env bash
# The checks that need a GPU, in one short run on a CUDA machine (its own python with a CUDA build of
# torch; trainguard from this tree, not installed). Each part has its own time limit and log, so one
# failing part does not hide the others. Logs go to $1 (default ./gpu-check).
#
#   bash benchmarks/gpu_check.sh [LOG_DIR] [PARTS...]
#       PARTS: env tests doctor nostall-gpu nostall-cpu trace nostall-ab profile hf hf-save hf-probe titan-probe titan
#
# What each part is: env (the device, torch, /dev/shm); tests (every test that needs CUDA);
# doctor (`trainguard doctor`: burn-in on the GPU, NCCL collectives, storage);
# nostall-gpu (benchmarks/nostall.py on the GPU: one NCCL rank, pinned staging, llama-60m);
# nostall-cpu (the same benchmark on this machine's CPU cores, 2 gloo ranks: a host with free cores);
# trace (nostall.py --only trace: where a memory-tier step's and a durable save's wall time goes, torch
# profiler traces and the writer's cProfile, packed into LOG_DIR/trace.tar.gz); nostall-ab (the
# throughput figure for the source tree BASE_SRC, then for this one, one after the other; CYCLES and
# AB_ARGS, nostall.py's --cycles and further arguments, default 1 and "--durable-every 10 auto");
# profile (nostall.py's CPU profile of a durable save and a memory-tier step on the GPU);
# hf (GuardedTrainer with FSDP2 through accelerate on one GPU: examples/hf_trainer.py --fsdp SIGKILLed
# under trainguard run resumes bitwise, tests/integration/test_hf_trainer_fsdp.py);
# hf-save (benchmarks/hf_trainer_save.py on this machine's disk: the adapter's save against a plain
# Trainer save, at its default 8.1 M parameters and at 64 M);
# hf-probe (benchmarks/hf_fsdp_probe.sh: FSDP2 through accelerate comes up under GuardedTrainer on one
# GPU, with a save and a resume, in under a minute). The hf parts are not in the default parts.
# titan-probe (the wheels in .whl/ installed, examples/torchtitan_trainer.py --probe: torchtitan.train and
# GuardedTrainer import with this torch; then 3 steps of the example); titan (torchtitan's own Trainer on
# Guard on 1 GPU: killed, resumed, bitwise: tests/integration/test_torchtitan_trainer.py).
# Every RESULT line the parts print is also appended to LOG_DIR/results.jsonl (one JSON object a line).
#
# The packages this image lacks (torchtitan and its dependencies, never torch or triton) come as wheels in
# .whl/ beside this tree (docs/library.md lists them); they are installed into /tmp/titan-site, on the
# titan parts' PYTHONPATH only.
set -u
cd "$(dirname "$0")/.."
LOGS=${1:-gpu-check}
shift || true
PARTS=${*:-env tests doctor nostall-gpu nostall-cpu}
PYTHON=${PYTHON:-python3}
mkdir -p "$LOGS"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
TITAN_SITE=/tmp/titan-site  # the titan parts' wheels, on their PYTHONPATH only (they shadow some of the image's)
titan_site() {  # installs .whl/ into TITAN_SITE once; a copy of this script run beside waits for it
    (
        flock 9
        if [ ! -e "$TITAN_SITE/.installed" ] && compgen -G ".whl/*.whl" >/dev/null; then
            "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TITAN_SITE" \
                .whl/*.whl 2>&1 | grep -v "^WARNING" | tee -a "$LOGS/summary.txt"
            touch "$TITAN_SITE/.installed"
        fi
    ) 9>/tmp/titan-site.lock
}
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS, as use_deterministic_algorithms asks

part() {  # part NAME SECONDS COMMAND...: runs it, logs it, says how it ended
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local code=$?
    echo "== $name: exit $code in $((SECONDS - started)) s" | tee -a "$LOGS/summary.txt"
    tail -n 25 "$LOGS/$name.log"
    sed -n 's/^RESULT //p' "$LOGS/$name.log" >>"$LOGS/results.jsonl"
}

for name in $PARTS; do
    case $name in
    env)
        part env 60 bash -c "nvidia-smi -L; nproc --all; free -g; df -h /dev/shm /tmp; $PYTHON -c 'import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), transformers.__version__)'"
        # the memory tier and the writer processes' arenas live in /dev/shm: a small one is grown
        if [ "$(df --output=size -k /dev/shm | tail -1)" -lt $((16 << 20)) ]; then
            mount -o remount,size=32G /dev/shm 2>/dev/null && echo "/dev/shm grown to 32G" | tee -a "$LOGS/summary.txt"
        fi
        ;;
    tests)
        part tests 240 "$PYTHON" -m pytest -q -p no:cacheprovider \
            tests/integration/test_cuda.py \
            "tests/integration/test_lazy_snapshot_save.py::test_lazy_async_save_commits_the_state_at_save_bitwise_as_a_sync_save[cuda]" \
            tests/unit/guards/test_sdc_points.py::test_no_host_synchronisation_on_cuda
        ;;
    doctor)
        part doctor 60 "$PYTHON" -m trainguard doctor --dirs /tmp --reps 20 --json
        ;;
    nostall-gpu)
        part nostall-gpu 180 "$PYTHON" benchmarks/nostall.py --device cuda --ranks 1 --preset llama-60m \
            --seq-len 1024 --batch 8 --saves 3 --only blocked throughput --writers process thread
        ;;
    nostall-cpu)
        part nostall-cpu 240 env CUDA_VISIBLE_DEVICES= "$PYTHON" benchmarks/nostall.py --preset llama-60m \
            --saves 3 --only blocked throughput --writers process
        ;;
    nostall-ab)  # the tree before (BASE_SRC, e.g. .ab_old/src) and this one, side by side, the same script
        for src in "${BASE_SRC:?set BASE_SRC to the source tree before}" "$PWD/src"; do
            tag=$([ "$src" = "$PWD/src" ] && echo after || echo before)
            part "nostall-$tag" 170 env PYTHONPATH="$src" "$PYTHON" benchmarks/nostall.py --device cuda --ranks 1 \
                --preset llama-60m --seq-len 1024 --batch 8 --only throughput --writers process --cycles "${CYCLES:-1}" \
                ${AB_ARGS:---durable-every 10 auto}
        done
        ;;
    profile)  # nostall.py's figure 4 on the GPU: the CPU of a durable save and a memory-tier step, and their pieces
        part profile 100 "$PYTHON" benchmarks/nostall.py --device cuda --ranks 1 --preset llama-60m \
            --seq-len 1024 --batch 8 --only profile --writers process
        ;;
    trace)
        part trace 110 "$PYTHON" benchmarks/nostall.py --device cuda --ranks 1 --preset llama-60m \
            --seq-len 1024 --batch 8 --only trace --trace-dir "$LOGS/trace"
        tar -czf "$LOGS/trace.tar.gz" -C "$LOGS" trace && rm -rf "$LOGS/trace"
        ;;
    hf)
        part hf 150 "$PYTHON" -m pytest -q -p no:cacheprovider \
            "tests/integration/test_hf_trainer_fsdp.py::test_fsdp2_fine_tune_sigkilled_under_the_supervisor_resumes_bitwise[cuda]" \
            tests/integration/test_hf_trainer_fsdp.py::test_fsdp_where_accelerate_does_not_turn_it_on_is_refused_in_one_line
        ;;
    hf-save)
        part hf-save 90 bash -c "$PYTHON benchmarks/hf_trainer_save.py --repeats 7 --sections; \
            $PYTHON benchmarks/hf_trainer_save.py --hidden 512 --layers 8 --vocab 32000 --repeats 5"
        ;;
    hf-probe)
        part hf-probe 60 env PYTHON="$PYTHON" bash benchmarks/hf_fsdp_probe.sh
        ;;
    titan-probe)
        titan_site
        rm -rf /tmp/titan-probe-run  # the imports, then 3 steps of the example (no kill): a first look before titan
        part titan-probe 60 env PYTHONPATH="$PYTHONPATH:$TITAN_SITE" bash -c "$PYTHON examples/torchtitan_trainer.py --probe && $PYTHON -m torch.distributed.run \
            --standalone --nproc-per-node 1 examples/torchtitan_trainer.py --run-dir /tmp/titan-probe-run --steps 3"
        ;;
    titan)
        titan_site
        part titan 150 env PYTHONPATH="$PYTHONPATH:$TITAN_SITE" "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/integration/test_torchtitan_trainer.py
        ;;
    *)
        echo "unknown part $name" >&2
        exit 2
        ;;
    esac
done
cat "$LOGS/summary.txt"
