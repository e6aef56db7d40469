#!/usr/bin/env bash
# Issue 19's runs on one H200, in one command (about 3.5 minutes):
#
#   run (device tool), carry: .whl19      command: bash benchmarks/gpu_issue19.sh
#
# .whl19 holds the wheels the GPU machine lacks: nvitop and nvitop-exporter 1.7.2 (the peers) and orjson
# (cp312). Results go to $OUT (the device tool brings them back): shares.json from the shared-GPU test,
# probe.txt, sampler.json/.txt, choices.txt, footprint.json/.txt.
set -u
OUT=${OUT:-/tmp/gpu-issue19}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl19/*.whl 2>&1 | grep -v WARN | tail -2
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import pynvml, nvitop, sys; print("python", sys.version.split()[0], "nvidia-ml-py", pynvml.__version__ if hasattr(pynvml, "__version__") else "?", "nvitop", nvitop.__version__)'

echo "=== 1. four processes share GPU 0 (pytest -m gpu)"
GPUSCOPE_BENCH_OUT=$OUT timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -s tests/gpu/test_gpu_shares.py 2>&1 | tail -12

echo "=== 2. what the slow and rare groups read now (ECC by field, static max clock)"
timeout 30 python3 - <<'EOF'
import time
from gpuscope import Sampler, SamplerConfig
with Sampler(SamplerConfig(interval=0.1)) as s:
    s.sample_once(); time.sleep(0.3); snap = s.sample_once()
    caps = s.capabilities()["0"]
    for m in ("gpu_ecc_corrected_errors_total", "gpu_ecc_uncorrected_errors_total", "gpu_memory_temperature_celsius",
              "gpu_sm_clock_max_hertz", "gpu_process_sm_active_ratio"):
        print(f"  {m:<36} {snap.gpus[0].values.get(m)!s:<14} {caps[m]}")
EOF

echo "=== 3. NVML call costs (probe)"
timeout 90 python3 benchmarks/probe_nvml_costs.py > "$OUT/probe.txt" 2>&1
grep -E "FieldValues|EccErrors|10 Hz wake|violation|MemoryInfo v1|TotalEnergy" "$OUT/probe.txt" | cut -c1-170

echo "=== 4. the 10 Hz sampler against nvitop, same run"
timeout 90 python3 benchmarks/bench_sampler.py --seconds 10 --rates 10 --no-flat --json "$OUT/sampler.json" \
  > "$OUT/sampler.txt" 2>&1
grep -v "^  nvml\|^probe" "$OUT/sampler.txt" | head -12 | cut -c1-260

echo "=== 5. each cadence choice, same run"
timeout 90 python3 benchmarks/bench_sampler_variants.py --seconds 6 --only choices > "$OUT/choices.txt" 2>&1
cut -c1-120 "$OUT/choices.txt"

echo "=== 6. footprint: the real agent and nvitop-exporter at their default intervals"
timeout 100 python3 benchmarks/bench_footprint.py --seconds 40 --warmup 8 --json "$OUT/footprint.json" 2>&1 \
  | tee "$OUT/footprint.txt"
