"""Experiments and one-off probes: diagnostics that answered one question during development (static instruction
counts, profiler harnesses, probes), run as `python -m benchmarks.experiments.<script>`. Their output is not a result;
the dated notes under benchmarks/notes/ say what each found."""
