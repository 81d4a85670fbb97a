"""Multi-LoRA serving on the worker: PEFT adapters in GPU slots, applied per row of a mixed batch.

* `adapter`: read a PEFT folder's A/B matrices into a slot, in the model's fused and sharded
  layout (q|k|v and gate|up merged; column-parallel layers shard B's rows, row-parallel A's
  columns, as the base weights);
* `layer`: the hook a linear layer calls after its GEMM (`ShardedLinear.lora`): one batched
  shrink and one expand over every row that uses an adapter (`kernels.triton.lora`, or the
  PyTorch twins on the CPU);
* `slots`: the worker's `max_loras` slots, loaded on demand, least recently used first out,
  and the step's row -> slot mapping (`LoRABatch`).
"""
