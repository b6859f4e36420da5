"""The OSCAR INT2 KV-cache runtime for transformers: `attention.enable_oscar(model)`, `cache.OscarCache`
(`from_folder`, or `Rotations` + `CacheSettings`), the launch settings `config.RuntimeConfig`. Importable with torch
and transformers alone; Triton is imported where a kernel first launches. Modules and their layering:
docs/architecture.md; usage: docs/runtime.md."""
