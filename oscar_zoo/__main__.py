"""`python -m oscar_zoo` (and `torchrun -m oscar_zoo`) runs the CLI."""

from .cli import main

main()
