#!/usr/bin/env bash
# Does FSDP2 through accelerate come up under GuardedTrainer on this machine (one GPU)? Under a minute:
# examples/hf_trainer.py --fsdp on one rank (torchrun --nproc-per-node 1), the default config (async
# saves) with a save every 2 steps: 4 steps, then the same command to 6 steps, which resumes from
# global_step_4. Prints the versions, the example's FSDP2 line (how many parameters are DTensors),
# each start's exit code, the checkpoints and where each start resumed from.
#
#   bash benchmarks/hf_fsdp_probe.sh [EXAMPLE_FLAGS...]     (PYTHON: the interpreter, default python3;
#                                                          SCRIPT: the example, default examples/hf_trainer.py)
set -u
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} OMP_NUM_THREADS=1
SCRIPT=${SCRIPT:-examples/hf_trainer.py}
WORK=$(mktemp -d -t hf_fsdp_probe.XXXXXX)  # each start's log, and the run directory
RUN=$WORK/run
"$PYTHON" -c 'import sys, torch, transformers, accelerate; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "accelerate", accelerate.__version__, "gpus", torch.cuda.device_count())'
for steps in 4 6; do
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 "$SCRIPT" --fsdp \
        --run-dir "$RUN" --steps "$steps" --set checkpoint.save_interval=2 "$@" >"$WORK/start-$steps.log" 2>&1
    code=$?
    echo "start to step $steps: exit $code"
    grep -E "hf_trainer: FSDP2" "$WORK/start-$steps.log"
    [ "$code" = 0 ] || tail -n 40 "$WORK/start-$steps.log"
done
echo "checkpoints: $(ls "$RUN/checkpoints" 2>/dev/null | tr '\n' ' ')"
grep -h '"run_started"' "$RUN/events.jsonl" 2>/dev/null | "$PYTHON" -c 'import json, sys; [print("run_started resumed_from", json.loads(line).get("resumed_from")) for line in sys.stdin]'
echo "logs and run: $WORK"
