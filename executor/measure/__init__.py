"""Measure or estimate: each planning node's time and workspace, as a profile the planner reads.

profiler measures them on the device within the budget (measuring chooses the schedule the measuring passes run, so
profiling keeps the budget from its first allocation; allocations reads the allocator's records); estimate prices
the captured operations for a GPU you do not have; convolution_scratch bounds the convolutions' scratch (their
implementations are the engine's: executor.engine.conv_algorithms); measured turns timed steps into a profile to re-plan on; batch_profiles
profiles a model at several batch sizes."""
