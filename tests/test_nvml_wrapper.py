import logging

import pynvml
import pytest

from gpuscope import NvmlUnavailable
from gpuscope._nvml import (
    ERROR_FUNCTION_NOT_FOUND,
    ERROR_GPU_IS_LOST,
    ERROR_NO_PERMISSION,
    ERROR_NOT_FOUND,
    ERROR_NOT_SUPPORTED,
    ERROR_UNKNOWN,
    MISSING_IN_BINDING,
    GpuLost,
    Nvml,
    Unavailable,
    decode,
)
from gpuscope.testing import FakeGPU, FakeNVML


@pytest.fixture
def fake():
    return FakeNVML([FakeGPU(index=0, power_w=250.0), FakeGPU(index=1)])


@pytest.fixture
def nv(fake):
    n = Nvml(fake)
    n.init()
    return n


def test_return_codes_agree_with_pynvml():
    assert ERROR_NOT_SUPPORTED == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert ERROR_NO_PERMISSION == pynvml.NVML_ERROR_NO_PERMISSION
    assert ERROR_NOT_FOUND == pynvml.NVML_ERROR_NOT_FOUND
    assert ERROR_FUNCTION_NOT_FOUND == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert ERROR_GPU_IS_LOST == pynvml.NVML_ERROR_GPU_IS_LOST


def test_success_returns_the_value(nv, fake):
    h = nv.call("nvmlDeviceGetHandleByIndex", 0)
    assert h is fake.gpus[0]
    assert nv.call("nvmlDeviceGetPowerUsage", h) == 250_000


