"""One module per command; each exposes `register(app)`. The order here is the order `oscar-zoo --help` lists."""

from . import calibrate, export, import_oscar, inspect, list_cmd, pull, push, verify

COMMAND_MODULES = [calibrate, verify, inspect, push, pull, list_cmd, export, import_oscar]
