"""The directory `gpuscope trace` puts first on the traced command's PYTHONPATH.

It holds only `sitecustomize.py`, which Python's `site` module imports at start-up in every
interpreter that sees this PYTHONPATH. Nothing in this package is imported by gpuscope itself.
"""

from pathlib import Path

DIR = str(Path(__file__).resolve().parent)