def test_not_supported_is_a_falsy_value_with_a_reason(nv, fake):
    fake.gpus[0].errors["nvmlDeviceGetEncoderUtilization"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    v = nv.call("nvmlDeviceGetEncoderUtilization", fake.gpus[0])
    assert isinstance(v, Unavailable)
    assert not v
    assert v.code == ERROR_NOT_SUPPORTED
    assert "not supported" in v.reason
    assert "not supported" in repr(v)


def test_no_permission_reason_mentions_privileges(nv, fake):
    fake.gpus[0].errors["nvmlDeviceGetTotalEnergyConsumption"] = pynvml.NVML_ERROR_NO_PERMISSION
    v = nv.call("nvmlDeviceGetTotalEnergyConsumption", fake.gpus[0])
    assert isinstance(v, Unavailable) and not v
    assert v.code == ERROR_NO_PERMISSION
    assert "privileges" in v.reason


def test_function_not_found_says_driver_too_old(nv, fake):
    fake.gpus[0].errors["nvmlDeviceGetCurrentClocksEventReasons"] = pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    v = nv.call("nvmlDeviceGetCurrentClocksEventReasons", fake.gpus[0])
    assert isinstance(v, Unavailable) and not v
    assert "driver" in v.reason and "too old" in v.reason


def test_not_found_means_no_data_yet(nv, fake):
    fake.gpus[0].errors["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_NOT_FOUND
    v = nv.call("nvmlDeviceGetProcessUtilization", fake.gpus[0], 0)
    assert isinstance(v, Unavailable) and v.code == ERROR_NOT_FOUND
    assert "no data" in v.reason


def test_gpu_is_lost_raises_gpu_lost(nv, fake):
    fake.gpus[1].lost = True
    with pytest.raises(GpuLost, match="nvmlDeviceGetPowerUsage"):
        nv.call("nvmlDeviceGetPowerUsage", fake.gpus[1])
    # the other GPU still answers
    assert nv.call("nvmlDeviceGetPowerUsage", fake.gpus[0]) == 250_000


def test_gpu_is_lost_as_an_injected_error_code(nv, fake):
    fake.gpus[0].errors["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(GpuLost):
        nv.call("nvmlDeviceGetTemperature", fake.gpus[0], 0)


def test_non_nvml_exception_becomes_unavailable_and_is_logged_once(nv, fake, caplog):
    def broken(h):
        raise ValueError("binding returned garbage")

    fake.nvmlDeviceGetPowerUsage = broken
    with caplog.at_level(logging.WARNING, logger="gpuscope.nvml"):
        results = [nv.call("nvmlDeviceGetPowerUsage", fake.gpus[0]) for _ in range(5)]
    for v in results:
        assert isinstance(v, Unavailable) and not v
        assert v.code == ERROR_UNKNOWN
        assert "ValueError" in v.reason and "garbage" in v.reason
    warnings = [r for r in caplog.records if "nvmlDeviceGetPowerUsage" in r.getMessage()]
    assert len(warnings) == 1
    assert nv.stats["nvmlDeviceGetPowerUsage"].errors == 5


def test_unknown_nvml_error_is_logged_once_per_call_name(nv, fake, caplog):
    fake.gpus[0].errors["nvmlDeviceGetTemperature"] = pynvml.NVML_ERROR_INSUFFICIENT_POWER
    fake.gpus[0].errors["nvmlDeviceGetPerformanceState"] = pynvml.NVML_ERROR_INSUFFICIENT_POWER
    with caplog.at_level(logging.WARNING, logger="gpuscope.nvml"):
        for _ in range(3):
            t = nv.call("nvmlDeviceGetTemperature", fake.gpus[0], 0)
            p = nv.call("nvmlDeviceGetPerformanceState", fake.gpus[0])
    assert isinstance(t, Unavailable) and isinstance(p, Unavailable)
    assert t.code == pynvml.NVML_ERROR_INSUFFICIENT_POWER
    assert "NVML error" in t.reason
    assert len([r for r in caplog.records if r.name == "gpuscope.nvml"]) == 2


def test_a_function_missing_from_the_binding(nv, fake):
    v = nv.call("nvmlDeviceGetSomethingFromTheFuture", fake.gpus[0])
    assert v is MISSING_IN_BINDING
    assert not v
    assert "nvidia-ml-py" in v.reason and "too old" in v.reason
    # a plain pynvml function the fake does not implement must not reach the real library either
    assert nv.call("nvmlDeviceGetBoardPartNumber", fake.gpus[0]) is MISSING_IN_BINDING


def test_latency_is_accounted_per_call(nv, fake):
    fake.gpus[0].errors["nvmlDeviceGetEncoderUtilization"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    for _ in range(4):
        nv.call("nvmlDeviceGetPowerUsage", fake.gpus[0])
    for _ in range(2):
        nv.call("nvmlDeviceGetEncoderUtilization", fake.gpus[0])
    st = nv.stats["nvmlDeviceGetPowerUsage"]
    assert st.count == 4 and st.errors == 0
    assert st.total_ns > 0 and st.max_ns > 0 and st.median_ns() > 0
    assert st.max_ns * 4 >= st.total_ns
    enc = nv.stats["nvmlDeviceGetEncoderUtilization"]
    assert enc.count == 2 and enc.errors == 2

    rows = {r["call"]: r for r in nv.latency_table()}
    assert rows["nvmlDeviceGetPowerUsage"]["count"] == 4
    assert rows["nvmlDeviceGetEncoderUtilization"]["errors"] == 2
    for r in rows.values():
        assert set(r) == {"call", "count", "errors", "median_us", "mean_us", "max_us"}
        assert 0 <= r["median_us"] <= r["max_us"]
        assert 0 <= r["mean_us"] <= r["max_us"]
    medians = [r["median_us"] for r in nv.latency_table()]
    assert medians == sorted(medians, reverse=True)


def test_latency_window_is_bounded(nv, fake):
    for _ in range(300):
        nv.call("nvmlDeviceGetPerformanceState", fake.gpus[0])
    st = nv.stats["nvmlDeviceGetPerformanceState"]
    assert st.count == 300
    assert len(st.recent_ns) == 256


def test_init_without_a_driver_points_to_simulate():
    nv = Nvml(FakeNVML(available=False))
    with pytest.raises(NvmlUnavailable) as exc:
        nv.init()
    msg = str(exc.value)
    assert "--simulate" in msg
    assert "\n" not in msg
    assert not nv.initialized


class _InitFails(FakeNVML):
    def __init__(self, code):
        super().__init__()
        self.code = code

    def nvmlInit(self):
        raise pynvml.NVMLError(self.code)


def test_init_driver_not_loaded_points_to_simulate():
    with pytest.raises(NvmlUnavailable, match="--simulate"):
        Nvml(_InitFails(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)).init()


def test_init_no_permission_is_one_sentence_about_access():
    with pytest.raises(NvmlUnavailable, match="/dev/nvidia"):
        Nvml(_InitFails(pynvml.NVML_ERROR_NO_PERMISSION)).init()


def test_init_other_failure_is_nvml_unavailable():
    with pytest.raises(NvmlUnavailable, match="NVML failed to start"):
        Nvml(_InitFails(pynvml.NVML_ERROR_UNKNOWN)).init()


def test_shutdown_is_idempotent(fake):
    nv = Nvml(fake)
    nv.init()
    assert fake.initialized and nv.initialized
    nv.shutdown()
    assert not fake.initialized and not nv.initialized
    nv.shutdown()  # second time: nothing to do, no error


def test_decode():
    assert decode(b"NVIDIA H200") == "NVIDIA H200"
    assert decode("580.159.03") == "580.159.03"
    assert decode(b"\xff") == "\ufffd"
