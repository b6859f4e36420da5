export PYTHONPATH=. PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 -c "import transformers; print('transformers', transformers.__version__)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_compiled_step.py -k "qwen3 and not moe" 2>&1 | tail -4
timeout 330 python3 benchmarks/bench_generate.py --contexts 100000 --batches 1 8 --budget-contexts --phases --key-bits 2.7 --compile 2>&1 | tee $OUT/bench_compile.log | grep -E "^\||compiled|kernels "
