"""The package's version, in a module of its own so that any layer can name it without importing the
public facade (gpuscope/__init__.py, which pulls in the sampler and the monitor)."""

__version__ = "0.1.0"
