"""The package version, in a module of its own so that reading it imports nothing else.

pyproject.toml takes it from here (a dynamic version); the device fingerprint and the fleet
client's User-Agent read it without loading torch or the dispatcher.
"""

__version__ = "0.2.0"
