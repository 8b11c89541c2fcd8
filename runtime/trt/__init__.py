"""The TensorRT backend (backend.py: engines on one CUDA stream; rows.py: several rows per call;
walk.py: DFlash 2's draft outputs) and the TensorRT arithmetic that needs no TensorRT (profiles.py).
NOT YET EXECUTED ON TENSORRT HARDWARE: checked against the real bindings' double (tests/trt_fake.py)."""
