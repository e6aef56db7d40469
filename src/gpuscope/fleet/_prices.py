"""What a GPU-hour and a kWh cost, and how much CO2e a kWh means: the prices file of `gpuscope fleet report`.

    currency = "USD"
    energy_per_kwh = 0.12          # price of one kWh
    grid_kg_co2e_per_kwh = 0.4     # the grid's carbon intensity
    [gpu_hour]                     # price of one GPU-hour, per GPU model
    "NVIDIA H200" = 3.50
    default = 2.00                 # any model not named above

A model key matches a GPU's `model` label with " (simulated)" taken off. Without a file, `DEFAULT` holds
(documented in docs/FLEET.md): 2.00 per GPU-hour for every model, 0.12 per kWh, 0.4 kg CO2e per kWh.

    >>> p = parse('[gpu_hour]\\n"NVIDIA H200" = 3.5\\n', "prices.toml")
    >>> p.gpu_hour("NVIDIA H200 (simulated)"), p.currency
    (3.5, 'USD')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .._files import InputFileError, kind_of, load_toml, parse_toml, shown
from ..errors import UsageError

__all__ = ["DEFAULT", "Prices", "PricesError", "load", "parse"]

SIMULATED_SUFFIX = " (simulated)"
_TOP_KEYS = ("currency", "energy_per_kwh", "grid_kg_co2e_per_kwh", "gpu_hour")
#: The most models a prices file may name (real fleets have a handful).
MAX_MODELS = 1000


class PricesError(InputFileError):
    """A prices file that cannot be used: one sentence naming the file and the key."""


@dataclass(frozen=True)
class Prices:
    """Prices per GPU-hour by model (`per_model`, `default` for the rest: None means no default), per kWh,
    and the grid's kg CO2e per kWh."""

    per_model: dict[str, float] = field(default_factory=dict)
    default: float | None = 2.00
    energy_per_kwh: float = 0.12
    grid_kg_co2e_per_kwh: float = 0.4
    currency: str = "USD"
    source: str = "defaults"

    def gpu_hour(self, model: str) -> float:
        """The price of one GPU-hour of `model` (its label, " (simulated)" or not); UsageError when the file
        names no price for it and has no default."""
        key = model_key(model)
        if key in self.per_model:
            return self.per_model[key]
        if self.default is not None:
            return self.default
        known = ", ".join(sorted(self.per_model)) or "none"
        raise PricesError(f"The prices file {self.source} has no [gpu_hour] price for the GPU model {key!r} seen "
                          f"in the fleet, and no default (models it prices: {known}); add \"{key}\" = PRICE or "
                          "default = PRICE under [gpu_hour].")

    def as_dict(self) -> dict[str, Any]:
        return {"currency": self.currency, "energy_per_kwh": self.energy_per_kwh,
                "grid_kg_co2e_per_kwh": self.grid_kg_co2e_per_kwh,
                "gpu_hour": {**self.per_model, **({"default": self.default} if self.default is not None else {})},
                "source": self.source}


DEFAULT = Prices()


def model_key(model: str) -> str:
    return model.removesuffix(SIMULATED_SUFFIX).strip()


def _price(value: Any, where: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PricesError(f"The prices file {source}: {where} must be a number, not {kind_of(value)} "
                          f"({shown(value)}).")
    v = float(value)
    if not math.isfinite(v):
        raise PricesError(f"The prices file {source}: {where} must be a finite number, not {shown(value)}.")
    if v < 0:
        raise PricesError(f"The prices file {source}: {where} must not be negative, not {shown(value)}.")
    return v


def _unknown(key: str, known: tuple[str, ...], source: str) -> UsageError:
    from .._choices import did_you_mean

    return PricesError(f"The prices file {source} has an unknown key {key!r}; "
                       + did_you_mean(key, known, f"the keys are: {', '.join(known)}."))


def from_doc(doc: dict[str, Any], source: str) -> Prices:
    for key in doc:
        if key not in _TOP_KEYS:
            raise _unknown(key, _TOP_KEYS, source)
    currency = doc.get("currency", DEFAULT.currency)
    if not isinstance(currency, str) or not currency.strip() or len(currency) > 16:
        raise PricesError(f"The prices file {source}: currency must be a short name such as \"USD\", not "
                          f"{shown(currency)}.")
    table = doc.get("gpu_hour", {})
    if not isinstance(table, dict):
        raise PricesError(f"The prices file {source}: gpu_hour must be a table ([gpu_hour] with \"MODEL\" = PRICE "
                          f"lines), not {kind_of(table)}.")
    if len(table) > MAX_MODELS:
        raise PricesError(f"The prices file {source} names {len(table)} GPU models; at most {MAX_MODELS}.")
    per_model = {model_key(k): _price(v, f"gpu_hour.{k!r}", source) for k, v in table.items() if k != "default"}
    default = _price(table["default"], "gpu_hour.default", source) if "default" in table else None
    if "gpu_hour" not in doc:
        default = DEFAULT.default
    return Prices(per_model=per_model, default=default,
                  energy_per_kwh=_price(doc.get("energy_per_kwh", DEFAULT.energy_per_kwh), "energy_per_kwh", source),
                  grid_kg_co2e_per_kwh=_price(doc.get("grid_kg_co2e_per_kwh", DEFAULT.grid_kg_co2e_per_kwh),
                                              "grid_kg_co2e_per_kwh", source),
                  currency=currency.strip(), source=source)


def parse(text: str, source: str) -> Prices:
    return from_doc(parse_toml(text, f"the prices file {source}", error=PricesError), source)


def load(path: str) -> Prices:
    """The prices file at `path`; PricesError (exit 2) with one sentence for anything wrong with it."""
    return from_doc(load_toml(path, f"the prices file {path}", error=PricesError), path)
