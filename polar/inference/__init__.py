"""The inference service: engines that sample token ids with log-probabilities, behind gRPC."""
