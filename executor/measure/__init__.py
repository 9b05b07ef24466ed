"""Measure or estimate: each planning node's time and workspace, as a profile the planner reads.

profiler measures them on the device within the budget (measuring chooses the schedule the measuring passes run, so
profiling keeps the budget from its first allocation; allocations reads the allocator's records); estimate prices
the captured operations for a GPU you do not have; conv_algorithms and convolution_scratch are the convolutions'
own implementations and scratch bounds; measured turns timed steps into a profile to re-plan on; batch_profiles
profiles a model at several batch sizes."""
