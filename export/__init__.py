"""Turns models/ into artifacts that satisfy runtime/'s contract (ONNX, TensorRT)."""
