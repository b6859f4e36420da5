"""The OSCAR artifact format: the layout constants and the reference math every other package builds on.

Imports nothing but torch and the standard library; the runtime, calibration, evaluation, hub and export sit above it.
"""
