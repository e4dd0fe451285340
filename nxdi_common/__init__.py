"""nxdi_common: an NxD-Inference-compatible modeling library that runs on CPU (eager or traced per
bucket) and, when the Neuron SDK is installed, on AWS Inferentia/Trainium."""
