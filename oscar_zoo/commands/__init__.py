"""One module per command; each exposes `register(app)`. Add new command modules to COMMAND_MODULES."""

from . import calibrate, inspect, verify

COMMAND_MODULES = [calibrate, verify, inspect]
from . import export, import_oscar, list_cmd, pull, push  # noqa: E402  (publishing and interchange commands)
COMMAND_MODULES += [push, pull, list_cmd, import_oscar, export]
