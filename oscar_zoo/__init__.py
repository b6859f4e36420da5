"""oscar-zoo: calibrate, verify, publish and serve OSCAR attention-aware rotations for 2-bit KV caches."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("oscar-zoo")  # the installed distribution's, set in pyproject.toml
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
