"""oscar-zoo: calibrate, verify, publish and serve OSCAR attention-aware rotations for 2-bit KV caches."""

__version__ = "0.1.0"
