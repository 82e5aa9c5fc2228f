"""The whole decoder of a CPU step as one C call (decode_step.c for a few decodes, packed_step.c
for the rest), on the C kernels' shared headers and build (services/worker/cpu/)."""
