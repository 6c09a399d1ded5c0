"""Facts about the machines a run is on or planned for: ``device`` (which device runs,
its measured or datasheet peak, peak memory, CPU matmul capability) and ``gpus`` (the GPU
table of conf/gpu/: memory, peaks per dtype, links). A floor: it imports nothing of the
project but the paths."""
