"""Probe: median latency and CPU of individual NVML calls on this machine, to set each field's cadence.

    python benchmarks/probe_nvml_costs.py            # on a GPU machine
Prints latency (wall) and CPU (process time) per call; GPM metrics-get by number and kind of metric;
the CPU an idle NVML event-set wait burns.
"""
import resource
import sys
import threading
import time

import pynvml as N


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(name, fn, n=200):
    ts = []
    c0 = cpu()
    err = ""
    for _ in range(n):
        t = time.perf_counter_ns()
        try:
            fn()
        except N.NVMLError as e:
            err = str(e)
        ts.append(time.perf_counter_ns() - t)
    c = (cpu() - c0) / n
    ts.sort()
    print(f"{name:<58} median {ts[n // 2] / 1e3:9.1f} us  p90 {ts[n * 9 // 10] / 1e3:9.1f} us  cpu {c * 1e6:8.1f} us {err}", flush=True)


def main():
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    measure("nvmlDeviceGetMemoryInfo v1", lambda: N.nvmlDeviceGetMemoryInfo(h))
    measure("nvmlDeviceGetMemoryInfo v2", lambda: N.nvmlDeviceGetMemoryInfo(h, N.nvmlMemory_v2))
    measure("nvmlDeviceGetUtilizationRates", lambda: N.nvmlDeviceGetUtilizationRates(h))
    measure("nvmlDeviceGetPowerUsage", lambda: N.nvmlDeviceGetPowerUsage(h))
    measure("nvmlDeviceGetTemperature", lambda: N.nvmlDeviceGetTemperature(h, 0))
    measure("nvmlDeviceGetClockInfo SM", lambda: N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM))
    measure("nvmlDeviceGetCurrentClocksEventReasons", lambda: N.nvmlDeviceGetCurrentClocksEventReasons(h))
    measure("nvmlDeviceGetPerformanceState", lambda: N.nvmlDeviceGetPerformanceState(h))
    for fid, nm in ((N.NVML_FI_DEV_MEMORY_TEMP, "MEMORY_TEMP"), (N.NVML_FI_DEV_POWER_INSTANT, "POWER_INSTANT"),
                    (N.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, "PCIE_COUNT_RX"), (N.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, "NVLINK_RX")):
        measure(f"nvmlDeviceGetFieldValues({nm})", lambda fid=fid: N.nvmlDeviceGetFieldValues(h, [fid]), 50)
    # Batching (issue 19): the slow group's ECC counters and memory temperature in one field-values call,
    # against the calls they replace; the violation (throttle time) counters and the energy field, with values.
    ecc = (N.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, N.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, N.NVML_FI_DEV_MEMORY_TEMP)
    measure("nvmlDeviceGetFieldValues(ECC SBE, DBE, MEMORY_TEMP)", lambda: N.nvmlDeviceGetFieldValues(h, list(ecc)), 100)
    measure("2x nvmlDeviceGetTotalEccErrors + FieldValues(MEMORY_TEMP)", lambda: (
        N.nvmlDeviceGetTotalEccErrors(h, N.NVML_MEMORY_ERROR_TYPE_CORRECTED, N.NVML_VOLATILE_ECC),
        N.nvmlDeviceGetTotalEccErrors(h, N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, N.NVML_VOLATILE_ECC),
        N.nvmlDeviceGetFieldValues(h, [N.NVML_FI_DEV_MEMORY_TEMP])), 100)
    print("   ECC by call:", N.nvmlDeviceGetTotalEccErrors(h, N.NVML_MEMORY_ERROR_TYPE_CORRECTED, N.NVML_VOLATILE_ECC),
          N.nvmlDeviceGetTotalEccErrors(h, N.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, N.NVML_VOLATILE_ECC),
          "by field:", [(f.fieldId, f.nvmlReturn, f.value.ullVal) for f in N.nvmlDeviceGetFieldValues(h, list(ecc))])
    viol = [74, 75, 76, 77, 78, 79, 80, 81, 269, 270, 271]
    measure("nvmlDeviceGetFieldValues(11 violation counters)", lambda: N.nvmlDeviceGetFieldValues(h, viol), 50)
    print("   violation fields:", [(f.fieldId, f.nvmlReturn, f.valueType, f.value.ullVal) for f in
                                    N.nvmlDeviceGetFieldValues(h, viol)])
    measure("nvmlDeviceGetFieldValues(ENERGY 191)", lambda: N.nvmlDeviceGetFieldValues(h, [191]), 20)
    measure("nvmlDeviceGetComputeRunningProcesses", lambda: N.nvmlDeviceGetComputeRunningProcesses(h))
    measure("nvmlDeviceGetProcessUtilization(now-1s)", lambda: N.nvmlDeviceGetProcessUtilization(h, int(time.time() * 1e6) - 1000000), 30)
    measure("nvmlDeviceGetPcieReplayCounter", lambda: N.nvmlDeviceGetPcieReplayCounter(h), 50)
    try:
        print("nvlink state link0:", N.nvmlDeviceGetNvLinkState(h, 0))
    except N.NVMLError as e:
        print("nvlink state link0:", e)
    # GPM: cost of one metrics-get by metric set
    s1, s2 = N.nvmlGpmSampleAlloc(), N.nvmlGpmSampleAlloc()
    measure("nvmlGpmSampleGet", lambda: N.nvmlGpmSampleGet(h, s1), 50)
    time.sleep(0.15)
    N.nvmlGpmSampleGet(h, s2)
    sets = {"1 (SM_UTIL)": [2], "5 core": [2, 3, 5, 10, 12], "14 no nvlink": [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 20, 21],
            "nvlink only": [60, 61], "pcie only": [20, 21], "16 all": [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 20, 21, 60, 61]}
    for nm, ids in sets.items():
        q = N.c_nvmlGpmMetricsGet_t()
        q.version = N.NVML_GPM_METRICS_GET_VERSION
        q.numMetrics = len(ids)
        q.sample1, q.sample2 = s1, s2
        for i, m in enumerate(ids):
            q.metrics[i].metricId = m
        measure(f"nvmlGpmMetricsGet {nm}", lambda q=q: N.nvmlGpmMetricsGet(q), 50)
        print("   values:", [(q.metrics[i].metricId, round(q.metrics[i].value, 2), q.metrics[i].nvmlReturn) for i in range(len(ids))])
    # The floor of a periodic sampler: CPU per wake-up at 10 Hz, with nothing, one call, three calls.
    def wake(calls, n=30):
        c0 = time.thread_time()
        for _ in range(n):
            time.sleep(0.1)
            for c in calls:
                c()
        return (time.thread_time() - c0) / n * 1e6

    mem = lambda: N.nvmlDeviceGetMemoryInfo(h)  # noqa: E731
    rsn = lambda: N.nvmlDeviceGetCurrentClocksEventReasons(h)  # noqa: E731
    clk = lambda: N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM)  # noqa: E731
    print(f"10 Hz wake, no call:            {wake([]):8.1f} us CPU per wake-up")
    print(f"10 Hz wake, pstate only:        {wake([lambda: N.nvmlDeviceGetPerformanceState(h)]):8.1f} us")
    print(f"10 Hz wake, memory info only:   {wake([mem]):8.1f} us")
    print(f"10 Hz wake, memory+reasons+clk: {wake([mem, rsn, clk]):8.1f} us")
    print(f"10 Hz wake, reasons+clk:        {wake([rsn, clk]):8.1f} us")
    print(f"10 Hz wake, FieldValues(ECC+T): {wake([lambda: N.nvmlDeviceGetFieldValues(h, list(ecc))]):8.1f} us")
    print(f"10 Hz wake, 2 ECC calls+T:      {wake([lambda: N.nvmlDeviceGetTotalEccErrors(h, 0, N.NVML_VOLATILE_ECC), lambda: N.nvmlDeviceGetTotalEccErrors(h, 1, N.NVML_VOLATILE_ECC), lambda: N.nvmlDeviceGetFieldValues(h, [82])]):8.1f} us")
    # Event-set wait: CPU of an idle wait
    es = N.nvmlEventSetCreate()
    N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, es)
    box = {}

    def waiter():
        c0 = time.thread_time()
        t0 = time.time()
        while time.time() - t0 < 3:
            try:
                N.nvmlEventSetWait_v2(es, 500)
            except N.NVMLError:
                pass
        box["cpu"] = time.thread_time() - c0

    th = threading.Thread(target=waiter)
    th.start()
    th.join()
    print(f"event-set wait: thread CPU {box['cpu'] * 1000:.1f} ms over 3 s idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
