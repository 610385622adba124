"""Engine plugins: register inference engines with the control plane over gRPC."""
