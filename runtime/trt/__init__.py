"""The TensorRT backend (engines.py: the engines, checked against the build record, and the
TensorRT / CUDA imports; backend.py: device buffers and the calls, one row or several); its
optimization profiles, shared with ONNX Runtime's TensorRT provider, are runtime/profiles.py.
NOT YET EXECUTED ON TENSORRT HARDWARE: checked against the real bindings' double (tests/trt_fake.py)."""
