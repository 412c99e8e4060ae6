#!/usr/bin/env bash
# The prepared GPU check (issue 36 item 6), run first thing whenever a GPU is lent: the whole
# client (thermowatch.watch against a live `serve`) and the thermometers alone, budget on and off,
# at GPT-2 small and at a 1B-class shape, side by side in one run each. The daemon's packages are
# not on the lent machines' image: they travel as wheels in .whl (python 3.12, see
# /work/.library/device/README.md), installed here into /tmp/site. Output: $OUT (or /tmp/gpu-out).
#
#   bash bench/gpu.sh            # ~4 min on an H200 (8 at most: each step has its own timeout)
#
# The wheels (9.5 MB; .whl is git-ignored, so build them in each new checkout, on this side):
#   python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl "sqlalchemy>=2.0" "alembic>=1.13" "fastapi>=0.110" "uvicorn>=0.29" "httptools>=0.6" \
#     "apscheduler>=3.10,<4" "slack-sdk>=3.27" "orjson>=3.9" "pydantic>=2.6"
# and call the device with carry [".whl"].
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 3
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, fastapi, sqlalchemy; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt" || exit 4
G2="--layers 12 --d-model 768 --heads 12 --seq-len 1024 --vocab 50304 --batch 16 --threads 4"
B1="--layers 24 --d-model 2048 --heads 16 --seq-len 2048 --vocab 50304 --batch 4 --threads 4"
# the daemon's imports first: a missing wheel ends the run here, not after the model is built
python3 -c "import thermowatch.cli, thermowatch.supervisor.app" 2>&1 | tee -a "$OUT/gpu.txt" || exit 4
# the tests that need CUDA (CI never has a GPU): the kernel path, the late loss, the CUDA timer
timeout 60 python3 -m pytest -q -p no:cacheprovider --noconftest -rs tests/monitors/test_attn_kernel_choice.py \
  tests/client/test_late_scalars.py "tests/monitors/test_thermometer_budget.py::test_the_cuda_timer_reads_its_events_once_done" \
  2>&1 | tee "$OUT/tests.txt"
# GPT-2 small (124M), clipping (the loop hands its norm to record(loss, grad_norm=...)): the whole
# client, budget off and 1%, and the client without thermometers (its machinery alone); with
# --sync-debug, where each variant makes the host wait for the GPU (0 per block in session 28)
timeout 110 python3 bench/client_overhead.py --device cuda $G2 --steps 100 --warmup 100 --clip 1.0 \
  --budget off --budget 0.01 --variants watch@off,watch@0.01,watch-bare --sync-debug --json 2>&1 | tee "$OUT/client_gpt2.txt"
# a 1B-class shape (24L d2048 T2048, ~1.3B parameters; three copies with AdamW ~65 GB), clipping, at
# GPT-3 XL's LR: at 1e-3 with no warm-up its attention logits really grow and the daemon pauses it
timeout 150 python3 bench/client_overhead.py --device cuda $B1 --steps 60 --warmup 60 --clip 1.0 --lr 2e-4 \
  --budget off --budget 0.01 --variants watch@off,watch@0.01 --json 2>&1 | tee "$OUT/client_1b.txt"
# GPT-2 small without clipping: the global gradient norm is then the client's to read every step
timeout 90 python3 bench/client_overhead.py --device cuda $G2 --steps 100 --warmup 60 \
  --budget off --budget 0.01 --variants watch@off,watch@0.01 --json 2>&1 | tee -a "$OUT/client_gpt2.txt"
# where an attention read's time goes, per layer, at both shapes (the kernel path's rows)
timeout 40 python3 bench/attn_read.py --heads 12 --seq-len 1024 --head-dim 64 --batch 16 --layers 12 2>&1 | tee "$OUT/attn_read.txt"
timeout 40 python3 bench/attn_read.py --heads 16 --seq-len 2048 --head-dim 128 --batch 4 --layers 24 2>&1 | tee -a "$OUT/attn_read.txt"
# the thermometers alone by group (time allowing)
timeout 90 python3 bench/thermometer_overhead_any.py --device cuda $G2 --steps 100 --warmup 60 \
  --variants every_step,budget_1pct,no_attn,no_act,no_grad --json 2>&1 | tee "$OUT/thermo_gpt2.txt"
