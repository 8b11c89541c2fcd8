"""The ONNX Runtime backend (backend.py: sessions, IO binding; rows.py: one row's or several rows'
buffers and calls; row_cache.py: the host caches of batched rows)."""
