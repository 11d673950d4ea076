"""``engram-trt build``: checkpoint -> ONNX graph -> TensorRT engine folder, the tables
described in a manifest and left outside the engine."""
