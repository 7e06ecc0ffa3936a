"""A cost model of aspen's fused GPU step that runs on a CPU (issue 47, item 6): the real step code runs on a
virtual CUDA device (`virtual_cuda`), every kernel-level operation is recorded with its FLOPs, bytes and
launches (`recorder`), each is given a GPU time from the card's ceilings (`card`), and a timeline of the host
issuing them and the GPU running them predicts the step (`timeline`). `bench/gpu_cost_model.py` is the command;
docs/cost_model.md says how it works and how well it does."""
