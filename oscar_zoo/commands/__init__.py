"""One module per command; each exposes `register(app)`. Add new command modules to COMMAND_MODULES."""

from . import calibrate, inspect

COMMAND_MODULES = [calibrate, inspect]
