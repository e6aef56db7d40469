"""The Lightning and Hugging Face callbacks: their shared core without either framework, the HF adapter
with transformers' own state objects when transformers is installed (it is not a test dependency: it
drags ~20 MB of HTTP and tokenizer packages for a thin adapter; the GPU test runs both for real)."""

from __future__ import annotations

import importlib
import json
import sys
import time
from types import SimpleNamespace

import pytest

from gpuscope import MonitorError
from gpuscope.integrations._callbacks import CallbackCore


def test_only_the_main_process_monitors_unless_asked(tmp_path):
    other = CallbackCore(simulate="healthy", print_report=False)
    other.begin(main_process=False, rank=1)
    other.step()
    assert other.monitor is None and other.metrics() == {} and other.end() is None
    every = CallbackCore(tmp_path / "steps-{rank}.jsonl", simulate="healthy", print_report=False, all_ranks=True)
    every.begin(main_process=False, rank=3)
    assert every.monitor is not None
    every.step()
    rep = every.end()
    assert rep is not None and rep.steps == 1 and (tmp_path / "steps-3.jsonl").read_text().count("\n") == 1


def test_core_marks_steps_hands_out_prefixed_metrics_and_writes_the_report(tmp_path):
    core = CallbackCore(tmp_path / "steps.jsonl", simulate="compute_bound", interval=0.05, print_report=False,
                        flush_interval=0.2)
    core.begin(main_process=True)
    for _ in range(5):
        time.sleep(0.05)
        core.step(samples=8)
    time.sleep(0.7)
    m = core.metrics()
    assert set(m) >= {"gpuscope/gpu_busy_ratio", "gpuscope/step_seconds", "gpuscope/nvml_utilization_ratio"}
    assert all(isinstance(v, float) for v in m.values())
    rep = core.end(default_dir=tmp_path / "out")
    assert rep is not None and rep.steps == 5 and core.monitor is None
    saved = json.loads((tmp_path / "out" / "gpuscope_report.json").read_text())
    assert saved["steps"] == 5 and saved["gpu_busy_ratio"] == pytest.approx(rep.gpu_busy_ratio)
    assert core.end() is rep  # a second end (on_exception after on_train_end) changes nothing


@pytest.mark.parametrize("kw, words", [
    ({"log": "/no/such/dir/steps.jsonl"}, "does not exist"),
    ({"interval": -1}, "interval"),
    ({"simulate": "nope"}, "Unknown scenario"),
])
def test_bad_callback_arguments_fail_when_the_callback_is_made(kw, words, tmp_path):
    with pytest.raises(MonitorError, match=words):
        CallbackCore(**kw)
    assert not list(tmp_path.iterdir())


def test_a_failing_start_leaves_training_unmonitored_not_broken(tmp_path, monkeypatch, caplog):
    core = CallbackCore(tmp_path / "steps.jsonl", simulate="healthy", print_report=False)
    (tmp_path / "steps.jsonl").mkdir()  # the log path became a directory after the check
    core.begin(main_process=True)
    core.step()
    assert core.monitor is None and core.end() is None
    assert any("start failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("module, words", [("gpuscope.integrations.lightning", "PyTorch Lightning"),
                                           ("gpuscope.integrations.hf", "transformers")])
def test_a_missing_framework_is_one_sentence(module, words, monkeypatch):
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError) as ei:
        importlib.import_module(module)
    msg = str(ei.value)
    assert words in msg and "pip install" in msg and msg.endswith(".") and "\n" not in msg


def test_hf_callback_hooks_with_transformers_state_objects(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (not a test dependency)")
    from gpuscope.integrations.hf import GpuscopeCallback

    cb = GpuscopeCallback(tmp_path / "steps.jsonl", simulate="healthy", interval=0.05, print_report=False,
                          flush_interval=0.2)
    assert isinstance(cb, transformers.TrainerCallback)
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           output_dir=str(tmp_path / "out"), process_index=0)
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    cb.on_train_begin(args, state, control)
    for i in range(6):
        time.sleep(0.05)
        state.global_step = i + 1
        state.num_input_tokens_seen = 512 * (i + 1)
        cb.on_step_end(args, state, control)
    time.sleep(0.7)
    logs = {"loss": 1.0}
    state.log_history.append({**logs, "step": 6})
    cb.on_log(args, state, control, logs=logs)
    assert "gpuscope/gpu_busy_ratio" in logs and "gpuscope/gpu_busy_ratio" in state.log_history[-1]
    cb.on_train_end(args, state, control)
    rep = cb.report
    assert rep is not None and rep.steps == 6
    assert rep.samples_per_second == pytest.approx(8 / rep.step_seconds_mean, rel=0.01)
    assert rep.tokens_per_second == pytest.approx(512 / rep.step_seconds_mean, rel=0.01)
    assert json.loads((tmp_path / "out" / "gpuscope_report.json").read_text())["steps"] == 6
    recs = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in recs] == [8] * 6 and [r["tokens"] for r in recs] == [512] * 6


def test_lightning_callback_hooks(tmp_path):
    try:
        pl = importlib.import_module("lightning.pytorch")
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning", reason="Lightning needs torch; it runs in tests/gpu")
    from gpuscope.integrations.lightning import GpuscopeCallback

    cb = GpuscopeCallback(simulate="healthy", interval=0.05, print_report=False, report_path=tmp_path / "r.json",
                          flush_interval=0.2)
    assert isinstance(cb, pl.Callback)
    logged = []
    trainer = SimpleNamespace(local_rank=0, global_rank=0, log_every_n_steps=1, log_dir=None)
    module = SimpleNamespace(log_dict=lambda metrics, **kw: logged.append(metrics))
    cb.on_train_start(trainer, module)
    for i in range(5):
        time.sleep(0.1)
        cb.on_train_batch_end(trainer, module, None, None, i)
    cb.on_train_end(trainer, module)
    assert cb.report is not None and cb.report.steps == 5 and (tmp_path / "r.json").exists()
    assert any("gpuscope/gpu_busy_ratio" in m for m in logged)
