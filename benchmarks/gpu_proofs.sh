#!/usr/bin/env bash
# The GPU runs that issues 6, 7 and 8 still need, in one command on one H200 (about 8 minutes):
#
#   run (device tool), carry: .whl .workloads src/gpuscope/web/node_modules
#   command: benchmarks/gpu_proofs.sh [capacity] [guard] [tests] [cupti]   (default: the first three)
#
# .whl holds cp312 wheels the GPU machine lacks: orjson, hdrhistogram, httptools (and, for the CUPTI test,
# cupti-python, nvidia-cuda-cupti, pyelftools); .workloads a copy of ../shared/workloads;
# src/gpuscope/web/node_modules the chart library, without which the load test's report has no plots.
# Results go to $OUT (the device tool brings them back): capacity/summary.json, capacity/report.html,
# guard_e2e.json and the pytest lines. The windowed-tracing benchmark needs two GPUs and its own call:
#   python3 benchmarks/bench_trace_windowed.py --parallel-gpus --minutes 8.5 --rounds 2
set -u
OUT=${OUT:-/tmp/gpu-proofs}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/tests GPUSCOPE_WORKLOADS=$PWD/.workloads
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/orjson-*cp312*.whl .whl/hdrhistogram-*.whl \
    .whl/httptools-*.whl 2>&1 | grep -v WARN | tail -2
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cupti-site .whl/cupti_python-*.whl \
    .whl/nvidia_cuda_cupti-*.whl .whl/pyelftools-*.whl 2>&1 | grep -v WARN | tail -2
fi
[ -f src/gpuscope/web/node_modules/uplot/dist/uPlot.iife.min.js ] || echo "note: no uPlot here: the report will have no plots"
GS=(python3 -c 'import sys; from gpuscope.cli import main; sys.exit(main())')
parts=" ${*:-capacity guard tests} "
want() { [[ $parts == *" $1 "* ]]; }

if want capacity; then
echo "=== 1. capacity search against the example service (issue 7), GPU 0 only (--gpus 0)"
CUDA_VISIBLE_DEVICES=0 python3 examples/inference_service/server.py --device cuda --preset h200 --seed 1 --port 0 >/tmp/svc.out 2>/tmp/svc.err &
svc=$!
for _ in $(seq 1 120); do grep -q listening /tmp/svc.out && break; sleep 1; done
url=$(grep -o 'http://[0-9.:]*' /tmp/svc.out | head -1)
timeout 240 "${GS[@]}" loadtest "$url" --openai completions --prompt-tokens 256 --max-tokens 64 \
  --slo ttft=250ms,tpot=25ms --find-capacity --capacity-start 8 --capacity-max 1024 --stage-duration 8s \
  --gpus 0 --out "$OUT/capacity" --quiet | tail -20
kill $svc; wait $svc 2>/dev/null
gzip -f "$OUT/capacity/records.jsonl"
fi

if want guard; then
echo "=== 2. the guard under a spike, with and without (issue 8)"
timeout 240 python3 benchmarks/bench_guard_e2e.py --preset h200 --device cuda --seconds 45 --workers 2 \
  --json "$OUT/guard_e2e.json" | tail -25
fi

if want tests; then
echo "=== 3. GPU tests of tracing, load testing and the guard"
PYTHONPATH=/tmp/cupti-site:$PYTHONPATH timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/gpu/test_gpu_trace.py tests/gpu/test_gpu_loadtest_cli.py tests/gpu/test_gpu_guard.py 2>&1 | tail -8
fi

if want cupti; then
echo "=== 4. the CUPTI backend with CuPy, Numba, JAX and cuda-python (issue 6)"
PYTHONPATH=/tmp/cupti-site:$PYTHONPATH timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rs \
  tests/gpu/test_gpu_cupti.py 2>&1 | tail -40
fi
