"""What to say when a name the user typed is not among the choices: the closest one ("did you mean"),
else the list, and which GPUs there are. Standard library only: every layer may use it.

    >>> f"unknown key 'intervl'; {did_you_mean('intervl', ['interval', 'slow'], 'the keys are interval, slow.')}"
    "unknown key 'intervl'; did you mean 'interval'?"
    >>> did_you_mean('zzz', ['interval', 'slow'], 'the keys are interval, slow.')
    'the keys are interval, slow.'
    >>> gpu_list(["0", "1", "2", "3", "6", "0/mig1"])
    '0-3, 6, 0/mig1'
    >>> no_such_gpu("99", ["0", "1", "2", "3", "4", "5", "6", "7"], "this agent")
    'No GPU 99 here; this agent has GPUs 0-7.'
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["closest", "did_you_mean", "gpu_list", "no_such_gpu"]


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice that `word` most likely misspells (difflib's ratio of at least 0.6), else None."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(word: str, choices: Iterable[str], otherwise: str) -> str:
    """"did you mean 'y'?" for the closest choice, else `otherwise` (the choices, as the caller words them).
    The end of a sentence that names what was typed: `f"unknown key {key!r}; {did_you_mean(...)}"`."""
    near = closest(word, choices)
    return f"did you mean {near!r}?" if near is not None else otherwise


def gpu_list(gpus: Iterable[str]) -> str:
    """GPU labels in order, runs of whole indices as ranges: '0-7', '0, 2, 5', '0-3, 0/mig1'."""
    labels = set(gpus)
    runs: list[list[int]] = []
    for i in sorted(int(g) for g in labels if g.isdigit()):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    parts = [f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs]
    return ", ".join(parts + sorted(g for g in labels if not g.isdigit()))


def no_such_gpu(gpu: str, known: Iterable[str], holder: str) -> str:
    """'No GPU 99 here; HOLDER has GPUs 0-7.' (or has no GPU yet), for a GPU filter that matches none."""
    known = list(known)
    if not known:
        return f"No GPU {gpu} here; {holder} has recorded no GPU yet."
    return f"No GPU {gpu} here; {holder} has {'GPU' if len(known) == 1 else 'GPUs'} {gpu_list(known)}."
