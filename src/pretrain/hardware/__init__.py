"""Facts about the machines a run is on or planned for: ``device`` (which device runs,
its measured or datasheet peak, peak memory, CPU matmul capability) and ``gpus`` (the GPU
table of conf/gpu/: memory, peaks per dtype, links) and ``profiler_trace`` (what a
torch.profiler trace says about where a step's time went: read by the run's profiler
service, train/services/profiler.py, and tools/trace_summary.py). A floor: it imports nothing of the
project but the paths."""
