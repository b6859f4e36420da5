"""The benchmarks behind RESULTS.md and QUALITY.md, one module per script, run from the repository root as
`python -m benchmarks.<script>` (README.md lists them); `benchmarks.experiments` holds the experiments and one-off
probes. Importable with torch, triton and transformers alone (the GPU machines have nothing else)."""
