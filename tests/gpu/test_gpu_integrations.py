"""The training callbacks on a real GPU (`pytest -m gpu`): a tiny Lightning fit and a tiny Hugging Face
Trainer run, each with gpuscope's callback, matmul-heavy enough that the SMs are really busy.

Needs torch with CUDA, and Lightning / transformers (+ accelerate); without them on the GPU machine:
    pip install --no-deps $(ls .whl/*.whl | grep -v nvitop)
"""

from __future__ import annotations

import csv
import importlib
import json

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
INSTALL = "install the wheels in .whl/: pip install --no-deps $(ls .whl/*.whl | grep -v nvitop)"
# Small inputs, big hidden layers: the step is ~10 ms of TF32 matmuls on an H200 and little host work.
IN, HIDDEN, LAYERS, BATCH, STEPS = 512, 8192, 6, 1024, 150


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.set_float32_matmul_precision("high")


def _data():
    x = torch.randn(BATCH * 8, IN)
    return x, x[:, :1].clone()


def _net():
    layers = [torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU()]
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(HIDDEN, 1))


def _check(rep, log_path):
    assert rep is not None and rep.steps == STEPS, rep
    assert rep.source == "sampler" and rep.gpus, rep
    assert rep.gpu_coverage_ratio is not None and rep.gpu_coverage_ratio > 0.8, rep
    # Large matmuls keep the SMs busy: a launch-bound loop would read ~0.001 here.
    assert rep.gpu_busy_ratio is not None and rep.gpu_busy_ratio > 0.3, rep
    assert rep.nvml_utilization_ratio is not None and rep.energy_joules_per_step_median > 0, rep
    recs = [json.loads(x) for x in log_path.read_text().splitlines()]
    assert len(recs) == STEPS and all(r["duration_s"] > 0 for r in recs)
    # Steps before the first GPM window closed (the first ~0.2 s) may have no SM activity.
    assert sum(r["gpu_busy_ratio"] is not None for r in recs) >= 0.8 * STEPS
    print(rep)


def test_lightning_fit_with_the_callback(tmp_path):
    try:
        pl = importlib.import_module("lightning.pytorch")
        from lightning.pytorch.loggers import CSVLogger
    except ImportError:
        try:
            pl = importlib.import_module("pytorch_lightning")
            from pytorch_lightning.loggers import CSVLogger
        except ImportError:
            pytest.skip(f"Lightning is not installed; {INSTALL}")
    from gpuscope.integrations.lightning import GpuscopeCallback

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    x, y = _data()
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # whole batches: no per-sample host work
    cb = GpuscopeCallback(tmp_path / "steps.jsonl", report_path=tmp_path / "report.json")
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=STEPS, callbacks=[cb], log_every_n_steps=5,
                         logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Model(), loader)
    _check(cb.report, tmp_path / "steps.jsonl")
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == STEPS
    metrics = list(tmp_path.rglob("metrics.csv"))
    assert metrics, "the CSV logger wrote nothing"
    rows = list(csv.DictReader(metrics[0].open()))
    assert any(r.get("gpuscope/gpu_busy_ratio") for r in rows), rows[:3]


def test_hf_trainer_with_the_callback(tmp_path):
    try:
        transformers = importlib.import_module("transformers")
        importlib.import_module("accelerate")
    except ImportError:
        pytest.skip(f"transformers/accelerate are not installed; {INSTALL}")
    from gpuscope.integrations.hf import GpuscopeCallback

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    x, y = _data()
    data = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=BATCH, logging_steps=5,
        report_to=[], save_strategy="no", disable_tqdm=True, learning_rate=1e-4)
    cb = GpuscopeCallback(tmp_path / "steps.jsonl")
    trainer = transformers.Trainer(model=Model(), args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    _check(cb.report, tmp_path / "steps.jsonl")
    assert cb.report.samples_per_second is not None and cb.report.samples_per_second > 0
    logged = [h for h in trainer.state.log_history if "gpuscope/gpu_busy_ratio" in h]
    assert logged, trainer.state.log_history
    assert json.loads((tmp_path / "out" / "gpuscope_report.json").read_text())["steps"] == STEPS
