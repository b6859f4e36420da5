"""Interchange with the OSCAR reference implementation: its `.pt` rotation files (import and export) and the
settings its SGLang runtime reads."""
