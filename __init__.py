"""dflash-export: DFlash speculative decoding on ONNX Runtime and TensorRT."""

__version__ = "0.1.0"
