"""The step engine: what runs a planned step, below both measuring and replay.

Generated code for a schedule (codegen), its runtime (transfers on their streams, RNG states, gradients, the
ledger), the kernels a node may run as (convolution algorithms, Inductor kernels and regions, batch norm
decomposed), what the device holds around a step (device_memory), and the schedules the stages above need to
measure under (schedules). Capture is below it; measure, plan and replay import it, never the other way.
"""
