"""The torch-free edge runtime: numpy + onnxruntime. Owns the artifact contract."""
