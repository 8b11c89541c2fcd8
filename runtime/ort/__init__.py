"""The ONNX Runtime backend (sessions.py: the graphs' sessions and the shared weights, read-only
after load; backend.py: what a sequence or several rows own and the calls over them;
row_cache.py: the host caches of batched rows)."""
